"""Speculative sampling as vLLM verifies drafts: the one rule evaluation and the stand-in fleet share.

vLLM's rule (`vllm/v1/sample/rejection_sampler.py`), per request of a batch, over its k drafts:

    p_j        the target's distribution at draft position j, after temperature, top-k and top-p
               (a greedy request's is one-hot at the target's argmax)
    q_j        the drafter's distribution when it sampled the draft (`probabilistic`); with
               `greedy` drafting (vLLM's default for EAGLE) no q: the draft is one-hot
    accept d_j when p_j(d_j) / q_j(d_j) >= u_j, u_j ~ U[0, 1) (greedy drafting: p_j(d_j) >= u_j),
               while every earlier draft was accepted
    rejected   at j: the token is drawn from max(p_j - q_j, 0), renormalized (greedy drafting: p_j
               with d_j's mass removed): the "recovered" token, and the round ends
    all kept   a bonus token is drawn from p_k

So every emitted token is distributed exactly as sampling from the target (tests/unit/evaluation/
test_rejection_sampler.py measures it), and a greedy request reduces to "accept while the draft
is the argmax", the temperature-0 case. Draws use the exponential race vLLM samples with
(argmax of probs / E, E ~ Exp(1) per token), each request from its own generator, a fixed number
of draws per round: a seeded request decodes the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.sampling import DraftSampleMethod, SamplingParams


@dataclass
class RequestSampling:
    """One request's sampling: its parameters and its own random stream."""

    params: SamplingParams
    generator: torch.Generator

    @classmethod
    def seeded(cls, params: SamplingParams, seed: int, device: torch.device | str = "cpu") -> RequestSampling:
        return cls(params, torch.Generator(device=device).manual_seed(seed))


@dataclass(frozen=True)
class RoundDraws:
    """A round's random numbers, per request: drawn whether the round needs them or not, so that a request's
    stream advances the same way whatever its outcome."""

    uniform: torch.Tensor  # (B, k) acceptance thresholds
    recovery: torch.Tensor  # (B, V) Exp(1): the recovered token's race (one per request, as vLLM's)
    bonus: torch.Tensor  # (B, V) Exp(1): the bonus token's race


@dataclass(frozen=True)
class Verdict:
    accepted: torch.Tensor  # (B,) drafts kept
    next_tokens: torch.Tensor  # (B,) the token after them: recovered, or the bonus when all were kept


class BatchSampling:
    """The sampling of a batch's rows, row b being request b: processed target distributions and each row's draws."""

    def __init__(self, rows: list[RequestSampling]) -> None:
        self.rows = rows

    @classmethod
    def greedy(cls, batch_size: int) -> BatchSampling:
        """Every row greedy: the distributions are one-hot and no draw ever decides a token."""
        return cls([RequestSampling(SamplingParams(temperature=0.0), torch.Generator()) for _ in range(batch_size)])

    def __len__(self) -> int:
        return len(self.rows)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, N, V) logits -> (B, N, V) float32 distributions each row samples from (one-hot for greedy rows)."""
        return processed_probs(logits, [r.params for r in self.rows])

    def round_draws(self, k: int, vocab_size: int, device: torch.device) -> RoundDraws:
        uniform, recovery, bonus = [], [], []
        for row in self.rows:
            g = row.generator
            uniform.append(torch.rand(k, generator=g, device=g.device, dtype=torch.float64))
            recovery.append(torch.empty(vocab_size, device=g.device).exponential_(generator=g))
            bonus.append(torch.empty(vocab_size, device=g.device).exponential_(generator=g))
        return RoundDraws(torch.stack(uniform).to(device), torch.stack(recovery).to(device),
                          torch.stack(bonus).to(device))

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """(B, V) distributions -> (B,) one token per row, from the row's stream (the first token of a request)."""
        races = torch.stack([torch.empty(probs.shape[-1], device=r.generator.device).exponential_(generator=r.generator)
                             for r in self.rows]).to(probs.device)
        return race(probs, races)

    def select(self, rows: list[int]) -> BatchSampling:
        """The sampling of a sub-batch (requests leaving a batch keep their streams)."""
        return BatchSampling([self.rows[b] for b in rows])


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(B, N, V) logits -> (B, N, V) float32 probabilities as vLLM samples: temperature, then top-k and top-p
    over the tempered logits, then softmax. A greedy row's distribution is one-hot at its argmax."""
    logits = logits.float()
    B, N, V = logits.shape
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)  # (B,)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
    tempered = logits / temperature[:, None, None]  # (B, N, V)
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    top_p = [p.top_p for p in params]
    if any(top_k) or any(p < 1.0 for p in top_p):
        tempered = _top_k_top_p(tempered, top_k, top_p)
    probs = tempered.softmax(dim=-1)  # (B, N, V)
    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """(B, N, V) tempered logits with the tokens outside each row's top-k, then outside its top-p nucleus (the
    smallest set of most likely tokens whose probability reaches top_p), masked to -inf."""
    B, N, V = logits.shape
    ordered, order = logits.sort(dim=-1, descending=True)  # (B, N, V)
    rank = torch.arange(V, device=logits.device)  # (V,)
    k = torch.tensor([kk or V for kk in top_k], device=logits.device)  # (B,)
    keep = (rank[None, None] < k[:, None, None]).expand(B, N, V)  # (B, N, V) in rank order
    ordered = ordered.masked_fill(~keep, float("-inf"))
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)  # (B,)
    probs = ordered.softmax(dim=-1)  # (B, N, V)
    before = probs.cumsum(dim=-1) - probs  # (B, N, V) the mass of the likelier tokens
    # The most likely token always stays, whatever top_p is: a nucleus of no token has no distribution.
    keep = keep & ((before < p[:, None, None]) | (rank == 0))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered.masked_fill(~keep, float("-inf")))


def race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """(B, V) unnormalized probabilities and Exp(1) draws -> (B,) argmax of probs / E: a sample of probs."""
    return (probs / exponentials).argmax(dim=-1)


def verify(
    target_probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None, draws: RoundDraws
) -> Verdict:
    """vLLM's verification of one round.

    target_probs: (B, k+1, V) the target's processed distributions after the pending token and each draft
    drafts:       (B, k) draft token ids
    draft_probs:  (B, k, V) the drafter's distributions it sampled the drafts from; None: greedy drafting
    """
    B, k = drafts.shape
    rows = torch.arange(B, device=drafts.device)
    p_draft = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1).double()  # (B, k)
    if draft_probs is None:
        ratio = p_draft
        draft_mass = torch.zeros_like(target_probs[:, :k]).scatter_(-1, drafts[..., None], 1.0)  # (B, k, V) one-hot
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1).double()  # (B, k)
        ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(1e-300), torch.zeros_like(p_draft))
        draft_mass = draft_probs.float()
    accept = (p_draft > 0) & (ratio >= draws.uniform)  # (B, k): a token the target never samples is never kept
    accepted = accept.long().cumprod(dim=1).sum(dim=1)  # (B,)
    first_rejected = accepted.clamp(max=k - 1)  # (B,) where the round ends when it ends early
    residual = (target_probs[rows, first_rejected] - draft_mass[rows, first_rejected]).clamp_min(0)  # (B, V)
    recovered = race(residual, draws.recovery)  # (B,)
    bonus = race(target_probs[:, k], draws.bonus)  # (B,)
    return Verdict(accepted, torch.where(accepted == k, bonus, recovered))


class DraftSampler:
    """How a proposer turns its logits into draft tokens (models/drafter.py's DraftChooser): `greedy` proposes the
    argmax and keeps no q; `probabilistic` samples the drafter's distribution at each row's parameters and keeps
    q for the rule. A proposal's q are taken once per round (`take`)."""

    def __init__(self, method: DraftSampleMethod, sampling: BatchSampling) -> None:
        self.method, self.sampling = method, sampling
        self._probs: list[torch.Tensor] = []

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) the drafter's logits over the target vocabulary (-inf outside its draft vocabulary) -> (B,)."""
        if self.method == "greedy":
            return logits.argmax(dim=-1)
        probs = self.sampling.probs(logits[:, None])[:, 0]  # (B, V)
        self._probs.append(probs)
        return self.sampling.sample(probs)

    def take(self) -> torch.Tensor | None:
        """(B, k, V) the q of the proposal just made; None for greedy drafting."""
        if self.method == "greedy":
            return None
        probs, self._probs = torch.stack(self._probs, dim=1), []
        return probs
