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

from pipeline.accounting.cost import DecodingCost
from pipeline.evaluation.rejection_sampler import BatchSampling, DraftSampler, RequestSampling, verify
from pipeline.models import target_forward
from pipeline.models.drafter import CommittedPairs, DraftChooser, Drafter, Proposer
from pipeline.models.eagle import gather_rows
from pipeline.ranks import SINGLE, Ranks
from pipeline.sampling import GREEDY, DraftSampleMethod, SamplingParams


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

    def select(self, rows: torch.Tensor) -> None:
        """Keep `rows` (B',) in that order, and only the columns a kept row may attend (in order: within a row,
        causality by column index stays causality by position)."""
        valid = self.valid[rows]  # (B', S)
        columns = valid.any(dim=0).nonzero().flatten()  # (S',)
        for layer in self.past.layers:
            layer.keys, layer.values = layer.keys[rows][:, :, columns], layer.values[rows][:, :, columns]
        self.valid, self.positions = valid[:, columns], self.positions[rows][:, columns]

    def merge(self, other: TargetCache) -> None:
        """`other`'s rows after these (requests joining a running batch): the narrower cache is padded at its
        end with columns no row attends, so (B, S) + (B2, S2) -> (B + B2, max(S, S2))."""
        width = max(self.valid.shape[1], other.valid.shape[1])
        for mine, theirs in zip(self.past.layers, other.past.layers, strict=True):
            mine.keys = torch.cat([_pad_keys(mine.keys, width), _pad_keys(theirs.keys, width)])  # (B + B2, H, S, D)
            mine.values = torch.cat([_pad_keys(mine.values, width), _pad_keys(theirs.values, width)])
        self.valid = torch.cat([_pad_columns(self.valid, width), _pad_columns(other.valid, width)])
        self.positions = torch.cat([_pad_columns(self.positions, width), _pad_columns(other.positions, width)])


def _pad_keys(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, S, D) keys or values -> (B, H, width, D), zeros after."""
    return torch.cat([x, x.new_zeros(*x.shape[:2], width - x.shape[2], x.shape[3])], dim=2)


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, S) -> (B, width), zeros (False) after."""
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1])], dim=1)


@dataclass
class RoundTimes:
    """Seconds spent in the rounds' target forwards and drafter proposals, and the rows they served: what the
    cost model's t and c are measured from (pipeline/accounting/cost.py). The prefill is not a round and is not
    counted."""

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


def clock(device: torch.device) -> float:
    if device.type == "cuda":  # kernels run asynchronously: read the clock once they are done
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Request:
    """What one row of a decoding batch serves: a prompt, how far to decode it and how to sample it."""

    prompt: torch.Tensor  # (T,) token ids, T >= 1
    max_tokens: int
    sampling: RequestSampling
    stop_token_ids: frozenset[int] = frozenset()  # a generated stop token ends the request (it is kept)


@dataclass
class Sequence:
    """A request and what it has generated so far: its row's state while it decodes, its result after."""

    request: Request
    trace: GenerationTrace = field(default_factory=lambda: GenerationTrace(tokens=[]))
    finish_reason: str | None = None  # "length" or "stop" once done

    def emit(self, tokens: list[int], logprobs: list[float]) -> None:
        """Append a round's tokens for this row, up to max_tokens and through a stop token."""
        for token, logprob in zip(tokens, logprobs, strict=True):
            self.trace.tokens.append(token)
            self.trace.logprobs.append(logprob)
            if token in self.request.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.trace.tokens) >= self.request.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                return


PENDING_PAIRS_LIMIT = 32  # committed pairs plain rounds hand the drafter at most before it takes them in


class DecodingBatch:
    """Requests decoding together, one round at a time, as a continuous-batching engine runs them: rows join
    (prefilled on their own, then merged) and leave (at once, when done) between rounds.

    A round is speculative (the drafter proposes k tokens per row, the target verifies them in one forward,
    vLLM's rule keeps a prefix and adds one token: `rejection_sampler.verify`) or plain (one target forward, one
    token per row); either way each row's tokens are distributed as sampling the target at its request's
    parameters, and a greedy row's are the target's greedy decoding. The caches hold every row's columns:

        target  TargetCache: (B, S) columns, each with its position and whether the row may attend it
        drafter its proposer's DraftCache, the same rows
        pairs   (B, N) committed pairs (f_t, x_{t+1}) the drafter has not taken in yet: one round's after a
                speculative round, the plain rounds' since added to them

    Joining rows are prefilled into a TargetCache of their own, merged below the running rows (the narrower
    cache padded with masked columns); the drafter gets empty rows, and their prompt pairs come with its next
    proposal. Leaving rows are selected out of all three, with the columns no remaining row attends.
    """

    def __init__(self, model: LlamaForCausalLM, new_proposer: Callable[[], Proposer] | None, k: int,
                 draft_method: DraftSampleMethod = "greedy", times: RoundTimes | None = None) -> None:
        self.model, self.new_proposer, self.k = model, new_proposer, k
        self.draft_method, self.times = draft_method, times
        self.rows: list[Sequence] = []
        self._clear()

    def _clear(self) -> None:
        self.cache = TargetCache()
        self.proposer: Proposer | None = None
        self.pairs: CommittedPairs | None = None
        self.pending: torch.Tensor | None = None  # (B,) each row's last token: committed, not yet in the cache
        self.committed: torch.Tensor | None = None  # (B,) tokens per row, the pending one included

    def __len__(self) -> int:
        return len(self.rows)

    def abort(self) -> None:
        """Every row dropped (a failed round leaves the caches in no known state)."""
        self.rows = []
        self._clear()

    @property
    def speculative(self) -> bool:
        """Whether a round may speculate: a drafter is loaded."""
        return self.new_proposer is not None

    def reload(self, model: LlamaForCausalLM, new_proposer: Callable[[], Proposer] | None) -> None:
        """New weights (a policy, a drafter, or both): the running rows are prefilled again on them and continue
        from their last token; what they generated so far stays as it was generated."""
        running, self.rows = self.rows, []
        self.model, self.new_proposer = model, new_proposer
        self._clear()
        if running:
            self.admit(running)

    @torch.no_grad()
    def admit(self, sequences: list[Sequence]) -> list[Sequence]:
        """Prefill `sequences` and add them after the running rows. A new request's first token is sampled from
        its prefill; one that generated already (prefilled again after a weight update) continues from its last
        token. Returns the new requests that are done with their first token (they do not join)."""
        if not sequences:
            return []
        device = self.model.device
        if self.proposer is None and self.new_proposer is not None:
            self.proposer = self.new_proposer()
        layer_ids = self.proposer.layer_ids if self.proposer is not None else None
        contexts = [torch.cat([s.request.prompt, torch.tensor(s.trace.tokens[:-1], dtype=torch.int64)])
                    for s in sequences]
        if min(c.shape[0] for c in contexts) < 1:
            raise ValueError("a request needs a prompt of at least one token")
        B = len(sequences)
        lengths = torch.tensor([c.shape[0] for c in contexts], device=device)  # (B,)
        width = int(lengths.max())
        ids = torch.zeros(B, width, dtype=torch.int64, device=device)  # (B, T) right-padded
        for b, c in enumerate(contexts):
            ids[b, : c.shape[0]] = c.to(device)
        valid = torch.arange(width, device=device)[None] < lengths[:, None]  # (B, T)
        positions = torch.arange(width, device=device).expand(B, width)  # (B, T)
        cache = TargetCache()
        out = cache.forward(self.model, ids, positions, valid, layer_ids, logits_at=lengths - 1)  # logits (B, 1, V)
        pending = torch.tensor([s.trace.tokens[-1] if s.trace.tokens else 0 for s in sequences], device=device)
        fresh = [b for b, s in enumerate(sequences) if not s.trace.tokens]
        if fresh:  # only new requests draw: a request's stream is its own
            sampling = BatchSampling([sequences[b].request.sampling for b in fresh])
            rows = torch.tensor(fresh, dtype=torch.int64, device=device)
            first = sampling.sample(sampling.probs(out.logits[rows])[:, 0])  # (F,)
            pending[rows] = first
            first_logprobs = _logprobs(out.logits[rows], first[:, None])[:, 0]  # (F,)
            for b, token, logprob in zip(fresh, first.tolist(), first_logprobs.tolist(), strict=True):
                sequences[b].emit([token], [logprob])
        next_tokens = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # (B, T) x_{t+1}
        next_tokens[torch.arange(B, device=device), lengths - 1] = pending
        pairs = CommittedPairs(features_for(out, layer_ids), next_tokens, positions, valid) \
            if self.proposer is not None else None
        joining = [b for b, s in enumerate(sequences) if s.finish_reason is None]
        if len(joining) < B:
            # int64 even when no row joins: an empty list makes a float tensor, which is no index
            index = torch.tensor(joining, dtype=torch.int64, device=device)
            cache.select(index)
            pairs = pairs.select(index) if pairs is not None else None
            pending, lengths = pending[index], lengths[index]
        if joining:
            self._join([sequences[b] for b in joining], cache, pairs, pending, lengths + 1)
        return [s for s in sequences if s.finish_reason is not None]

    def _join(self, sequences: list[Sequence], cache: TargetCache, pairs: CommittedPairs | None,
              pending: torch.Tensor, committed: torch.Tensor) -> None:
        if not self.rows:
            self.cache, self.pairs, self.pending, self.committed = cache, pairs, pending, committed
        else:
            self.cache.merge(cache)
            if self.proposer is not None:
                self.proposer.add_rows(len(sequences))
                self.pairs = self.pairs.stack(pairs)
            self.pending, self.committed = torch.cat([self.pending, pending]), torch.cat([self.committed, committed])
        self.rows += sequences

    @torch.no_grad()
    def step(self, speculate: bool) -> list[Sequence]:
        """One round over every running row -> the sequences it finished, which leave the batch."""
        if not self.rows:
            return []
        if speculate and self.proposer is None:
            raise ValueError("a speculative round needs a drafter")
        sampling = BatchSampling([s.request.sampling for s in self.rows])
        if speculate:
            tokens, logprobs, accepted = self._speculative_round(sampling)
            for sequence, a in zip(self.rows, accepted.tolist(), strict=True):
                sequence.trace.accepted_per_round.append(a)
            counts = (accepted + 1).tolist()
        else:
            tokens, logprobs = self._plain_round(sampling)
            counts = [1] * len(self.rows)
        for sequence, n, row_tokens, row_logprobs in zip(self.rows, counts, tokens.tolist(), logprobs.tolist(),
                                                         strict=True):
            sequence.emit(row_tokens[:n], row_logprobs[:n])
        done = [s for s in self.rows if s.finish_reason is not None]
        if done:
            self._keep([b for b, s in enumerate(self.rows) if s.finish_reason is None])
        return done

    def drop(self, sequences: list[Sequence]) -> None:
        """`sequences` leave the batch before they are done (their clients have gone); the others decode on."""
        gone = {id(s) for s in sequences}
        if gone & {id(s) for s in self.rows}:
            self._keep([b for b, s in enumerate(self.rows) if id(s) not in gone])

    def _keep(self, rows: list[int]) -> None:
        """Only `rows` stay (in that order); an empty batch starts over with fresh caches and proposer."""
        if not rows:
            self.rows = []
            self._clear()
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.model.device)
        self.cache.select(index)
        if self.proposer is not None:
            self.proposer.select(index)
            self.pairs = self.pairs.select(index)
        self.pending, self.committed = self.pending[index], self.committed[index]
        self.rows = [self.rows[b] for b in rows]

    def _speculative_round(self, sampling: BatchSampling) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k drafts per row verified by one target forward -> (B, k+1) tokens and their logprobs (a row's first
        accepted + 1 count) and (B,) drafts accepted."""
        device, k, proposer = self.model.device, self.k, self.proposer
        B = len(self.rows)
        rows = torch.arange(B, device=device)
        offsets = torch.arange(k + 1, device=device)  # (k+1,)
        drafts = DraftSampler(self.draft_method, sampling)
        chooser = drafts if self.draft_method == "probabilistic" else None
        started = clock(device) if self.times is not None else 0.0
        # (B, k); a proposer that drafts greedily alone (the tests' oracles) need not take a chooser
        proposal = proposer.propose(self.pairs, k) if chooser is None else proposer.propose(self.pairs, k, chooser)
        drafted = clock(device) if self.times is not None else 0.0
        ids = torch.cat([self.pending[:, None], proposal], dim=1)  # (B, k+1)
        positions = (self.committed - 1)[:, None] + offsets  # (B, k+1)
        out = self.cache.forward(self.model, ids, positions, torch.ones_like(ids, dtype=torch.bool),
                                 proposer.layer_ids)
        verdict = verify(sampling.probs(out.logits), proposal, drafts.take(),
                         sampling.round_draws(k, out.logits.shape[-1], device))
        if self.times is not None:
            self.times.draft_s += drafted - started
            self.times.target_s += clock(device) - drafted
            self.times.rounds += 1
            self.times.row_rounds += B
        accepted, self.pending = verdict.accepted, verdict.next_tokens  # (B,), (B,)
        kept = offsets[None] <= accepted[:, None]  # (B, k+1): the pending token and the accepted drafts
        self.cache.keep(kept)
        emitted = torch.cat([proposal, proposal[:, :1]], dim=1)  # (B, k+1): the drafts, then the row's own token
        emitted[rows, accepted] = self.pending
        next_tokens = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # (B, k+1)
        next_tokens[rows, accepted] = self.pending
        self.pairs = CommittedPairs(features_for(out, proposer.layer_ids), next_tokens, positions, kept)
        self.committed = self.committed + accepted + 1
        return emitted, _logprobs(out.logits, emitted), accepted

    def _plain_round(self, sampling: BatchSampling) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over each row's pending token -> (B, 1) the next tokens and their logprobs. The
        drafter is not run; its pairs wait for its next proposal (taken in earlier once they pile up)."""
        layer_ids = self.proposer.layer_ids if self.proposer is not None else None
        ids, positions = self.pending[:, None], (self.committed - 1)[:, None]  # (B, 1)
        new_valid = torch.ones_like(ids, dtype=torch.bool)
        out = self.cache.forward(self.model, ids, positions, new_valid, layer_ids)  # logits (B, 1, V)
        self.pending = sampling.sample(sampling.probs(out.logits)[:, 0])  # (B,)
        if self.proposer is not None:
            self.pairs = self.pairs.then(CommittedPairs(features_for(out, layer_ids), self.pending[:, None],
                                                        positions, new_valid))
            if self.pairs.valid.shape[1] > PENDING_PAIRS_LIMIT:
                self._take_in_pairs()
        self.committed = self.committed + 1
        return self.pending[:, None], _logprobs(out.logits, self.pending[:, None])

    def _take_in_pairs(self) -> None:
        """The drafter takes in all but each row's last pending pair (its draft is discarded; greedy, so no request's
        stream is touched): pairs held for the next proposal stay bounded while plain rounds go on."""
        valid = self.pairs.valid
        head = valid & (torch.arange(valid.shape[1], device=valid.device)[None] < self.pairs.last()[:, None])
        taken = CommittedPairs(self.pairs.features, self.pairs.next_tokens, self.pairs.positions, head)
        self.proposer.propose(taken, 1)
        self.pairs = CommittedPairs(*(gather_rows(x, self.pairs.last()) for x in (  # (B, 1, ...) each row's last
            self.pairs.features, self.pairs.next_tokens, self.pairs.positions, self.pairs.valid)))


@torch.no_grad()
def generate_batch(
    model: LlamaForCausalLM, new_proposer: Callable[[], Proposer], prompts: list[torch.Tensor],
    max_new_tokens: int, k: int, times: RoundTimes | None = None, sampling: BatchSampling | None = None,
    draft_method: DraftSampleMethod = "greedy",
) -> list[GenerationTrace]:
    """Speculative decoding of `prompts` as one batch, every request admitted at round 0 and leaving when done;
    row b sampled as `sampling`'s row b (greedy when None: each row's tokens then equal greedy decoding's), the
    drafts chosen by `draft_method`. `times`, when given, adds up the rounds' target and drafter seconds."""
    if not prompts or min(p.shape[0] for p in prompts) < 1:
        raise ValueError("speculative decoding needs at least one prompt, each of at least one token")
    sampling = sampling or BatchSampling.greedy(len(prompts))
    if len(sampling) != len(prompts):
        raise ValueError(f"{len(sampling)} rows of sampling parameters for {len(prompts)} prompts")
    batch = DecodingBatch(model, new_proposer, k, draft_method, times)
    sequences = [Sequence(Request(p, max_new_tokens, s)) for p, s in zip(prompts, sampling.rows, strict=True)]
    batch.admit(sequences)
    while batch.rows:
        batch.step(speculate=True)
    return [s.trace for s in sequences]


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

    def select(self, rows: torch.Tensor) -> None:
        self.proposer.select(rows)

    def add_rows(self, n: int) -> None:
        self.proposer.add_rows(n)
