"""The stand-in replica's continuous-batching speculative engine (not vLLM): one decoding loop, one batch.

Requests wait in a queue; between rounds the loop admits them into the running batch (their prefill merged
into its caches: `evaluation.speculative.DecodingBatch`), runs one round over every running request, and
hands back the requests that round finished, which leave at once, as vLLM's scheduler runs its requests.
Each request samples at its own parameters from its own seeded stream.

A round speculates or not by the batch size (`SpeculationThreshold`): above some batch a speculative round
costs more than the tokens it yields save (TLT turns speculation on only below a batch of 32). The engine
times both kinds of round at the batch sizes it runs and measures the tokens a speculative round yields, and
turns speculation off above the largest batch at which it pays.

`pause()` freezes the batch between rounds (vLLM's `/pause?mode=keep`); `reload()` swaps the weights of a
paused engine: the running requests are prefilled again on the new ones and go on, and a request that was
running when the policy changed is marked as straddling the update.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from transformers import LlamaForCausalLM

from pipeline.data.sampling import DraftSampleMethod
from pipeline.evaluation.speculative import DecodingBatch, Request, Sequence, clock
from pipeline.models.drafter import Proposer
from pipeline.serving.metrics import SpecCounters

EXPLORE_EVERY = 16  # every 16th round at a batch size runs the other kind, so both sides stay measured
SMOOTHING = 0.3  # weight of the newest measurement in the running means


def bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: batches of 5 to 8 rows are timed together as 8."""
    return 1 << max(0, math.ceil(math.log2(batch_size)))


class SpeculationThreshold:
    """Whether a round at a batch size speculates: the decision and what it is measured from.

    Per batch-size bucket b: s(b), the seconds of a speculative round, and p(b), of a plain round (one token
    per row); over all speculative rounds tau, the tokens a row gets from one (1 + accepted drafts). A
    speculative round pays at b when tau / s(b) > 1 / p(b): more tokens per second per row. The threshold is
    the largest b up to which every measured bucket pays (0: speculation pays at no batch size); a round of
    B rows speculates when B is at most the threshold. A bucket not yet measured on one side runs that side
    first, and every EXPLORE_EVERY-th round at a bucket runs the other side, so a changed drafter or batch
    composition moves the threshold. `fixed`: no measuring, speculate up to `fixed` rows (vLLM's way: a
    configured threshold)."""

    def __init__(self, fixed: int | None = None, explore_every: int = EXPLORE_EVERY,
                 smoothing: float = SMOOTHING) -> None:
        self.fixed, self.explore_every, self.smoothing = fixed, explore_every, smoothing
        self._lock = threading.Lock()  # the engine records and decides; /metrics reads the threshold
        self.speculative_s: dict[int, float] = {}
        self.plain_s: dict[int, float] = {}
        self.tau: float | None = None
        self.rounds: dict[int, int] = {}

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def record(self, batch_size: int, speculative: bool, seconds: float, tokens_per_row: float = 1.0) -> None:
        """A round of `batch_size` rows took `seconds` and gave each row `tokens_per_row` tokens on average."""
        b = bucket(batch_size)
        with self._lock:
            if speculative:
                self.speculative_s[b] = self._mean(self.speculative_s.get(b), seconds)
                self.tau = self._mean(self.tau, tokens_per_row)
            else:
                self.plain_s[b] = self._mean(self.plain_s.get(b), seconds)

    def forget_acceptance(self) -> None:
        """New weights (a drafter or a policy): the tokens a speculative round yields are measured again."""
        with self._lock:
            self.tau = None

    def pays(self, b: int) -> bool | None:
        """Whether speculation pays at bucket b; None while a side is not measured."""
        if self.tau is None or b not in self.speculative_s or b not in self.plain_s:
            return None
        return self.tau * self.plain_s[b] > self.speculative_s[b]

    @property
    def threshold(self) -> int:
        """The largest batch size whose rounds speculate."""
        if self.fixed is not None:
            return self.fixed
        threshold = 0
        with self._lock:
            for b in sorted(set(self.speculative_s) & set(self.plain_s)):
                if not self.pays(b):
                    break
                threshold = b
        return threshold

    def speculate(self, batch_size: int) -> bool:
        """The decision for a round of `batch_size` rows."""
        if self.fixed is not None:
            return batch_size <= self.fixed
        b = bucket(batch_size)
        self.rounds[b] = self.rounds.get(b, 0) + 1
        if self.tau is None or b not in self.speculative_s:
            return True
        if b not in self.plain_s:
            return False
        on = batch_size <= self.threshold
        return not on if self.rounds[b] % self.explore_every == 0 else on


@dataclass(frozen=True)
class Completion:
    """What a request returns: its tokens, why it ended, and which weights decoded it."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str | None  # the /weight_info label when it finished
    policy_version: str  # the label of the policy that decoded its last round
    straddles_policy_update: bool  # the policy changed while it was running


@dataclass
class _Entry:
    sequence: Sequence
    future: Future = field(default_factory=Future)
    straddled: bool = False  # it was running when the policy changed


class Engine:
    """Runs a DecodingBatch on a thread of its own: `submit` queues a request, the loop admits it between rounds
    and resolves its future when it leaves. `max_num_seqs` rows run at most (vLLM's --max-num-seqs)."""

    def __init__(self, model: LlamaForCausalLM, new_proposer: Callable[[], Proposer] | None, k: int,
                 draft_method: DraftSampleMethod, threshold: SpeculationThreshold, policy_version: str,
                 max_num_seqs: int = 256) -> None:
        self.k, self.threshold, self.max_num_seqs = k, threshold, max_num_seqs
        self.batch = DecodingBatch(model, new_proposer, k, draft_method)
        self.policy_version, self.weight_version = policy_version, None
        self.counters = SpecCounters(accepted_per_position={j: 0.0 for j in range(k)})
        self.rounds = {"speculative": 0, "plain": 0}
        self._cond = threading.Condition()
        self._waiting: deque[_Entry] = deque()
        self._running: dict[int, _Entry] = {}  # id(sequence) -> entry
        self._paused = self._in_round = self._closed = False
        self._thread = threading.Thread(target=self._loop, name="standin-engine", daemon=True)
        self._thread.start()

    # -- requests ----------------------------------------------------------------------------------------------

    def submit(self, request: Request) -> Future:
        """Queue a request; its future resolves to a Completion (or the error its batch failed with)."""
        entry = _Entry(Sequence(request))
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(entry)
            self._cond.notify_all()
        return entry.future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._paused or not (self._waiting or self._running)):
                    self._cond.wait()
                if self._closed:
                    return
                room = self.max_num_seqs - len(self._running)
                joining = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                for entry in joining:
                    self._running[id(entry.sequence)] = entry
                self._in_round = True
            try:
                finished = self._round([e.sequence for e in joining])
            except Exception as exc:  # noqa: BLE001 - every request of the failed batch gets the error
                finished = []
                self.batch.abort()
                with self._cond:
                    failed, self._running = list(self._running.values()), {}
                for entry in failed:
                    entry.future.set_exception(exc)
            with self._cond:
                done = [self._running.pop(id(s)) for s in finished]
                self._in_round = False
                self._cond.notify_all()
            for entry in done:
                entry.future.set_result(self._completion(entry))

    def _round(self, joining: list[Sequence]) -> list[Sequence]:
        """Admit `joining`, then one round over the batch -> the sequences that left."""
        finished = self.batch.admit(joining)
        rows = list(self.batch.rows)
        if not rows:
            return finished
        speculate = self.batch.speculative and self.threshold.speculate(len(rows))
        started = clock(self.batch.model.device)
        finished += self.batch.step(speculate)
        seconds = clock(self.batch.model.device) - started
        if speculate:
            accepted = [s.trace.accepted_per_round[-1] for s in rows]
            self.threshold.record(len(rows), True, seconds, 1 + sum(accepted) / len(rows))
            self._count(accepted)
        else:
            self.threshold.record(len(rows), False, seconds)
        self.rounds["speculative" if speculate else "plain"] += 1
        return finished

    def _count(self, accepted: list[int]) -> None:
        """vLLM's spec-decode counters: one draft of k tokens per request per speculative round."""
        c = self.counters
        self.counters = SpecCounters(
            drafts=c.drafts + len(accepted), draft_tokens=c.draft_tokens + len(accepted) * self.k,
            accepted=c.accepted + sum(accepted),
            accepted_per_position={j: v + sum(a > j for a in accepted) for j, v in c.accepted_per_position.items()},
        )

    def _completion(self, entry: _Entry) -> Completion:
        trace = entry.sequence.trace
        with self._cond:
            return Completion(list(trace.tokens), list(trace.logprobs), entry.sequence.finish_reason or "length",
                              self.weight_version, self.policy_version, entry.straddled)

    # -- pause, resume and new weights -------------------------------------------------------------------------

    def pause(self) -> None:
        """Returns once no round runs; none starts until `resume`: the running batch is frozen between rounds."""
        with self._cond:
            self._paused = True
            while self._in_round:
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused

    def reload(self, model: LlamaForCausalLM, new_proposer: Callable[[], Proposer] | None,
               policy_changed: bool) -> None:
        """New weights between rounds (paused here if the caller did not pause): the running requests are
        prefilled again on them; a new policy marks them as straddling it."""
        with self._cond:
            was_paused = self._paused
        self.pause()
        try:
            if policy_changed:
                with self._cond:
                    for entry in self._running.values():
                        entry.straddled = True
            self.batch.reload(model, new_proposer)
            self.threshold.forget_acceptance()
        finally:
            if not was_paused:
                self.resume()

    def label(self, weight_version: str | None = None, policy_version: str | None = None) -> None:
        """A finished weight update's labels: what completions report from now on."""
        with self._cond:
            if weight_version is not None:
                self.weight_version = weight_version
            if policy_version is not None:
                self.policy_version = policy_version

    @property
    def model(self) -> LlamaForCausalLM:
        return self.batch.model

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

