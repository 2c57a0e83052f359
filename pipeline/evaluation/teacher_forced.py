"""A cheap estimate of acceptance: one batched, teacher-forced pass over held-out rollouts.

Exact acceptance (speculative.evaluate) decodes: a target forward per round. This estimate
runs the target once over whole rollouts and the drafter once per draft step, all
positions at once (the TTT unroll of training, like NeMo's tau_sim or SpecForge's
per-step accuracy): at a response position t, step j drafts token t+2+j from the rollout's
tokens up to t+1+j and the drafter's own earlier steps, and is accepted when it equals the
target's greedy choice there.

Decoding's text after the prompt is the target's greedy text; a rollout's is sampled. So a
step counts only where its context is what decoding would have fed it: token t+1 (the
round's start) and the tokens step j reads (t+2..t+1+j, decoding's accepted drafts) are the
target's greedy choices, and so is token t unless t+1 is the first response token. Each step
gets its acceptance rate given the earlier ones, over the starts whose context qualifies:

    alpha[j]        = starts whose steps 0..j matched / starts whose steps 0..j-1 matched
    per_position[j] = alpha[0] * ... * alpha[j]
    tau             = 1 + sum_j per_position[j]

On greedy text every start qualifies and this is exact, start by start. On sampled text it
still reads low (the earlier context is sampled; see benchmarks/evaluation.py).

Under sampling (`sampled`: the rollouts were sampled, and the estimate is at their own
parameters) the rollout itself is a draw of what speculative decoding emits: with greedy
drafting a draft is kept exactly when the emitted token is the draft (a rejected draft's
replacement never is), and speculative sampling emits what sampling the target does. So a
step is kept where the drafter's token equals the rollout's, every start qualifies, and

    per_position[j] = share of starts whose steps 0..j all drew the rollout's tokens

which is what vLLM's rule gives in expectation, start by start (for greedy drafting; sampled
drafts are kept more often than this counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaForCausalLM

from pipeline.evaluation.speculative import features_for
from pipeline.models import target_forward
from pipeline.models.drafter import Drafter
from pipeline.models.ttt import UnrollPrefix
from pipeline.ranks import SINGLE, Ranks


@dataclass(frozen=True)
class AcceptanceEstimate:
    tau: float
    per_position: list[float]
    sequences: int  # rollouts read
    positions: int  # start positions whose first step counts

    def as_dict(self) -> dict:
        return {"tau": self.tau, "per_position": self.per_position, "sequences": self.sequences,
                "positions": self.positions}


CHUNK_TOKENS = 512  # columns per pass by default (`eval.estimate_chunk_tokens`)


@torch.no_grad()
def estimate_acceptance(
    model: LlamaForCausalLM, drafter: Drafter, sequences: list[torch.Tensor], prompt_lens: list[int], k: int,
    batch_size: int = 16, ranks: Ranks = SINGLE, sampled: bool = False, chunk_tokens: int | None = CHUNK_TOKENS,
) -> AcceptanceEstimate | None:
    """Teacher-forced per-position acceptance of `drafter` (attached, on the target's device and dtype)
    over `sequences` (prompt + response tokens), `batch_size` sequences per pass; None when no
    response has k tokens (nothing to estimate on). `sampled`: at the rollouts' own sampling parameters,
    drafts kept where they draw the rollout's tokens; else greedily. On several `ranks` each runs every
    world_size-th pass and the ranks sum their integer counts: the estimate of one process.

    A pass runs `chunk_tokens` columns at a time (None: all at once), the target over its key/value cache and
    the drafter after the earlier chunks' keys (`UnrollPrefix`): the counts are the whole pass's, while the
    logits, the target's layers and the attention scores held at once are a chunk's (B, C, V), (B, C, L, H)
    and (B, heads, C, T), not (B, T, V), (B, T, L, H) and (B, heads, T, T)."""
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")
    accepted = torch.zeros(k, dtype=torch.float64)  # per step: qualifying starts whose steps 0..j matched
    reached = torch.zeros(k, dtype=torch.float64)  # per step: qualifying starts whose steps 0..j-1 matched
    for first in ranks.mine(range(0, len(sequences), batch_size)):
        batch_accepted, batch_reached = _count_pass(
            model, drafter, sequences[first : first + batch_size], prompt_lens[first : first + batch_size], k,
            sampled, chunk_tokens)
        accepted += batch_accepted
        reached += batch_reached
    totals = ranks.sum_counts([int(c) for c in (*accepted.tolist(), *reached.tolist())])
    accepted, reached = torch.tensor(totals[:k], dtype=torch.float64), torch.tensor(totals[k:], dtype=torch.float64)
    if reached[0] == 0:
        return None
    rates = [float(a / r) if r else 0.0 for a, r in zip(accepted, reached, strict=True)]
    per_position = [math.prod(rates[: j + 1]) for j in range(k)]
    return AcceptanceEstimate(tau=1 + sum(per_position), per_position=per_position, sequences=len(sequences),
                              positions=int(reached[0]))


def _count_pass(
    model: LlamaForCausalLM, drafter: Drafter, batch: list[torch.Tensor], prompts: list[int], k: int, sampled: bool,
    chunk_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over `batch` -> (k,) accepted and (k,) reached counts."""
    device = model.device
    B, T = len(batch), max(s.shape[0] for s in batch)
    C = T if chunk_tokens is None else min(chunk_tokens, T)
    ids = torch.zeros(B, T, dtype=torch.int64, device=device)  # (B, T) right-padded
    for b, s in enumerate(batch):
        ids[b, : s.shape[0]] = s.to(device)
    lengths = torch.tensor([s.shape[0] for s in batch], device=device)  # (B,)
    valid = torch.arange(T, device=device)[None] < lengths[:, None]  # (B, T)
    positions = torch.arange(T, device=device).expand(B, T)  # (B, T)
    # The target, C columns at a time over its cache: what the drafter reads and what greedy decoding emits.
    cache = DynamicCache()
    features, choices = [], []
    for start in range(0, T, C):
        end = min(T, start + C)
        out = target_forward.forward(model, ids[:, start:end], drafter.decode_layer_ids,
                                     attention_mask=valid[:, :end].long(), position_ids=positions[:, start:end],
                                     past_key_values=cache)
        features.append(features_for(out, drafter.decode_layer_ids))  # (B, C, D)
        if not sampled:
            choices.append(out.logits.argmax(-1))  # (B, C)
        del out
    del cache
    n = T - 1  # pairs (f_t, x_{t+1}), t < T - 1
    features = torch.cat(features, dim=1)[:, :n]  # (B, n, D)
    t = torch.arange(n, device=device)  # (n,)
    first_start = torch.tensor(prompts, device=device)[:, None] - 1  # (B, 1): the first round's pair
    context = (t[None] >= first_start) & (t[None] + k <= lengths[:, None] - 1)  # (B, n)
    if sampled:  # the rollout is a draw of decoding: its tokens are what it emitted, each on decoding's path
        emitted = ids[:, 1:]  # (B, n): emitted[:, p] is token p + 1
        on_path = torch.ones_like(context)
    else:  # greedy decoding emits the target's choices; a sampled rollout leaves that path where it differs
        emitted = torch.cat(choices, dim=1)  # (B, T): emitted[:, p] is the target's choice for token p + 1
        on_path = ids[:, 1:] == emitted[:, :n]  # (B, n): token t+1 is the target's choice at t
        context &= torch.nn.functional.pad(on_path, (1, 0))[:, :n] | (t[None] == first_start)
    step_ids = [_shifted(ids, 1 + j, n) for j in range(k)]  # x_{t+1+j}, (B, n) each
    drafted = [_shifted(emitted, 1 + j, n) for j in range(k)]  # what column t+1+j emits
    reads = [_shifted(on_path, j, n) for j in range(k)]  # step j reads token t+1+j: decoding's accepted draft
    # The drafter, C positions at a time after the earlier chunks' keys: the same drafts as one unroll.
    prefix = UnrollPrefix()
    accepted, reached = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    for start in range(0, n, C):
        end = min(n, start + C)
        query = t[start:end]  # (C,)
        mask = valid[:, None, None, :end] & (t[None, :end] <= query[:, None])[None, None]  # (B, 1, C, P + C)
        drafts = drafter.draft_unrolled(features[:, start:end], [x[:, start:end] for x in step_ids],
                                        positions[:, start:end], mask, prefix)  # (k, B, C)
        qualifies = context[:, start:end].clone()  # (B, C)
        matched = torch.ones_like(qualifies)
        for j in range(k):
            qualifies &= reads[j][:, start:end]
            reached[j] += float((matched & qualifies).sum())
            matched &= drafts[j] == drafted[j][:, start:end]  # step j drafts what column t+1+j emits
            accepted[j] += float((matched & qualifies).sum())
    return accepted, reached


def _shifted(x: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """x (B, T) -> (B, n): column t holds x[:, t + offset] (zero/False past the end)."""
    return torch.nn.functional.pad(x[:, offset:], (0, offset))[:, :n]

