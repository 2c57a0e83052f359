"""Chain speculative decoding, batched over prompts, verified by vLLM's rule, and its metrics.

One round, for every row of the batch at once: the drafter proposes k tokens, the target
runs once over the row's pending token plus the proposal, and vLLM's rejection sampler
(`rejection_sampler.py`) keeps a prefix of the proposal and adds one token of the target's.
Each row's tokens are distributed as sampling the target at the row's parameters: at
temperature 0 they are exactly the target's greedy decoding; only the number of target
forwards changes.

Both models keep key/value caches, so a round costs k + 1 target positions and k drafter
forwards (EAGLE-1/2, EAGLE-3) or one (P-EAGLE) whatever the sequence length. Rows accept
different numbers of tokens: a row's rejected columns stay in the caches, masked (the
attention mask and per-row positions say what each row holds), and columns no row kept are
cropped off the end.

Metrics follow vLLM's names:

    mean acceptance length  tau = 1 + accepted / rounds       (tokens per target forward)
    acceptance rate             = accepted / (rounds * k)
    per-position acceptance [j] = share of rounds whose first j+1 proposals were all kept
    drafter forwards per round  = the proposers' forward passes / their proposals
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LlamaForCausalLM

from pipeline.cost import DecodingCost
from pipeline.data.sampling import GREEDY, DraftSampleMethod, SamplingParams
from pipeline.evaluation.rejection_sampler import BatchSampling, DraftSampler, RequestSampling, verify
from pipeline.models import target_forward
from pipeline.models.drafter import CommittedPairs, DraftChooser, Drafter, Proposer
from pipeline.ranks import SINGLE, Ranks


def features_for(out: target_forward.TargetOutput, layer_ids: list[int] | None) -> torch.Tensor:
    """(B, T, D) what a proposer reads from a target forward."""
    return out.features if layer_ids is None else out.layers.flatten(2)


def follow_target(drafter: Drafter, model: LlamaForCausalLM) -> Callable[[], Proposer]:
    """The drafter on the target's device and in its dtype; returns its proposer factory."""
    drafter.to(device=model.device, dtype=model.dtype)
    return drafter.proposer


@dataclass
class GenerationTrace:
    tokens: list[int]  # generated tokens (prompt excluded), exactly max_new_tokens
    accepted_per_round: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each token's log-probability under the raw target logits


@torch.no_grad()
def greedy_generate(model: LlamaForCausalLM, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, one full forward per token: the reference speculative decoding must reproduce."""
    tokens = prompt.clone()
    for _ in range(max_new_tokens):
        logits = target_forward.forward(model, tokens[None]).logits[0, -1]
        tokens = torch.cat([tokens, logits.argmax()[None]])
    return tokens[prompt.shape[0] :].tolist()


@dataclass
class TargetCache:
    """The target's key/value cache for a batch, with each cached column's position and whether a row may
    attend it (padding and rejected drafts may not)."""

    past: DynamicCache = field(default_factory=DynamicCache)
    positions: torch.Tensor | None = None  # (B, S)
    valid: torch.Tensor | None = None  # (B, S) bool

    def forward(
        self, model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor, new_valid: torch.Tensor,
        layer_ids: list[int] | None, logits_at: torch.Tensor | None = None,
    ) -> target_forward.TargetOutput:
        """input_ids, positions, new_valid (B, N): N new columns per row -> the target's output over them
        (logits at every new column, or at the column `logits_at` (B,) of each row)."""
        self.valid = new_valid if self.valid is None else torch.cat([self.valid, new_valid], dim=1)  # (B, S + N)
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=1)
        mask = target_forward.decoding_mask(model.config, self.positions, self.valid, positions, model.dtype)
        return target_forward.forward(model, input_ids, layer_ids, attention_mask=mask, position_ids=positions,
                                  past_key_values=self.past, logits_at=logits_at)

    def keep(self, new_valid: torch.Tensor) -> None:
        """Of the last call's columns, keep new_valid (B, N) per row; crop the ones no row kept off the end."""
        n = new_valid.shape[1]
        self.valid[:, -n:] = new_valid
        drop = n - int(new_valid.sum(dim=1).max())
        if drop:
            self.past.crop(-drop)
            self.valid, self.positions = self.valid[:, :-drop], self.positions[:, :-drop]


@dataclass
class RoundTimes:
    """Seconds spent in the rounds' target forwards and drafter proposals, and the rows they served: what the
    cost model's t and c are measured from (pipeline/cost.py). The prefill is not a round and is not counted."""

    target_s: float = 0.0
    draft_s: float = 0.0
    rounds: int = 0  # batched rounds: one target forward and one proposal each
    row_rounds: int = 0  # rows those rounds served

    def decoding_cost(self, drafter_forwards_per_round: int) -> DecodingCost | None:
        """t: a round's target forward per row (a plain decoding forward yields one token per row);
        c: one drafter forward against that target forward, at the same batch."""
        if not self.rounds or self.target_s <= 0:
            return None
        return DecodingCost(self.target_s / self.row_rounds,
                            self.draft_s / (self.target_s * drafter_forwards_per_round), drafter_forwards_per_round)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":  # kernels run asynchronously: read the clock once they are done
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def generate_batch(
    model: LlamaForCausalLM, new_proposer: Callable[[], Proposer], prompts: list[torch.Tensor],
    max_new_tokens: int, k: int, times: RoundTimes | None = None, sampling: BatchSampling | None = None,
    draft_method: DraftSampleMethod = "greedy",
) -> list[GenerationTrace]:
    """Speculative decoding of `prompts` as one batch, row b sampled as `sampling`'s row b (greedy when None: each
    row's tokens then equal greedy decoding's), the drafts chosen by `draft_method`. `times`, when given, adds up
    the rounds' target and drafter seconds."""
    if not prompts or min(p.shape[0] for p in prompts) < 1:
        raise ValueError("speculative decoding needs at least one prompt, each of at least one token")
    sampling = sampling or BatchSampling.greedy(len(prompts))
    if len(sampling) != len(prompts):
        raise ValueError(f"{len(sampling)} rows of sampling parameters for {len(prompts)} prompts")
    device = model.device
    proposer, cache = new_proposer(), TargetCache()
    drafts = DraftSampler(draft_method, sampling)
    chooser = drafts if draft_method == "probabilistic" else None
    B = len(prompts)
    lengths = torch.tensor([p.shape[0] for p in prompts], device=device)  # (B,)
    rows = torch.arange(B, device=device)
    # -- prefill: prompts right-padded; its logits at each row's last token give the first generated token
    width = int(lengths.max())
    ids = torch.zeros(B, width, dtype=torch.int64, device=device)  # (B, T)
    for b, p in enumerate(prompts):
        ids[b, : p.shape[0]] = p.to(device)
    valid = torch.arange(width, device=device)[None] < lengths[:, None]  # (B, T)
    positions = torch.arange(width, device=device).expand(B, width)  # (B, T)
    out = cache.forward(model, ids, positions, valid, proposer.layer_ids, logits_at=lengths - 1)
    pending = sampling.sample(sampling.probs(out.logits)[:, 0])  # (B,) committed, not yet in the cache
    first_logprobs = _logprobs(out.logits, pending[:, None])[:, 0]  # (B,)
    next_tokens = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # (B, T) x_{t+1}
    next_tokens[rows, lengths - 1] = pending
    pairs = CommittedPairs(features_for(out, proposer.layer_ids), next_tokens, positions, valid)
    generated = [[int(t)] for t in pending.tolist()]
    traces = [GenerationTrace(tokens=[], logprobs=[float(lp)]) for lp in first_logprobs.tolist()]
    committed = lengths + 1  # (B,) tokens per row, the pending one included
    offsets = torch.arange(k + 1, device=device)  # (k+1,)
    # -- rounds: every row each time; a row past max_new_tokens keeps step but counts no more rounds
    while min(len(g) for g in generated) < max_new_tokens:
        active = [len(g) < max_new_tokens for g in generated]
        started = _clock(device) if times is not None else 0.0
        # (B, k); a proposer that drafts greedily alone (the tests' oracles) need not take a chooser
        proposal = proposer.propose(pairs, k) if chooser is None else proposer.propose(pairs, k, chooser)
        drafted = _clock(device) if times is not None else 0.0
        ids = torch.cat([pending[:, None], proposal], dim=1)  # (B, k+1)
        positions = (committed - 1)[:, None] + offsets  # (B, k+1)
        out = cache.forward(model, ids, positions, torch.ones_like(ids, dtype=torch.bool), proposer.layer_ids)
        verdict = verify(sampling.probs(out.logits), proposal, drafts.take(),
                         sampling.round_draws(k, out.logits.shape[-1], device))
        if times is not None:
            times.draft_s += drafted - started
            times.target_s += _clock(device) - drafted
            times.rounds += 1
            times.row_rounds += B
        accepted, pending = verdict.accepted, verdict.next_tokens  # (B,), (B,)
        kept = offsets[None] <= accepted[:, None]  # (B, k+1): the pending token and the accepted drafts
        cache.keep(kept)
        emitted = torch.cat([proposal, proposal[:, :1]], dim=1)  # (B, k+1): the drafts, then the row's own token
        emitted[rows, accepted] = pending
        logprobs = _logprobs(out.logits, emitted)  # (B, k+1)
        next_tokens = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # (B, k+1)
        next_tokens[rows, accepted] = pending
        pairs = CommittedPairs(features_for(out, proposer.layer_ids), next_tokens, positions, kept)
        committed = committed + accepted + 1
        for b, (a, tokens, lps) in enumerate(zip(accepted.tolist(), emitted.tolist(), logprobs.tolist(),
                                                 strict=True)):
            if active[b]:
                traces[b].accepted_per_round.append(a)
                generated[b] += tokens[: a + 1]
                traces[b].logprobs += lps[: a + 1]
    for trace, tokens in zip(traces, generated, strict=True):
        trace.tokens = tokens[:max_new_tokens]
        trace.logprobs = trace.logprobs[:max_new_tokens]
    return traces


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, N, V) raw logits and (B, N) tokens -> (B, N) each token's log-probability (vLLM's raw logprobs)."""
    return logits.float().log_softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def request_sampling(params: SamplingParams, seeds: list[int], device: torch.device | str) -> BatchSampling:
    """A batch of requests at the same parameters, each seeded: reproducible whatever the batch."""
    return BatchSampling([RequestSampling.seeded(params, seed, device) for seed in seeds])


def speculative_generate(
    model: LlamaForCausalLM, new_proposer: Callable[[], Proposer], prompt: torch.Tensor, max_new_tokens: int, k: int
) -> GenerationTrace:
    """One prompt: a batch of one."""
    return generate_batch(model, new_proposer, [prompt], max_new_tokens, k)[0]


@dataclass(frozen=True)
class AcceptanceMetrics:
    tau: float
    acceptance_rate: float
    per_position: list[float]
    rounds: int
    drafted: int
    accepted: int
    drafter_forwards_per_round: float | None = None  # None: not counted

    def as_dict(self) -> dict:
        return {
            "tau": self.tau, "acceptance_rate": self.acceptance_rate, "per_position": self.per_position,
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "drafter_forwards_per_round": self.drafter_forwards_per_round,
        }


def acceptance_metrics(
    accepted_per_round: list[int], k: int, drafter_forwards_per_round: float | None = None
) -> AcceptanceMetrics:
    rounds = len(accepted_per_round)
    return metrics_from_counts(rounds, sum(accepted_per_round), [sum(a > j for a in accepted_per_round)
                                                                  for j in range(k)], k, drafter_forwards_per_round)


def metrics_from_counts(
    rounds: int, accepted: int, reached: list[int], k: int, drafter_forwards_per_round: float | None = None
) -> AcceptanceMetrics:
    """The metrics of `rounds` rounds that accepted `accepted` drafts in all, `reached[j]` of them keeping
    their first j+1 proposals: integer sums, so ranks that count their own rounds and add the counts get
    the metrics of one process exactly (not a mean of their means)."""
    if rounds == 0:
        raise ValueError("no speculative rounds to measure")
    return AcceptanceMetrics(
        tau=1 + accepted / rounds, acceptance_rate=accepted / (rounds * k), per_position=[r / rounds for r in reached],
        rounds=rounds, drafted=rounds * k, accepted=accepted, drafter_forwards_per_round=drafter_forwards_per_round,
    )


def evaluate(
    model: LlamaForCausalLM, new_proposer: Callable[[], Proposer], prompts: list[torch.Tensor],
    max_new_tokens: int, k: int, batch_size: int = 16, times: RoundTimes | None = None, ranks: Ranks = SINGLE,
    params: SamplingParams = GREEDY, draft_method: DraftSampleMethod = "greedy", seed: int = 0,
) -> AcceptanceMetrics:
    """Acceptance of the proposer against `model` over held-out prompts sampled at `params`, `batch_size` prompts
    at a time, shortest first: a batch's prefill pads every prompt to its longest. Prompt i draws from seed
    `seed + i` whatever its batch, so every drafter measured with the same seed meets the same random numbers.
    `times` adds up the rounds' seconds (this rank's). On several `ranks` each decodes every world_size-th batch
    and the ranks sum their integer counts: a batch decodes the same on any rank, so the metrics are one
    process's."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    rounds: list[int] = []
    forwards = proposals = 0
    counted_forwards = True
    for batch in ranks.mine(batches):
        proposer = new_proposer()
        counted = _Counting(proposer)
        sampling = request_sampling(params, [seed + i for i in batch], model.device)
        for trace in generate_batch(model, lambda p=counted: p, [prompts[i] for i in batch], max_new_tokens, k,
                                    times, sampling, draft_method):
            rounds += trace.accepted_per_round
        counts = getattr(proposer, "forwards", None)  # None: a proposer that is no drafter (tests' oracles)
        counted_forwards = counted_forwards and counts is not None
        forwards += counts or 0
        proposals += counted.proposals
    reached = [sum(a > j for a in rounds) for j in range(k)]
    totals = ranks.sum_counts([len(rounds), sum(rounds), forwards, proposals, int(not counted_forwards), *reached])
    n_rounds, accepted, forwards, proposals, uncounted, reached = *totals[:5], totals[5:]
    per_round = forwards / proposals if not uncounted and proposals else None
    return metrics_from_counts(n_rounds, accepted, reached, k, per_round)


class _Counting:
    """A proposer that counts its proposals (a batch's rounds), for forwards per round."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer, self.layer_ids, self.proposals = proposer, proposer.layer_ids, 0

    def propose(self, pairs: CommittedPairs, k: int, chooser: DraftChooser | None = None) -> torch.Tensor:
        self.proposals += 1
        return self.proposer.propose(pairs, k) if chooser is None else self.proposer.propose(pairs, k, chooser)
