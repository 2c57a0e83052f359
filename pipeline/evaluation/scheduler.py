"""How a round of a decoding batch is scheduled: speculative or plain, by a batch threshold measured as it runs.

Above some batch size a speculative round costs more than the tokens it yields save (TLT turns
speculation on only below a batch of 32): verifying k + 1 positions per row stops being free once
the target's forward is no longer bound by reading its weights, and the drafter's k forwards grow
with the batch too. `SpeculationThreshold` times both kinds of round at the batch sizes it sees and
turns speculation off above the largest batch at which it pays. `schedule_round` runs one round of a
`DecodingBatch` by that decision and says what it did: the stand-in's engine serves with it, and the
replay of a step's rollouts (`replay.py`) measures with it, so both decide alike.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from pipeline.evaluation.speculative import DecodingBatch, Sequence, clock

EXPLORE_EVERY = 16  # every 16th round at a batch size runs the other kind, so both sides stay measured
SMOOTHING = 0.3  # weight of the newest measurement in tau's running mean
WINDOW = 8  # a round's cost at a bucket: the least of its last WINDOW rounds of that kind


def bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: batches of 5 to 8 rows are timed together as 8."""
    return 1 << max(0, math.ceil(math.log2(batch_size)))


class SpeculationThreshold:
    """Whether a round at a batch size speculates: the decision and what it is measured from.

    Per batch-size bucket b: s(b), the seconds of a speculative round, and p(b), of a plain round (one token
    per row), each the least of the last WINDOW rounds of its kind (other work on the machine only ever adds
    time to a round, so one disturbed round does not turn speculation off); over all speculative rounds tau,
    the tokens a row gets from one (1 + accepted drafts), a running mean. A speculative round pays at b when
    tau / s(b) > 1 / p(b): more tokens per second per row, and a round of B rows speculates when its bucket
    pays. The decision is per bucket, not a batch size below which every one pays: on a GPU the buckets that
    pay are the small ones, but on a CPU one row's verification costs nearly two forwards of one token (one
    row's forward is a matrix-vector product, several rows' a matrix product at the same price), so a batch
    of 4 pays where a lone row does not. The threshold reported is the largest bucket that pays (0: none). A
    bucket not yet measured on one side runs that side first, and every EXPLORE_EVERY-th round at a bucket
    runs the other side, so a changed drafter or batch composition moves the decision. `fixed`: no
    measuring, speculate up to `fixed` rows (vLLM's way: a configured threshold)."""

    def __init__(self, fixed: int | None = None, explore_every: int = EXPLORE_EVERY,
                 smoothing: float = SMOOTHING) -> None:
        self.fixed, self.explore_every, self.smoothing = fixed, explore_every, smoothing
        self._lock = threading.Lock()  # an engine records and decides while /metrics reads the threshold
        self._speculative: dict[int, deque[float]] = {}
        self._plain: dict[int, deque[float]] = {}
        self.tau: float | None = None
        self.rounds: dict[int, int] = {}

    def record(self, batch_size: int, speculative: bool, seconds: float, tokens_per_row: float = 1.0) -> None:
        """A round of `batch_size` rows took `seconds` and gave each row `tokens_per_row` tokens on average."""
        b = bucket(batch_size)
        with self._lock:
            rounds = self._speculative if speculative else self._plain
            rounds.setdefault(b, deque(maxlen=WINDOW)).append(seconds)
            if speculative:
                self.tau = tokens_per_row if self.tau is None else \
                    (1 - self.smoothing) * self.tau + self.smoothing * tokens_per_row

    def know_plain(self, seconds: dict[int, float]) -> None:
        """Plain rounds' seconds per batch bucket measured elsewhere (the same decoder, without a drafter)."""
        with self._lock:
            for b, s in seconds.items():
                self._plain.setdefault(b, deque(maxlen=WINDOW)).append(s)

    def forget_acceptance(self) -> None:
        """New weights (a drafter or a policy): the tokens a speculative round yields are measured again."""
        with self._lock:
            self.tau = None

    def pays(self, b: int) -> bool | None:
        """Whether speculation pays at bucket b; None while a side is not measured."""
        if self.tau is None or b not in self._speculative or b not in self._plain:
            return None
        return self.tau * min(self._plain[b]) > min(self._speculative[b])

    @property
    def threshold(self) -> int:
        """The largest batch-size bucket whose rounds speculate."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            return max((b for b in set(self._speculative) & set(self._plain) if self.pays(b)), default=0)

    def speculate(self, batch_size: int) -> bool:
        """The decision for a round of `batch_size` rows."""
        if self.fixed is not None:
            return batch_size <= self.fixed
        b = bucket(batch_size)
        self.rounds[b] = self.rounds.get(b, 0) + 1
        if self.tau is None or b not in self._speculative:
            return True
        if b not in self._plain:
            return False
        with self._lock:
            on = bool(self.pays(b))
        return not on if self.rounds[b] % self.explore_every == 0 else on


@dataclass(frozen=True)
class RoundRecord:
    """What one scheduled round did."""

    rows: int  # requests it served
    speculative: bool
    seconds: float
    tokens: int  # tokens it gave its rows, all together
    accepted: tuple[int, ...]  # drafts each row kept (a speculative round; () for a plain one)


def schedule_round(batch: DecodingBatch, threshold: SpeculationThreshold,
                   joining: list[Sequence]) -> tuple[list[Sequence], RoundRecord | None]:
    """Admit `joining`, then one round over the batch, speculative when a drafter is loaded and the threshold
    says so -> the sequences that left, and what the round did (None when no row was left to run one)."""
    finished = batch.admit(joining)
    rows = list(batch.rows)
    if not rows:
        return finished, None
    before = sum(len(s.trace.tokens) for s in rows)
    speculate = batch.speculative and threshold.speculate(len(rows))
    started = clock(batch.model.device)
    finished += batch.step(speculate)
    seconds = clock(batch.model.device) - started
    tokens = sum(len(s.trace.tokens) for s in rows) - before
    accepted = tuple(s.trace.accepted_per_round[-1] for s in rows) if speculate else ()
    threshold.record(len(rows), speculate, seconds, 1 + sum(accepted) / len(rows) if speculate else 1.0)
    return finished, RoundRecord(len(rows), speculate, seconds, tokens, accepted)
