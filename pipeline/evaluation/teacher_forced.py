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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from pipeline.evaluation.speculative import features_for
from pipeline.models import target_forward
from pipeline.models.drafter import Drafter
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


@torch.no_grad()
def estimate_acceptance(
    model: LlamaForCausalLM, drafter: Drafter, sequences: list[torch.Tensor], prompt_lens: list[int], k: int,
    batch_size: int = 16, ranks: Ranks = SINGLE,
) -> AcceptanceEstimate | None:
    """Teacher-forced per-position acceptance of `drafter` (attached, on the target's device and dtype)
    over `sequences` (prompt + response tokens), `batch_size` sequences per pass; None when no
    response has k tokens (nothing to estimate on). On several `ranks` each runs every world_size-th
    pass and the ranks sum their integer counts: the estimate of one process."""
    device = model.device
    accepted = torch.zeros(k, dtype=torch.float64)  # per step: qualifying starts whose steps 0..j matched
    reached = torch.zeros(k, dtype=torch.float64)  # per step: qualifying starts whose steps 0..j-1 matched
    for first in ranks.mine(range(0, len(sequences), batch_size)):
        batch, prompts = sequences[first : first + batch_size], prompt_lens[first : first + batch_size]
        B, T = len(batch), max(s.shape[0] for s in batch)
        ids = torch.zeros(B, T, dtype=torch.int64, device=device)  # (B, T) right-padded
        for b, s in enumerate(batch):
            ids[b, : s.shape[0]] = s.to(device)
        lengths = torch.tensor([s.shape[0] for s in batch], device=device)  # (B,)
        valid = torch.arange(T, device=device)[None] < lengths[:, None]  # (B, T)
        out = target_forward.forward(model, ids, drafter.decode_layer_ids, attention_mask=valid.long())
        greedy = out.logits.argmax(-1)  # (B, T): greedy[:, p] is the target's choice for token p + 1
        n = T - 1  # pairs (f_t, x_{t+1}), t < T - 1
        features = features_for(out, drafter.decode_layer_ids)[:, :n]  # (B, n, D)
        mask = valid[:, None, None, :n] & torch.ones(n, n, dtype=torch.bool, device=device).tril()  # (B, 1, n, n)
        positions = torch.arange(n, device=device).expand(B, n)  # (B, n)
        step_ids = [_shifted(ids, 1 + j, n) for j in range(k)]  # x_{t+1+j}
        drafts = drafter.draft_unrolled(features, step_ids, positions, mask)  # (k, B, n)
        t = torch.arange(n, device=device)  # (n,)
        first_start = torch.tensor(prompts, device=device)[:, None] - 1  # (B, 1): the first round's pair
        greedy_next = ids[:, 1:] == greedy[:, :n]  # (B, n): token t+1 is the target's choice at t
        after_greedy = torch.nn.functional.pad(greedy_next, (1, 0))[:, :n] | (t[None] == first_start)  # (B, n)
        context = (t[None] >= first_start) & (t[None] + k <= lengths[:, None] - 1) & after_greedy  # (B, n)
        matched = torch.ones(B, n, dtype=torch.bool, device=device)
        for j in range(k):
            context &= _shifted(greedy_next, j, n)  # step j reads token t+1+j: decoding's accepted draft
            reached[j] += float((matched & context).sum())
            matched &= drafts[j] == _shifted(greedy, 1 + j, n)  # step j drafts the choice at column t+1+j
            accepted[j] += float((matched & context).sum())
    totals = ranks.sum_counts([int(c) for c in (*accepted.tolist(), *reached.tolist())])
    accepted, reached = torch.tensor(totals[:k], dtype=torch.float64), torch.tensor(totals[k:], dtype=torch.float64)
    if reached[0] == 0:
        return None
    rates = [float(a / r) if r else 0.0 for a, r in zip(accepted, reached, strict=True)]
    per_position = [math.prod(rates[: j + 1]) for j in range(k)]
    return AcceptanceEstimate(tau=1 + sum(per_position), per_position=per_position, sequences=len(sequences),
                              positions=int(reached[0]))


def _shifted(x: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """x (B, T) -> (B, n): column t holds x[:, t + offset] (zero/False past the end)."""
    return torch.nn.functional.pad(x[:, offset:], (0, offset))[:, :n]

