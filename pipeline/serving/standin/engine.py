"""The stand-in replica's continuous-batching speculative engine (not vLLM): one decoding loop, one batch.

Requests wait in a queue; between rounds the loop admits them into the running batch (their prefill merged
into its caches: `evaluation.speculative.DecodingBatch`), runs one round over every running request, and
hands back the requests that round finished, which leave at once, as vLLM's scheduler runs its requests.
Each request samples at its own parameters from its own seeded stream.

A round speculates or not by the batch size (`evaluation.scheduler`: the threshold it measures as it runs,
the same rounds a step's replay schedules).

`pause()` freezes the batch between rounds (vLLM's `/pause?mode=keep`); `reload()` swaps the weights of a
paused engine: the running requests are prefilled again on the new ones and go on, and a request that was
running when the policy changed is marked as straddling the update.

One request must not fail the others: a request whose client has gone (`cancel`) leaves the queue, or the batch
between rounds; a prefill that fails is tried again one request at a time, so only the requests that fail alone
get its error. A failing round (the batch's shared state) still fails every running request.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from transformers import LlamaForCausalLM

from pipeline.evaluation.scheduler import SpeculationThreshold, schedule_round
from pipeline.evaluation.speculative import DecodingBatch, Request, Sequence
from pipeline.models.drafter import Proposer
from pipeline.sampling import DraftSampleMethod
from pipeline.serving.metrics import SpecCounters


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
    cancelled: bool = False  # its client has gone: it leaves the batch before the next round


class Cancelled(RuntimeError):
    """A request cancelled before it finished (its client disconnected)."""


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

    def cancel(self, future: Future) -> None:
        """The request of `future` stops: out of the queue now, out of the batch before the next round (vLLM
        aborts a request whose client disconnected); its future fails with `Cancelled`."""
        with self._cond:
            for entry in self._waiting:
                if entry.future is future:
                    self._waiting.remove(entry)
                    entry.future.set_exception(Cancelled("the request was cancelled before it was admitted"))
                    return
            for entry in self._running.values():
                if entry.future is future:
                    entry.cancelled = True
                    self._cond.notify_all()

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
                gone = [entry for entry in self._running.values() if entry.cancelled]
                for entry in gone:
                    del self._running[id(entry.sequence)]
                self._in_round = True
            try:
                self.batch.drop([entry.sequence for entry in gone])
                for entry in gone:
                    entry.future.set_exception(Cancelled("the request was cancelled while it decoded"))
                finished = self._round(joining)
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

    def _round(self, joining: list[_Entry]) -> list[Sequence]:
        """Admit `joining`, then one round over the batch -> the sequences that left."""
        admitted = self._admit(joining)
        finished, record = schedule_round(self.batch, self.threshold, [])
        finished = admitted + finished
        if record is not None:
            if record.speculative:
                self._count(list(record.accepted))
            self.rounds["speculative" if record.speculative else "plain"] += 1
        return finished

    def _admit(self, joining: list[_Entry]) -> list[Sequence]:
        """Prefill `joining` into the batch -> those done with their first token. A prefill fails before it
        touches the running batch (it runs on caches of its own), so a failed one is tried again request by
        request and only a request that fails alone gets the error (a prompt too large to prefill)."""
        try:
            return self.batch.admit([entry.sequence for entry in joining])
        except Exception as exc:  # noqa: BLE001 - the running batch is intact: only the joining may fail
            if len(joining) == 1:
                self._fail(joining[0], exc)
                return []
        finished: list[Sequence] = []
        for entry in joining:
            try:
                finished += self.batch.admit([entry.sequence])
            except Exception as exc:  # noqa: BLE001 - this request's error, answered to its client alone
                self._fail(entry, exc)
        return finished

    def _fail(self, entry: _Entry, exc: BaseException) -> None:
        with self._cond:
            self._running.pop(id(entry.sequence), None)
        entry.future.set_exception(exc)

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

