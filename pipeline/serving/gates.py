"""The gates a replica passes before a deploy moves on: GET /health answers 200, GET /v1/models lists the served
model, and over a window of canary completions (the first must return a token) its live mean acceptance length
reaches the configured minimum and, where the product can count the window itself, agrees with the product's
count of the same tokens (`pipeline.serving.agreement`).

The live tau is the canaries' own where the replica reports each completion's counts (vLLM with
--per-request-spec-decode-metrics): a replica that serves other requests during its canaries (rollouts held by a
hot update and resumed with them, a step's tail during a refresh) counts their drafts in its /metrics too, and
that window is no longer the canaries'. Elsewhere (the stand-ins) it is the window between two scrapes of
GET /metrics, which opens before the first canary: a replica given new weights speculates its first round whatever
its measured threshold says (the stand-in's `SpeculationThreshold` measures a new drafter again from there), so
a window that began after a completion of its own could see only plain rounds and count no draft at all.
"""

from __future__ import annotations

import json
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.data.fleet_state import ReplicaDeploy
from pipeline.serving.agreement import AgreementUnmeasured, Canary, disagreement
from pipeline.serving.drivers import ReplicaSpec, call
from pipeline.serving.metrics import SpecCounters, request_counters, scrape


class GateError(RuntimeError):
    """A replica failed a deploy gate; the message names the replica and the gate. A stopped deploy says
    what each replica it reached runs now (`replicas`), the one that failed as rolled back."""

    def __init__(self, message: str, replicas: tuple[ReplicaDeploy, ...] = ()) -> None:
        super().__init__(message)
        self.replicas = replicas


@dataclass(frozen=True)
class GateConfig:
    """The deploy gates of a replica; the values come from `fleet.*` of the pipeline config (one default each)."""

    ready_timeout_s: float
    canary_requests: int
    canary_tokens: int
    min_live_tau: float
    tau_agreement: float = 0.05
    # The product's count of the window's rounds, given the replica's policy and drafter directories: the
    # agreement gate; None where it is not checked.
    count: Callable[[str, str, list[Canary]], float] | None = None


@dataclass(frozen=True)
class Served:
    """What a replica was given, as local directories: what the product counts its canaries with."""

    policy_dir: str | None  # None: not on local disk, so the agreement is not checked
    drafter_dir: str


def wait_healthy(replica: ReplicaSpec, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call(replica, "/health", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if not alive():
                raise GateError(f"replica {replica.name}: its process exited before /health answered") from None
            if time.monotonic() > deadline:
                raise GateError(f"replica {replica.name}: /health not ready after {timeout_s:.0f}s ({exc})") from None
            time.sleep(0.5)


def check_replica(
    replica: ReplicaSpec, gates: GateConfig, canary_prompts: list[list[int]], alive: Callable[[], bool] = lambda: True,
    served: Served | None = None,
) -> float:
    """All gates in order; returns the live mean acceptance length over the canary window."""
    wait_healthy(replica, gates.ready_timeout_s, alive)
    try:
        models = [m["id"] for m in json.loads(call(replica, "/v1/models"))["data"]]
        if replica.served_model_name not in models:
            raise GateError(f"replica {replica.name}: /v1/models lists {models}, not {replica.served_model_name!r}")
        # Canaries decode greedily (temperature 0): the same window measures the same drafter alike, and their
        # answers fix the rounds the product counts.
        before = scrape(replica)
        canaries, own = [], []
        for i in range(gates.canary_requests):
            prompt = canary_prompts[i % len(canary_prompts)]
            answer = json.loads(call(replica, "/v1/completions", {
                "model": replica.served_model_name, "prompt": prompt, "max_tokens": gates.canary_tokens,
                "temperature": 0, "return_token_ids": True}))
            if not answer["choices"]:
                raise GateError(f"replica {replica.name}: canary completion {i + 1} returned no choice")
            if i == 0 and not answer["choices"][0].get("token_ids"):
                raise GateError(f"replica {replica.name}: the first canary completion returned no token")
            canaries.append(Canary(prompt, answer["choices"][0]["token_ids"]))
            own.append(request_counters(answer))
        window = sum(own, SpecCounters()) if all(c is not None for c in own) else scrape(replica) - before
    except (urllib.error.URLError, KeyError, json.JSONDecodeError) as exc:
        raise GateError(f"replica {replica.name}: {exc}") from None
    tau = window.mean_acceptance_length
    if tau is None:
        raise GateError(f"replica {replica.name}: no draft over its {len(canaries)} canaries (it decoded them "
                        "without speculating): live tau unmeasured")
    if tau < gates.min_live_tau:
        raise GateError(f"replica {replica.name}: live tau {tau} below the gate {gates.min_live_tau}")
    if gates.count is not None and served is not None and served.policy_dir is not None:
        try:
            counted = gates.count(served.policy_dir, served.drafter_dir, canaries)
        except AgreementUnmeasured as exc:
            raise GateError(f"replica {replica.name}: {exc}") from None
        if why := disagreement(tau, counted, gates.tau_agreement):
            raise GateError(f"replica {replica.name}: {why}")
    return tau
