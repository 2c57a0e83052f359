"""The fleet as the rollout engine: an RL step's policy pushed to every replica, then its rollouts decoded by them.

As an asynchronous trainer beside vLLM in server mode (PipelineRL, prime-rl, SkyRL, AReaL) does, each step:

1. `push_policy`: every replica gets the step's policy through the weight-update routes (`hot_update.send_policy`:
   /pause?mode=keep, /start_weight_update, /update_weights, /finish_weight_update "policy-<dir>", /resume),
   and /weight_info must report it, before the step's first request. A replica not running starts on it
   (before step 1 the fleet starts with no drafter: plain decoding until the first deploy); a policy not on
   local disk, or a replica without the routes, is restarted on it. Under the fleet's lease, so no deploy's
   session interleaves; the pushed policy is recorded, and a later deploy serves it or a newer one.
2. `generate`: the requests decoded concurrently, spread over the replicas, each with its sampling parameters
   and seed (vLLM's request fields), token ids and logprobs returned. A request a replica drops (restarted by
   a deploy) is sent again to the next one: it has its seed. A completion the stand-in says was decoded by any
   policy but the pushed one, or that straddled a policy update, is an error (`StalePolicyError`), not a
   rollout. `windows` keeps what the fleet counted while each step's rollouts decoded: its live acceptance
   (`vllm:spec_decode_*`), its rounds by kind and the batch threshold it ended with.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from pipeline.data.fleet_state import FleetPolicy
from pipeline.data.keys import fleet_policy_key, fleet_prefix
from pipeline.data.lease import hold
from pipeline.data.records import write_record
from pipeline.data.rollout_engine import GeneratedRollout, RolloutEngine, RolloutRequest
from pipeline.data.store import ObjectStore
from pipeline.serving import metrics as serving_metrics
from pipeline.serving.drivers import ReplicaDriver, ReplicaSpec, call, local_directory
from pipeline.serving.gates import wait_healthy
from pipeline.serving.hot_update import (
    HotUpdateFailed,
    HotUpdateUnsupported,
    policy_version,
    send_policy,
)

REQUEST_TIMEOUT_S = 900.0  # one rollout's completion at most
ATTEMPTS_PER_REPLICA = 3


class StalePolicyError(RuntimeError):
    """A rollout decoded by another policy than the step's: the step's rollouts are not the step's policy's."""


@dataclass
class RolloutWindow:
    """What the fleet counted while a step's rollouts decoded."""

    step: int
    rollouts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    counters: serving_metrics.SpecCounters = field(default_factory=serving_metrics.SpecCounters)
    rounds: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, int | None] = field(default_factory=dict)  # replica -> its batch threshold at the end

    def to_json(self) -> dict:
        return {"step": self.step, "rollouts": self.rollouts, "tokens": self.tokens,
                "seconds": round(self.seconds, 3), "tokens_per_s": self.tokens / self.seconds if self.seconds else None,
                "live_tau": self.counters.mean_acceptance_length,
                "drafts": self.counters.drafts, "accepted": self.counters.accepted, "rounds": self.rounds,
                "speculative_batch_threshold": self.thresholds}


class FleetRollouts:
    """Pushes each step's policy to `replicas` and generates its rollouts on them."""

    def __init__(self, replicas: list[ReplicaSpec], driver: ReplicaDriver, store: ObjectStore, run: str,
                 ready_timeout_s: float = 120.0, lease_s: float = 1800.0, lease_wait_s: float = 300.0,
                 concurrency: int = 256) -> None:
        self.replicas, self.driver, self.store, self.run = replicas, driver, store, run
        self.ready_timeout_s, self.lease_s, self.lease_wait_s = ready_timeout_s, lease_s, lease_wait_s
        self.concurrency = concurrency
        self.label: str | None = None  # the policy pushed last
        self.step: int | None = None
        self.windows: dict[int, RolloutWindow] = {}

    def engine(self) -> RolloutEngine:
        """The callables a source is given."""
        return RolloutEngine(self.push_policy, self.generate)

    # -- the policy --------------------------------------------------------------------------------------------

    def push_policy(self, step: int, checkpoint_uri: str) -> None:
        """Step `step`'s policy on every replica before its first rollout request."""
        target = self.store.resolve(checkpoint_uri)
        policy_dir = local_directory(target)
        label = policy_version(policy_dir or target)
        with hold(self.store, fleet_prefix(self.run), f"policy-{step}-{uuid.uuid4().hex[:8]}", self.lease_s,
                  self.lease_wait_s):
            for replica in self.replicas:
                self._push(replica, target, policy_dir)
            write_record(self.store, fleet_policy_key(self.run), FleetPolicy(step, target, label, time.time()))
        self.label, self.step = label, step

    def _push(self, replica: ReplicaSpec, target: str, policy_dir: str | None) -> None:
        serving = self.driver.serving(replica)
        drafter = serving[1] if serving else ""
        if serving is None and not self._answers(replica):  # not running: it starts on the policy
            self._restart(replica, target, drafter)
            return
        if serving is not None and serving[0] == target:
            return
        if policy_dir is not None:
            try:
                send_policy(replica, policy_dir)
                self.driver.updated(replica, drafter, target)
                return
            except (HotUpdateUnsupported, HotUpdateFailed):
                pass  # no routes, or a failed update: it restarts on the policy
        self._restart(replica, target, drafter)

    def _restart(self, replica: ReplicaSpec, target: str, drafter: str) -> None:
        self.driver.restart(replica, target, drafter)
        wait_healthy(replica, self.ready_timeout_s, lambda: self.driver.alive(replica))

    @staticmethod
    def _answers(replica: ReplicaSpec) -> bool:
        try:
            call(replica, "/health", timeout=5)
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    # -- the rollouts ------------------------------------------------------------------------------------------

    def generate(self, requests: list[RolloutRequest]) -> Iterator[tuple[int, GeneratedRollout]]:
        """(index, rollout) in the order the fleet finishes them."""
        if self.label is None:
            raise RuntimeError("no policy was pushed to the fleet: push_policy comes before a step's rollouts")
        window = self.windows[self.step] = RolloutWindow(self.step)
        before = self._scrape()
        started, finished = time.monotonic(), [0.0]
        pool = ThreadPoolExecutor(min(self.concurrency, max(1, len(requests))), thread_name_prefix="rollout")
        try:
            futures = {pool.submit(self._complete, i, r, self.label): i for i, r in enumerate(requests)}
            for future in futures:  # when the fleet finished each, whenever the caller takes it
                future.add_done_callback(lambda _: finished.__setitem__(0, max(finished[0], time.monotonic())))
            for future in as_completed(futures):
                rollout = future.result()
                window.rollouts += 1
                window.tokens += len(rollout.token_ids)
                yield futures[future], rollout
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        window.seconds = finished[0] - started  # the fleet's time: from the first request to the last completion
        after = self._scrape()
        for name, (counters, threshold, rounds) in after.items():
            earlier = before.get(name)
            if earlier is not None and not _reset(earlier[0], earlier[2], counters, rounds):
                counters = counters - earlier[0]
                rounds = {k: v - earlier[2].get(k, 0.0) for k, v in rounds.items()}
            window.counters += counters
            window.rounds = {k: window.rounds.get(k, 0.0) + v for k, v in rounds.items()}
            window.thresholds[name] = threshold

    def _scrape(self) -> dict[str, tuple[serving_metrics.SpecCounters, int | None, dict[str, float]]]:
        out = {}
        for replica in self.replicas:
            try:
                text = call(replica, "/metrics", timeout=10).decode()
            except OSError:
                continue  # a replica down now has no say in the window
            threshold, rounds = serving_metrics.read_standin(text)
            out[replica.name] = (serving_metrics.parse(text), threshold, rounds)
        return out

    def _complete(self, index: int, request: RolloutRequest, label: str) -> GeneratedRollout:
        body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "seed": request.seed,
                **request.sampling.to_json(), "stop_token_ids": list(request.stop_token_ids), "logprobs": 1,
                "return_token_ids": True}
        failures = []
        for attempt in range(ATTEMPTS_PER_REPLICA * len(self.replicas)):
            replica = self.replicas[(index + attempt) % len(self.replicas)]
            try:
                doc = json.loads(call(replica, "/v1/completions", {"model": replica.served_model_name, **body},
                                      timeout=REQUEST_TIMEOUT_S))
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    raise RuntimeError(f"replica {replica.name} refused rollout {index}: HTTP {exc.code} "
                                       f"{exc.read().decode(errors='replace')[:300]}") from None
                failures.append(f"{replica.name}: HTTP {exc.code}")
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as exc:
                failures.append(f"{replica.name}: {exc}")  # restarted or down: the next replica decodes it
            else:
                return _rollout(doc, replica, index, label)
            time.sleep(min(2.0, 0.2 * (attempt + 1)))
        raise RuntimeError(f"rollout {index}: no replica decoded it ({'; '.join(failures[-3:])})")


def _rollout(doc: dict, replica: ReplicaSpec, index: int, label: str) -> GeneratedRollout:
    standin = doc.get("standin")
    if standin is not None:  # a vLLM replica has no such field: its policy is the one /weight_info reported
        if standin.get("straddles_policy_update"):
            raise StalePolicyError(f"replica {replica.name}: rollout {index} straddled a policy update (now "
                                   f"{standin.get('policy_version')!r}); the step's rollouts are {label!r}'s")
        if standin.get("policy_version") != label:
            raise StalePolicyError(f"replica {replica.name}: rollout {index} was decoded by "
                                   f"{standin.get('policy_version')!r}, not the step's policy {label!r}")
    choice = doc["choices"][0]
    return GeneratedRollout(list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]),
                            choice["finish_reason"])


def _reset(counters: serving_metrics.SpecCounters, rounds: dict[str, float], counters_now: serving_metrics.SpecCounters,
           rounds_now: dict[str, float]) -> bool:
    """Whether a replica restarted between two scrapes: any of its counters went down (Prometheus's rule; a replica
    that had no drafter before its restart shows no drafts either side, but its rounds start again from 0). Its
    window then counts from 0."""
    pairs = [(counters.drafts, counters_now.drafts), (counters.draft_tokens, counters_now.draft_tokens),
             (counters.accepted, counters_now.accepted), *((v, rounds_now.get(k, 0.0)) for k, v in rounds.items())]
    return any(now < then for then, now in pairs)
