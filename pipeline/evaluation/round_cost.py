"""The speedup a drafter's round buys, estimated before any timing: `pipeline/accounting/cost.py`'s model (which the
ledger feeds with measured timings) with c taken from the weights each forward reads.

Decoding is bound by reading weights: a forward reads each weight once whether it scores one
position or k + 1. So a round costs one target forward (the pending token and k drafts, verified
at once) plus F drafter forwards of c target forwards each, c being the ratio of the weights each
reads (embedding tables not counted: a forward reads a few rows of them; lm_heads counted):

    round time        = 1 + F c            in target forwards
    tokens per round  = tau
    speedup           = tau / (1 + F c)    over greedy decoding, one target forward per token

F is k for EAGLE-1/2 and EAGLE-3 (a forward per drafted token) and 1 for P-EAGLE (one forward
proposes all k), so a round's drafter cost counts forwards, not tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaForCausalLM

from pipeline.accounting.cost import DecodingCost
from pipeline.evaluation import speculative
from pipeline.models.drafter import Proposer
from pipeline.sampling import GREEDY, DraftSampleMethod, SamplingParams


@dataclass(frozen=True)
class RoundCost:
    k: int
    tau: float
    drafter_forwards_per_round: float
    drafter_cost_ratio: float  # c: one drafter forward in target forwards

    @property
    def speedup(self) -> float:
        f = round(self.drafter_forwards_per_round)
        return DecodingCost(1.0, self.drafter_cost_ratio, f).speedup(self.tau)  # t cancels out of a speedup

    @property
    def drafter_forwards_per_token(self) -> float:
        return self.drafter_forwards_per_round / self.tau

    def to_json(self) -> dict:
        return {"k": self.k, "tau": round(self.tau, 4),
                "drafter_forwards_per_round": round(self.drafter_forwards_per_round, 4),
                "drafter_forwards_per_token": round(self.drafter_forwards_per_token, 4),
                "drafter_cost_ratio": round(self.drafter_cost_ratio, 4), "estimated_speedup": round(self.speedup, 4)}


def weights_read(model: nn.Module) -> int:
    """Parameters a decoding forward reads: all but the embedding tables (a tied lm_head counts once)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if "embed_tokens" in name or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def drafter_cost_ratio(drafter: nn.Module, target: nn.Module) -> float:
    """c: the weights one drafter forward reads over those one target forward reads."""
    return weights_read(drafter) / weights_read(target)


def round_costs(
    target: LlamaForCausalLM, drafter: nn.Module, new_proposer: Callable[[], Proposer], prompts: list[torch.Tensor],
    max_new_tokens: int, ks: list[int], params: SamplingParams = GREEDY, draft_method: DraftSampleMethod = "greedy",
    seed: int = 0,
) -> list[RoundCost]:
    """Exact tau (at `params`, drafted by `draft_method`) and forwards per round of the drafter at each k
    (speculative decoding of `prompts`)."""
    c = drafter_cost_ratio(drafter, target)
    costs = []
    for k in ks:
        metrics = speculative.evaluate(target, new_proposer, prompts, max_new_tokens, k, params=params,
                                       draft_method=draft_method, seed=seed)
        costs.append(RoundCost(k, metrics.tau, metrics.drafter_forwards_per_round or float(k), c))
    return costs
