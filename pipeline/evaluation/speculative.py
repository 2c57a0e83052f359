"""Chain speculative decoding with greedy verification, and the acceptance metrics it yields.

One round: the drafter proposes k tokens from its own predicted features, the target
runs once over the sequence plus the proposal, the longest prefix of the proposal that
matches the target's greedy choices is kept, plus one token from the target. So the
output is exactly the target's greedy decoding; only the number of target forwards
changes. Metrics follow vLLM's names:

    mean acceptance length  tau = 1 + accepted / rounds       (tokens per target forward)
    acceptance rate             = accepted / (rounds * k)
    per-position acceptance [j] = share of rounds whose first j+1 proposals were all kept
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import LlamaForCausalLM

from pipeline.models import target as target_lib
from pipeline.models.eagle import EagleDrafter
from pipeline.models.eagle3 import Eagle3Drafter, TTTCache


class Proposer(Protocol):
    # Target layers (vLLM ids) the proposer reads; None = the post-norm last layer.
    layer_ids: list[int] | None

    def propose(self, tokens: torch.Tensor, features: torch.Tensor, k: int) -> torch.Tensor:
        """tokens (T,) committed so far, features (T-1, D) of tokens[:-1] -> (k,) proposed tokens."""
        ...


def _features(out: target_lib.TargetOutput, layer_ids: list[int] | None) -> torch.Tensor:
    """(1, T, D) what a proposer reads from a target forward."""
    return out.features if layer_ids is None else out.layers.flatten(2)


class EagleProposer:
    """Drafts with an EAGLE drafter: pairs (f_i, x_{i+1}), then its own predicted features."""

    layer_ids = None

    def __init__(self, drafter: EagleDrafter) -> None:
        self.drafter = drafter.eval()

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, features: torch.Tensor, k: int) -> torch.Tensor:
        feats = features.float()  # (T-1, H)
        ids = tokens[1:]  # (T-1,)
        proposal = []
        for _ in range(k):
            n = ids.shape[0]
            mask = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()[None, None]  # (1, 1, n, n)
            positions = torch.arange(n, device=ids.device)[None]  # (1, n)
            predicted = self.drafter(feats[None], ids[None], positions, mask)[0, -1]  # (H,)
            token = self.drafter.lm_head(predicted).argmax()
            proposal.append(token)
            feats = torch.cat([feats, predicted[None]])
            ids = torch.cat([ids, token[None]])
        return torch.stack(proposal)


class Eagle3Proposer:
    """Drafts with an EAGLE-3 drafter: step 0 over the whole prefix, then one query per step
    at the last position with the TTT cache (the runtime's attention pattern)."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter.eval()
        self.layer_ids = list(drafter.config.aux_layer_ids)

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, features: torch.Tensor, k: int) -> torch.Tensor:
        d = self.drafter
        n = tokens.shape[0] - 1
        positions = torch.arange(n, device=tokens.device)[None]  # (1, n)
        cache = TTTCache()
        causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()[None, None]  # (1, 1, n, n)
        state = d.step(tokens[None, 1:], d.project_aux(features[None].float()), positions, causal, cache)
        state = state[:, -1:]  # (1, 1, H): only the last position drafts
        everything = torch.ones(1, 1, 1, n, dtype=torch.bool, device=tokens.device)
        proposal = []
        for j in range(k):
            token = d.draft_to_target[d.lm_head(d.logits_input(state)).argmax(-1)]  # (1, 1) target ids
            proposal.append(token[0, 0])
            if j + 1 < k:
                state = d.step(token, state, positions[:, -1:], everything, cache)
        return torch.stack(proposal)


def make_proposer(drafter: EagleDrafter | Eagle3Drafter) -> EagleProposer | Eagle3Proposer:
    return Eagle3Proposer(drafter) if isinstance(drafter, Eagle3Drafter) else EagleProposer(drafter)


@dataclass
class GenerationTrace:
    tokens: list[int]  # generated tokens (prompt excluded), exactly max_new_tokens
    accepted_per_round: list[int] = field(default_factory=list)


@torch.no_grad()
def greedy_generate(model: LlamaForCausalLM, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Plain greedy decoding: the reference speculative decoding must reproduce."""
    tokens = prompt.clone()
    for _ in range(max_new_tokens):
        logits = target_lib.forward(model, tokens[None]).logits[0, -1]
        tokens = torch.cat([tokens, logits.argmax()[None]])
    return tokens[prompt.shape[0] :].tolist()


@torch.no_grad()
def speculative_generate(
    model: LlamaForCausalLM, proposer: Proposer, prompt: torch.Tensor, max_new_tokens: int, k: int
) -> GenerationTrace:
    out = target_lib.forward(model, prompt[None], proposer.layer_ids)
    tokens = torch.cat([prompt, out.logits[0, -1].argmax()[None]])  # prefill yields the first token
    features = _features(out, proposer.layer_ids)[0]  # (T-1, D) features of all tokens but the newest
    trace = GenerationTrace(tokens=[])
    while tokens.shape[0] - prompt.shape[0] < max_new_tokens:
        T = tokens.shape[0]
        proposal = proposer.propose(tokens, features, k)  # (k,)
        out = target_lib.forward(model, torch.cat([tokens, proposal])[None], proposer.layer_ids)
        greedy = out.logits[0, T - 1 :].argmax(dim=-1)  # (k+1,) the target's choice for positions T..T+k
        matches = (proposal == greedy[:k]).int()
        accepted = int(matches.cumprod(dim=0).sum())
        tokens = torch.cat([tokens, proposal[:accepted], greedy[accepted : accepted + 1]])
        features = _features(out, proposer.layer_ids)[0, : T + accepted]
        trace.accepted_per_round.append(accepted)
    trace.tokens = tokens[prompt.shape[0] : prompt.shape[0] + max_new_tokens].tolist()
    return trace


@dataclass(frozen=True)
class AcceptanceMetrics:
    tau: float
    acceptance_rate: float
    per_position: list[float]
    rounds: int
    drafted: int
    accepted: int

    def as_dict(self) -> dict:
        return {
            "tau": self.tau, "acceptance_rate": self.acceptance_rate, "per_position": self.per_position,
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
        }


def acceptance_metrics(accepted_per_round: list[int], k: int) -> AcceptanceMetrics:
    rounds = len(accepted_per_round)
    if rounds == 0:
        raise ValueError("no speculative rounds to measure")
    accepted = sum(accepted_per_round)
    per_position = [sum(a > j for a in accepted_per_round) / rounds for j in range(k)]
    return AcceptanceMetrics(
        tau=1 + accepted / rounds, acceptance_rate=accepted / (rounds * k), per_position=per_position,
        rounds=rounds, drafted=rounds * k, accepted=accepted,
    )


def evaluate(
    model: LlamaForCausalLM, proposer: Proposer, prompts: list[torch.Tensor], max_new_tokens: int, k: int
) -> AcceptanceMetrics:
    """Acceptance of `proposer` against `model` over held-out prompts."""
    rounds: list[int] = []
    for prompt in prompts:
        rounds += speculative_generate(model, proposer, prompt, max_new_tokens, k).accepted_per_round
    return acceptance_metrics(rounds, k)
