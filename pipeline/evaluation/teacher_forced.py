"""A cheap estimate of acceptance: one batched, teacher-forced pass over held-out rollouts.

Exact acceptance (speculative.evaluate) decodes: a target forward per round. This estimate
runs the target once over whole rollouts and the drafter once per draft step, all
positions at once (the TTT unroll of training, like NeMo's tau_sim or SpecForge's
per-step accuracy): at a response position t, step j drafts token t+2+j from the rollout's
tokens up to t+1+j and the drafter's own earlier steps, and counts as accepted when it and
every earlier step equal the target's greedy choice there. Only positions whose token t+1 is
the target's greedy choice start a chain: in decoding, the token a round starts from always is.

    per_position[j] = share of start positions whose steps 0..j all match
    tau             = 1 + sum_j per_position[j]

Its contexts are the rollouts' sampled text where decoding's are the target's greedy text,
so it estimates, not reproduces, tau (on the demo's temperature-1 rollouts it reads low;
see benchmarks/evaluation.py); on greedy text it is exact, start by start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from pipeline.evaluation.speculative import features_for
from pipeline.models import target as target_lib
from pipeline.models.drafter import Drafter


@dataclass(frozen=True)
class AcceptanceEstimate:
    tau: float
    per_position: list[float]
    sequences: int  # rollouts read
    positions: int  # draft start positions the shares average over

    def as_dict(self) -> dict:
        return {"tau": self.tau, "per_position": self.per_position, "sequences": self.sequences,
                "positions": self.positions}


@torch.no_grad()
def estimate_acceptance(
    model: LlamaForCausalLM, drafter: Drafter, sequences: list[torch.Tensor], prompt_lens: list[int], k: int,
    batch_size: int = 16,
) -> AcceptanceEstimate | None:
    """Teacher-forced per-position acceptance of `drafter` (attached, on the target's device and dtype)
    over `sequences` (prompt + response tokens), `batch_size` sequences per pass; None when no
    response has k tokens (nothing to estimate on)."""
    device = model.device
    chains = torch.zeros(k, dtype=torch.float64)  # summed over start positions: steps 0..j all matched
    starts = 0
    for first in range(0, len(sequences), batch_size):
        batch, prompts = sequences[first : first + batch_size], prompt_lens[first : first + batch_size]
        B, T = len(batch), max(s.shape[0] for s in batch)
        ids = torch.zeros(B, T, dtype=torch.int64, device=device)  # (B, T) right-padded
        for b, s in enumerate(batch):
            ids[b, : s.shape[0]] = s.to(device)
        lengths = torch.tensor([s.shape[0] for s in batch], device=device)  # (B,)
        valid = torch.arange(T, device=device)[None] < lengths[:, None]  # (B, T)
        out = target_lib.forward(model, ids, drafter.decode_layer_ids, attention_mask=valid.long())
        greedy = out.logits.argmax(-1)  # (B, T): greedy[:, p] is the target's choice for token p + 1
        n = T - 1  # pairs (f_t, x_{t+1}), t < T - 1
        features = features_for(out, drafter.decode_layer_ids)[:, :n]  # (B, n, D)
        mask = valid[:, None, None, :n] & torch.ones(n, n, dtype=torch.bool, device=device).tril()  # (B, 1, n, n)
        positions = torch.arange(n, device=device).expand(B, n)  # (B, n)
        step_ids = [torch.nn.functional.pad(ids[:, 1 + j :], (0, j))[:, :n] for j in range(k)]  # x_{t+1+j}
        drafts = drafter.draft_unrolled(features, step_ids, positions, mask)  # (k, B, n)
        # step j at start t drafts token t+2+j, the target's greedy choice at column t+1+j
        t = torch.arange(n, device=device)  # (n,)
        first_start = torch.tensor(prompts, device=device)[:, None] - 1  # (B, 1): the first round's pair
        usable = (t[None] >= first_start) & (t[None] + k <= lengths[:, None] - 1)  # (B, n) all k steps checkable
        usable &= ids[:, 1:] == greedy[:, :n]  # token t+1 is the target's greedy choice, as decoding's always is
        matched = torch.ones(B, n, dtype=torch.bool, device=device)
        for j in range(k):
            reference = torch.nn.functional.pad(greedy[:, 1 + j :], (0, j))[:, :n]  # (B, n) column t+1+j
            matched &= drafts[j] == reference
            chains[j] += float((matched & usable).sum())
        starts += int(usable.sum())
    if starts == 0:
        return None
    per_position = (chains / starts).tolist()
    return AcceptanceEstimate(tau=1 + sum(per_position), per_position=per_position, sequences=len(sequences),
                              positions=starts)

