"""Hot updates of the fleet's drafter: vLLM's dev-mode weight-update routes on stand-in replicas (not vLLM).

A replica is paused (its requests held, not dropped), sent the new drafter checkpoint, resumed, and must then
report the new weight version and propose with the new drafter; a failed update rolls back; a replica without
the routes is restarted. The replicas are stand-in processes on loopback ports, each asserted from what it
serves: /weight_info (vLLM's route), its /metrics counters against the same drafter decoding here, and the
stand-in's own request counts (/standin/requests, a test-only route).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from pipeline.data.fleet_state import read_fleet_state
from pipeline.data.store import ObjectStore
from pipeline.evaluation import speculative
from pipeline.models import target as target_lib
from pipeline.models.checkpoint import load_drafter
from pipeline.serving import metrics as serving_metrics
from pipeline.serving.deploy import record_stopped
from pipeline.serving.drivers import ReplicaSpec, StandInDriver, local_directory
from pipeline.serving.fleet import StagedDrafter, roll_back, rolling_deploy
from pipeline.serving.gates import GateConfig, GateError
from pipeline.serving.hot_update import HotUpdateFailed, Weights, hot_update
from tests.unit.serving.conftest import free_port

GATES = GateConfig(ready_timeout_s=90, canary_requests=2, canary_tokens=8, min_live_tau=1.0)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]
GATE_COMPLETIONS = GATES.canary_requests  # the canary window
PROBE, PROBE_TOKENS = [1, 2, 3, 4], 16  # a prompt on which the two test drafters accept differently
K = 3


def _call(replica: ReplicaSpec, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(replica.url + path, method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read() or b"{}")


def _complete(replica: ReplicaSpec, prompt: list[int], max_tokens: int) -> list[int]:
    return _call(replica, "/v1/completions", {"model": "policy", "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0, "return_token_ids": True})["choices"][0]["token_ids"]


def _probe_window(replica: ReplicaSpec) -> tuple[float, float]:
    """(drafts, accepted) the replica's /metrics count over one completion of the probe prompt."""
    before = serving_metrics.parse(urllib.request.urlopen(replica.url + "/metrics", timeout=30).read().decode())
    _complete(replica, PROBE, PROBE_TOKENS)
    after = serving_metrics.parse(urllib.request.urlopen(replica.url + "/metrics", timeout=30).read().decode())
    window = after - before
    return window.drafts, window.accepted


@pytest.fixture(scope="module")
def expected(models: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(drafts, accepted) of the probe decoded here with each drafter checkpoint: what a replica serving it counts."""
    target = target_lib.load_checkpoint(models["target"])
    out = {}
    for version in ("v1", "v2"):
        drafter = load_drafter(Path(models[version]), target.config.num_hidden_layers)
        drafter.attach(target)
        trace = speculative.speculative_generate(target, speculative.follow_target(drafter, target),
                                                 torch.tensor(PROBE), PROBE_TOKENS, K)
        out[version] = (float(len(trace.accepted_per_round)), float(sum(trace.accepted_per_round)))
    assert out["v1"] != out["v2"], "the probe must tell the two drafters apart"
    return out


@dataclass
class Traffic:
    """Clients sending completions to the replicas in turn until stopped, counting what came back."""

    replicas: list[ReplicaSpec]
    ok: dict[str, int]
    failed: list[str]

    @classmethod
    def start(cls, replicas: list[ReplicaSpec], clients: int
              ) -> tuple[Traffic, threading.Event, list[threading.Thread]]:
        traffic, stop = cls(replicas, {r.name: 0 for r in replicas}, []), threading.Event()
        lock = threading.Lock()

        def client(offset: int) -> None:
            i = offset
            while not stop.is_set():
                replica = replicas[i % len(replicas)]
                try:
                    tokens = _complete(replica, PROMPTS[i % len(PROMPTS)], 8)
                    assert len(tokens) == 8
                    with lock:
                        traffic.ok[replica.name] += 1
                except (urllib.error.URLError, OSError, AssertionError, KeyError) as exc:
                    with lock:
                        traffic.failed.append(f"{replica.name}: {exc}")
                i += 1

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
        for thread in threads:
            thread.start()
        return traffic, stop, threads


def test_hot_update_mid_traffic_holds_requests_and_swaps_the_proposals(
    models: dict[str, str], driver: StandInDriver, expected: dict[str, tuple[float, float]]
) -> None:
    replicas = [ReplicaSpec(f"r{i}", "127.0.0.1", free_port()) for i in range(2)]
    first = rolling_deploy(replicas, driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)
    assert [r.update for r in first.replicas] == ["restart", "restart"]
    assert [_probe_window(r) for r in replicas] == [expected["v1"]] * 2
    pids = {name: process.pid for name, process in driver.processes.items()}

    traffic, stop, threads = Traffic.start(replicas, clients=3)
    time.sleep(1.0)  # traffic flowing on both replicas before the update
    second = rolling_deploy(replicas, driver, models["target"], "2", models["v2"], StagedDrafter("1", models["v1"]),
                            GATES, PROMPTS)
    time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)

    # Updated in place, one at a time: the same processes, each held its requests for a moment.
    assert [(r.replica, r.version, r.update, r.restarted) for r in second.replicas] == [
        ("r0", "2", "hot", False), ("r1", "2", "hot", False)]
    assert all(0.0 < r.paused_s < 30.0 and r.live_tau >= 1.0 and r.target == models["target"]
               for r in second.replicas)
    assert {name: process.pid for name, process in driver.processes.items()} == pids
    assert all(driver.serving(r) == (models["target"], models["v2"]) for r in replicas)
    # The replica reports the new version (vLLM's /weight_info) and proposes with the new drafter.
    assert [_call(r, "/weight_info")["weight_version"] for r in replicas] == ["drafter-v2", "drafter-v2"]
    assert [_probe_window(r) for r in replicas] == [expected["v2"]] * 2

    # No request lost or failed: every completion a client sent came back, and each replica counted exactly
    # those, the gates' own and the probes.
    assert traffic.failed == []
    for replica in replicas:
        counts = _call(replica, "/standin/requests")
        assert (counts["failed"], counts["in_flight"]) == (0, 0)
        assert counts["completed"] == traffic.ok[replica.name] + 2 * GATE_COMPLETIONS + 2
    assert all(n > 0 for n in traffic.ok.values())


def test_paused_replica_holds_a_request_until_resume(models: dict[str, str], driver: StandInDriver) -> None:
    replica = ReplicaSpec("r0", "127.0.0.1", free_port())
    rolling_deploy([replica], driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)
    assert _call(replica, "/pause?mode=keep", {}) == {"status": "paused"}
    assert _call(replica, "/is_paused") == {"is_paused": True}
    done: list[list[int]] = []
    client = threading.Thread(target=lambda: done.append(_complete(replica, PROMPTS[0], 8)))
    client.start()
    deadline = time.monotonic() + 30
    while _call(replica, "/standin/requests")["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)  # the request reaching the server
    time.sleep(0.5)
    held = _call(replica, "/standin/requests")
    assert (done, held["in_flight"], held["held"]) == ([], 1, 1)  # waiting, not refused
    assert urllib.request.urlopen(replica.url + "/health", timeout=10).status == 200  # still answering
    _call(replica, "/resume", {})
    client.join(timeout=60)
    assert len(done[0]) == 8
    assert _call(replica, "/standin/requests") == {"completed": 1 + GATE_COMPLETIONS, "failed": 0, "cancelled": 0,
                                                   "held": 1, "in_flight": 0}

    # `fleet.update: restart`: restarted although it could take the update in place.
    [restarted] = rolling_deploy([replica], driver, models["target"], "2", models["v2"],
                                 StagedDrafter("1", models["v1"]), GATES, PROMPTS, update="restart").replicas
    assert (restarted.update, restarted.restarted, restarted.note) == ("restart", True, "")


def test_failing_update_weights_rolls_back_then_restarts(
    models: dict[str, str], driver: StandInDriver, expected: dict[str, tuple[float, float]], store: ObjectStore
) -> None:
    replica = ReplicaSpec("r0", "127.0.0.1", free_port())
    previous = StagedDrafter("1", models["v1"])
    rolling_deploy([replica], driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)

    # A partial update: the stand-in loads the new weights, then /update_weights fails. With nothing to put back
    # the replica stays paused (never resumed on half-loaded weights); the rollback sends version 1 and resumes.
    assert _call(replica, "/standin/faults", {"update_weights": 1}) == {"update_weights": 1}
    with pytest.raises(HotUpdateFailed, match=r"/update_weights answered HTTP 500: .*stand-in fault.*stays paused"):
        hot_update(replica, models["v2"], "2")
    assert _call(replica, "/is_paused") == {"is_paused": True}
    assert roll_back(replica, driver, models["target"], previous, GATES, lambda: True) == "hot"
    assert _call(replica, "/weight_info") == {"weight_version": "drafter-v1"}
    assert _call(replica, "/is_paused") == {"is_paused": False}
    assert _probe_window(replica) == expected["v1"]

    # With the weights it had to put back: back in place while paused, then resumed on them.
    _call(replica, "/standin/faults", {"update_weights": 1})
    with pytest.raises(HotUpdateFailed, match="version 1 put back before the replica resumed") as failed:
        hot_update(replica, models["v2"], "2", restore=Weights(models["v1"], "1"))
    assert failed.value.rolled_back
    assert (_call(replica, "/is_paused"), _call(replica, "/weight_info")) == (
        {"is_paused": False}, {"weight_version": "drafter-v1"})
    assert _probe_window(replica) == expected["v1"]

    # Within a deploy: rolled back in place, then the restart path of every vLLM version brings version 2.
    pid = driver.processes["r0"].pid
    _call(replica, "/standin/faults", {"update_weights": 1})
    report = rolling_deploy([replica], driver, models["target"], "2", models["v2"], previous, GATES, PROMPTS)
    [entry] = report.replicas
    assert (entry.version, entry.update, entry.restarted) == ("2", "restart", True)
    assert "hot update failed (/update_weights answered HTTP 500" in entry.note
    assert entry.note.endswith("rolled back to version 1 by hot; restarted")
    assert driver.processes["r0"].pid != pid
    assert _probe_window(replica) == expected["v2"]

    # A version no replica can load: rolled back (hot, then by the restart path's own rollback), the deploy
    # stops before r1 (recorded on version 2, never contacted), and the fleet's recorded state says what each
    # replica runs.
    other = replace(entry, replica="r1")
    with pytest.raises(GateError, match="replica r0: .*rolled back to version 2; deploy of version 3 stopped") as exc:
        rolling_deploy([replica, ReplicaSpec("r1", "127.0.0.1", free_port())], driver, models["target"], "3",
                       models["broken"], StagedDrafter("2", models["v2"]), GATES, PROMPTS,
                       recorded={"r0": entry, "r1": other})
    record_stopped(store, "run", exc.value.replicas)
    state = read_fleet_state(store, "run")
    assert [(r.replica, r.version, r.update) for r in state.replicas] == [("r0", "2", "rolled back"),
                                                                         ("r1", "2", "restart")]
    assert "hot update failed" in state.replicas[0].note
    assert state.replicas[0].live_tau == entry.live_tau  # the one measured when it got version 2
    assert (state.version, state.history) == (None, ())  # the deploy did not complete: nothing went live
    assert driver.serving(replica) == (models["target"], models["v2"])


def test_replica_without_the_routes_is_restarted(
    models: dict[str, str], driver: StandInDriver, expected: dict[str, tuple[float, float]]
) -> None:
    """r1 runs as a vLLM server started without VLLM_SERVER_DEV_MODE: its routes answer 404."""
    replicas = [ReplicaSpec(f"r{i}", "127.0.0.1", free_port()) for i in range(2)]
    rolling_deploy(replicas[:1], driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)
    plain = StandInDriver(k=K, state_dir=driver.state_dir, dev_mode=False)
    try:
        rolling_deploy(replicas[1:], plain, models["target"], "1", models["v1"], None, GATES, PROMPTS)
        with pytest.raises(urllib.error.HTTPError, match="404"):
            _call(replicas[1], "/pause?mode=keep", {})
        report = rolling_deploy(replicas, driver, models["target"], "2", models["v2"],
                                StagedDrafter("1", models["v1"]), GATES, PROMPTS)
    finally:
        driver.processes.update(plain.processes)  # the fixture stops them all
    assert [(r.replica, r.update) for r in report.replicas] == [("r0", "hot"), ("r1", "restart")]
    assert report.replicas[1].note == "no hot update (/init_weight_transfer_engine answered HTTP 404); restarted"
    assert [_probe_window(r) for r in replicas] == [expected["v2"]] * 2
    # Restarted by a hot-updating fleet, it now serves the routes.
    assert _call(replicas[1], "/is_paused") == {"is_paused": False}


def _decoded_here(target_uri: str, drafter_dir: str) -> tuple[list[int], tuple[float, float]]:
    """The probe's tokens and (drafts, accepted) decoded here with a policy and a drafter checkpoint."""
    target = target_lib.load_checkpoint(target_uri)
    drafter = load_drafter(Path(drafter_dir), target.config.num_hidden_layers)
    drafter.attach(target)
    trace = speculative.speculative_generate(target, speculative.follow_target(drafter, target),
                                             torch.tensor(PROBE), PROBE_TOKENS, K)
    return list(trace.tokens), (float(len(trace.accepted_per_round)), float(sum(trace.accepted_per_round)))


def test_a_new_policy_goes_in_place_with_the_drafter_and_a_failed_one_rolls_back(
    models: dict[str, str], driver: StandInDriver
) -> None:
    replica = ReplicaSpec("r0", "127.0.0.1", free_port())
    rolling_deploy([replica], driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)
    pid = driver.processes["r0"].pid

    # The next step's policy and its drafter, sent in place mid-traffic: one pause, no restart.
    traffic, stop, threads = Traffic.start([replica], clients=2)
    time.sleep(0.5)
    [entry] = rolling_deploy([replica], driver, models["target2"], "2", models["v2"], StagedDrafter("1", models["v1"]),
                             GATES, PROMPTS, recorded={}).replicas
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert (entry.update, entry.restarted, entry.target) == ("hot", False, models["target2"])
    assert entry.note == "the new policy and the drafter sent in place"
    assert driver.processes["r0"].pid == pid
    assert driver.serving(replica) == (models["target2"], models["v2"])
    assert _call(replica, "/weight_info") == {"weight_version": "drafter-v2"}
    tokens, window = _decoded_here(models["target2"], models["v2"])
    assert _complete(replica, PROBE, PROBE_TOKENS) == tokens  # the new policy's greedy tokens
    assert _probe_window(replica) == window  # proposed by the new drafter on the new policy
    assert traffic.failed == []
    counts = _call(replica, "/standin/requests")
    assert (counts["failed"], counts["in_flight"]) == (0, 0)
    assert counts["completed"] == traffic.ok["r0"] + 2 * GATE_COMPLETIONS + 2

    # The policy's /update_weights fails once the weights are in (a partial update): the replica gets its policy
    # and drafter back in place, then the restart path brings the new ones.
    _call(replica, "/standin/faults", {"update_weights": 1})
    [failed] = rolling_deploy([replica], driver, models["target"], "3", models["v1"], StagedDrafter("2", models["v2"]),
                              GATES, PROMPTS).replicas
    assert (failed.version, failed.update, failed.restarted) == ("3", "restart", True)
    assert "hot update failed (/update_weights answered HTTP 500" in failed.note
    assert failed.note.endswith("rolled back to version 2 by hot; restarted")
    assert driver.serving(replica) == (models["target"], models["v1"])
    assert _complete(replica, PROBE, PROBE_TOKENS) == _decoded_here(models["target"], models["v1"])[0]


@pytest.mark.reliability("fault", "a policy update failing halfway while a request is held: the request decodes on "
                                  "the policy put back, never on the half-loaded one")
def test_a_request_held_across_a_failed_update_decodes_on_the_weights_put_back(
    models: dict[str, str], driver: StandInDriver
) -> None:
    """The replica serves `target` with v1; the deploy's hot update (`_try_hot` hands it the weights to put back)
    sends `target2` and v2 in place, and the policy's /update_weights fails once `target2` is loaded. A request
    held by the pause meanwhile is answered with `target`'s greedy tokens: the replica resumed only once `target`
    and v1 were back."""
    replica = ReplicaSpec("r0", "127.0.0.1", free_port())
    rolling_deploy([replica], driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)
    old, new = (_decoded_here(models[t], models[v])[0] for t, v in (("target", "v1"), ("target2", "v2")))
    assert old != new, "the probe must tell the two policies apart"
    _call(replica, "/standin/faults", {"update_weights": 1})
    _call(replica, "/pause?mode=keep", {})  # the request arrives while the replica is paused, as one mid-update
    held: list[list[int]] = []
    client = threading.Thread(target=lambda: held.append(_complete(replica, PROBE, PROBE_TOKENS)))
    client.start()
    deadline = time.monotonic() + 30
    while _call(replica, "/standin/requests")["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    policy, policy2 = (local_directory(models[t]) for t in ("target", "target2"))
    with pytest.raises(HotUpdateFailed, match="/update_weights answered HTTP 500.*version 1 put back"):
        hot_update(replica, models["v2"], "2", policy2, restore=Weights(models["v1"], "1", policy))
    client.join(timeout=60)
    assert held == [old]
    assert _call(replica, "/weight_info") == {"weight_version": "drafter-v1"}
    assert _complete(replica, PROBE, PROBE_TOKENS) == old
