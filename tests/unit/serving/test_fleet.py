"""Serving fleet: vLLM argv, metrics parsing, stand-in replica processes, rolling deploy and rollback.

vLLM's command line is tested as argv here, and the replicas are stand-in processes
(`pipeline.serving.standin.replica`, not vLLM) on loopback ports; tests/integration/test_vllm.py runs real
vLLM replicas.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.config import PipelineConfig, load_config
from pipeline.data.fleet_state import FleetState, ReplicaDeploy, read_fleet_state
from pipeline.data.keys import fleet_policy_key, fleet_state_key, policy_pointer_key
from pipeline.data.records import RecordError, write_record
from pipeline.data.rollouts import PolicyPointer, Rollout, RolloutsError, read_policy_pointer, write_rollouts
from pipeline.data.store import ObjectStore, open_store
from pipeline.evaluation import speculative
from pipeline.serving import deploy
from pipeline.serving import metrics as serving_metrics
from pipeline.serving.drivers import (
    CommandDriver,
    PortTakenError,
    ReplicaSpec,
    Speculation,
    StandInDriver,
    VllmDriver,
    VllmServer,
    vllm_argv,
    vllm_env,
)
from pipeline.serving.fleet import StagedDrafter, rolling_deploy
from pipeline.serving.gates import GateConfig, GateError, check_replica
from pipeline.serving.hot_update import hot_update
from tests.support.targets import tiny_target
from tests.unit.serving.conftest import free_port as _free_port

# An excerpt of a vLLM /metrics page (v1 engine, two engines behind one server), as served.
RECORDED_VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4000.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2000.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2100.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 900.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="0"} 800.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",position="1"} 600.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct",position="0"} 400.0
"""


def test_parse_recorded_vllm_metrics() -> None:
    counters = serving_metrics.parse(RECORDED_VLLM_METRICS)
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (1500.0, 6000.0, 3000.0)
    assert counters.accepted_per_position == {0: 1200.0, 1: 600.0}
    assert counters.mean_acceptance_length == 3.0
    assert counters.acceptance_rate == 0.5
    window = counters - serving_metrics.SpecCounters(1000.0, 4000.0, 1000.0, {0: 500.0})
    assert window.mean_acceptance_length == 1 + 2000 / 500


def test_render_parses_back() -> None:
    counters = serving_metrics.SpecCounters(10, 40, 25, {0: 9, 1: 7, 2: 5, 3: 4})
    assert serving_metrics.parse(serving_metrics.render(counters, "m")) == counters
    # The live-tau sensor keeps counters in its cursor as JSON.
    assert serving_metrics.SpecCounters.from_json(json.loads(json.dumps(counters.to_json()))) == counters


@pytest.mark.parametrize(("method", "kind"), [("eagle", "EAGLE-1/2"), ("eagle3", "EAGLE-3")], ids=["eagle", "eagle3"])
def test_vllm_argv(method: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    del kind
    monkeypatch.setenv("REPLICA_KEY", "sk-secret-value")
    replica = ReplicaSpec("r0", "10.0.0.5", 8000, "policy", api_key_env="REPLICA_KEY")
    argv = vllm_argv(replica, "/models/policy-step-12", method, "/drafters/v7", 4)
    assert argv[:3] == ["vllm", "serve", "/models/policy-step-12"]
    assert argv[argv.index("--host") + 1] == "10.0.0.5"
    assert argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--served-model-name") + 1] == "policy"
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": method, "model": "/drafters/v7", "num_speculative_tokens": 4}
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "summary"  # the canaries' own counts
    assert "sk-secret-value" not in " ".join(argv)
    assert vllm_env(replica)["VLLM_API_KEY"] == "sk-secret-value"
    command = CommandDriver("supervisorctl-restart {name} -- {argv}", method, 4).command(
        replica, "/models/policy-step-12", "/drafters/v7")
    assert command.startswith("supervisorctl-restart r0 -- vllm serve /models/policy-step-12")
    assert "sk-secret-value" not in command


def test_a_local_vllm_replica_runs_the_module_entry_point_of_vllms_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPLICA_KEY", "sk-secret-value")
    monkeypatch.setenv("PYTHONPATH", "/the/pipeline")
    server = VllmServer(tmp_path / "venv" / "bin" / "python", "bfloat16", 1024, 2, ("--max-num-seqs", "16"))
    driver = VllmDriver(server, "eagle3", 4, tmp_path / "replicas", dev_mode=True)
    replica = ReplicaSpec("vllm-0", "127.0.0.1", 8101, "policy", api_key_env="REPLICA_KEY")
    argv = driver.argv(replica, (tmp_path / "policy").as_uri(), "/drafters/v7")
    assert argv[:5] == [str(server.python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                        str(tmp_path / "policy")]
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "disk"}
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    assert argv[-2:] == ["--max-num-seqs", "16"]
    assert driver.served(argv) == (str(tmp_path / "policy"), "/drafters/v7")
    assert "sk-secret-value" not in " ".join(argv)
    env = driver.environment(replica)
    assert (env["VLLM_API_KEY"], env["VLLM_SERVER_DEV_MODE"], env["VLLM_CPU_KVCACHE_SPACE"]) == \
        ("sk-secret-value", "1", "2")
    assert "PYTHONPATH" not in env  # the replica imports vLLM's environment, not the pipeline's
    assert "--skip-tokenizer-init" in argv
    assert "--return-tokens-as-token-ids" in argv
    plain = driver.argv(replica, str(tmp_path / "policy"), "")  # before the first deploy: no drafter
    assert "--speculative-config" not in plain
    assert "--per-request-spec-decode-metrics" not in plain
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "tokenizer.json").write_text("{}")
    assert "--skip-tokenizer-init" not in driver.argv(replica, str(tmp_path / "policy"), "")
    assert driver.served(plain) == (str(tmp_path / "policy"), "")
    with pytest.raises(ValueError, match="s3://"):
        driver.argv(replica, "s3://bucket/policy", "/drafters/v7")


def test_vllm_argv_with_a_weight_transfer_backend_starts_in_dev_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleet.weight_transfer_backend: disk`: vLLM started ready for hot drafter updates."""
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    replica = ReplicaSpec("r0", "10.0.0.5", 8000, "policy")
    argv = vllm_argv(replica, "/models/p", "eagle3", "/drafters/v7", 4, "disk")
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "disk"}
    assert "--weight-transfer-config" not in vllm_argv(replica, "/models/p", "eagle3", "/drafters/v7", 4)
    assert vllm_env(replica, dev_mode=True)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in vllm_env(replica)
    command = CommandDriver("restart {name} -- {argv}", "eagle3", 4, "disk").command(replica, "/models/p", "/d/v7")
    assert """--weight-transfer-config '{"backend": "disk"}'""" in command


def test_vllm_argv_serves_peagle_as_eagle3_with_parallel_drafting() -> None:
    argv = vllm_argv(ReplicaSpec("r0", "10.0.0.5", 8000, "policy"), "/models/p", "peagle", "/drafters/v7", 6)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": "/drafters/v7", "num_speculative_tokens": 6, "parallel_drafting": True}


def test_vllm_argv_carries_the_draft_sample_method_and_the_batch_threshold(tmp_path: Path) -> None:
    """`fleet.draft_sample_method` and `fleet.speculation_max_batch` as vLLM names them in --speculative-config
    (a threshold of 24 is the batch-size schedule: 4 drafts up to 24 requests, none above), and as the stand-in's
    flags."""
    replica = ReplicaSpec("r0", "10.0.0.5", 8000, "policy")
    speculation = Speculation("probabilistic", 24)
    argv = vllm_argv(replica, "/models/p", "eagle3", "/drafters/v7", 4, speculation=speculation)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": "/drafters/v7", "num_speculative_tokens": 4,
        "draft_sample_method": "probabilistic", "num_speculative_tokens_per_batch_size": [[1, 24, 4], [25, 1 << 20, 0]]}
    standin = StandInDriver(4, tmp_path, speculation=speculation).argv(replica, "file:///p", "/d")
    assert standin[standin.index("--draft-sample-method") + 1] == "probabilistic"
    assert standin[standin.index("--speculation-max-batch") + 1] == "24"
    assert StandInDriver(4, tmp_path).argv(replica, "file:///p", "/d")[-1] == "auto"  # measured by default


GATES = GateConfig(ready_timeout_s=90, canary_requests=2, canary_tokens=8, min_live_tau=1.0)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


def _get(replica: ReplicaSpec, path: str, key: str | None = None) -> bytes:
    request = urllib.request.Request(replica.url + path)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def test_standin_replica_serves_vllm_endpoints(
    models: dict[str, str], driver: StandInDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_KEY", "sk-standin")
    monkeypatch.delenv("PYTHONPATH", raising=False)  # as `python cli.py ...` starts it, without make's PYTHONPATH
    replica = ReplicaSpec("r0", "127.0.0.1", _free_port(), "policy", api_key_env="STANDIN_KEY")
    driver.restart(replica, models["target"], models["v1"])
    tau = check_replica(replica, GATES, PROMPTS)
    assert 1.0 <= tau <= 4.0
    with pytest.raises(urllib.error.HTTPError, match="401"):
        _get(replica, "/v1/models")  # no key
    assert json.loads(_get(replica, "/v1/models", "sk-standin"))["data"][0]["id"] == "policy"
    counters = serving_metrics.parse(_get(replica, "/metrics").decode())
    assert counters.drafts > 0
    assert counters.draft_tokens == 3 * counters.drafts
    # The stand-in's output is the target's greedy decoding, token for token.
    request = urllib.request.Request(
        replica.url + "/v1/completions", method="POST",
        data=json.dumps({"model": "policy", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0,
                         "return_token_ids": True}).encode(),
        headers={"Authorization": "Bearer sk-standin", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        tokens = json.loads(response.read())["choices"][0]["token_ids"]
    target = tiny_target(32, 32, 2, 2)
    assert tokens == speculative.greedy_generate(target, torch.tensor([1, 2, 3]), 6)


@pytest.mark.reliability("fault", "stand-in replica started by a process that ignores SIGINT and SIGTERM (a "
                         "background job under Dagster's signal mapping): the fleet's SIGTERM still stops it")
def test_a_replica_started_where_sigterm_is_ignored_still_stops_on_it(models: dict[str, str],
                                                                      driver: StandInDriver) -> None:
    replica = ReplicaSpec("r0", "127.0.0.1", _free_port(), "policy")
    ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        driver.restart(replica, models["target"], models["v1"])  # inherits both as ignored
    finally:
        for sig, handler in ignored.items():
            signal.signal(sig, handler)
    process = driver.processes[replica.name]
    check_replica(replica, GATES, PROMPTS)  # serving: its start-up is over
    driver.stop(replica)
    assert process.returncode == -signal.SIGTERM, "ended by the SIGKILL fallback, not by the SIGTERM"


CONTROL_ROUTES = [("POST", "/init_weight_transfer_engine", {"init_info": {}}), ("POST", "/pause?mode=keep", {}),
                  ("POST", "/resume", {}), ("POST", "/start_weight_update", {}), ("POST", "/start_draft_weight_update", {}),
                  ("POST", "/update_weights", {"update_info": {"path": "/etc"}}),
                  ("POST", "/finish_weight_update", {"weight_version": "drafter-v9"}),
                  ("POST", "/standin/faults", {"update_weights": 5}), ("GET", "/is_paused", None),
                  ("GET", "/weight_info", None), ("GET", "/standin/requests", None), ("GET", "/v1/models", None),
                  ("POST", "/v1/completions", {"model": "policy", "prompt": [1], "max_tokens": 1})]


def _call(replica: ReplicaSpec, method: str, path: str, body: dict | None, key: str | None = None) -> dict:
    request = urllib.request.Request(replica.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"{}")


@pytest.mark.reliability("security", "a stand-in replica started with an API key: every route but /health and "
                                     "/metrics (pause, weight updates, faults, weight info) refuses a caller "
                                     "without it")
def test_a_keyed_standin_asks_for_its_key_on_every_control_route(
    models: dict[str, str], driver: StandInDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller without the key can neither pause the replica, load a directory, commit a label nor probe for
    directories; the replica is as it was, and the fleet (which has the key) still updates it in place."""
    monkeypatch.setenv("STANDIN_KEY", "sk-standin")
    replica = ReplicaSpec("r0", "127.0.0.1", _free_port(), "policy", api_key_env="STANDIN_KEY")
    driver.restart(replica, models["target"], models["v1"])
    check_replica(replica, GATES, PROMPTS)
    for method, path, body in CONTROL_ROUTES:
        for key in (None, "sk-wrong", "sk-standin-and-more"):
            with pytest.raises(urllib.error.HTTPError, match="401"):
                _call(replica, method, path, body, key)
    assert _get(replica, "/health") == b""
    assert serving_metrics.parse(_get(replica, "/metrics").decode()).drafts > 0
    assert _call(replica, "GET", "/weight_info", None, "sk-standin") == {"weight_version": None}
    assert _call(replica, "GET", "/is_paused", None, "sk-standin") == {"is_paused": False}
    assert _call(replica, "GET", "/standin/requests", None, "sk-standin")["failed"] == 0
    held = hot_update(replica, models["v2"], "2")  # the fleet's calls carry the key
    assert held >= 0
    assert _call(replica, "GET", "/weight_info", None, "sk-standin") == {"weight_version": "drafter-v2"}


def _fleet(driver: str, host: str, key_env: str = "", **fleet: object) -> PipelineConfig:
    replica = {"name": "r0", "host": host, "port": 8000, "api_key_env": key_env}
    command = {"command": "supervisor restart {name} -- {argv}"} if driver == "command" else {}
    return load_config(overrides={"fleet": {"driver": driver, "replicas": [replica], **command, **fleet}})


@pytest.mark.parametrize(("cfg", "environ", "refused"), [
    pytest.param(_fleet("standin", "10.0.0.5"), {}, "off loopback they need an API key", id="standin-open"),
    pytest.param(_fleet("standin", "10.0.0.5", "K"), {"K": "sk"}, None, id="standin-keyed"),
    pytest.param(_fleet("standin", "10.0.0.5", "K"), {}, "names K, which is not set here", id="key-unset"),
    pytest.param(_fleet("standin", "127.0.0.1"), {}, None, id="standin-loopback"),
    pytest.param(_fleet("standin", "replica-0.internal", update="restart"), {}, None, id="restart-only"),
    pytest.param(_fleet("command", "10.0.0.5", "K", weight_transfer_backend="disk"), {"K": "sk"},
                 "vLLM's API key guards /v1/\\* only", id="vllm-dev-mode"),
    pytest.param(_fleet("command", "vllm-0.svc", "K"), {"K": "sk"}, "vLLM's API key guards", id="vllm-hot"),
    pytest.param(_fleet("command", "10.0.0.5", "K", weight_transfer_backend="disk", dev_routes_guarded=True),
                 {"K": "sk"}, None, id="vllm-guarded"),
    pytest.param(_fleet("command", "10.0.0.5", weight_transfer_backend="disk", dev_routes_guarded=True), {},
                 "need an API key", id="vllm-guarded-no-key"),
    pytest.param(_fleet("command", "::1", weight_transfer_backend="disk"), {}, None, id="vllm-loopback"),
])
def test_a_fleet_configuration_exposing_control_routes_is_refused(
    cfg: PipelineConfig, environ: dict, refused: str | None, monkeypatch: pytest.MonkeyPatch, reliability,
    request: pytest.FixtureRequest,
) -> None:
    """Hot updates rely on routes that pause serving and load weights: off loopback a replica must ask for a key,
    and a real vLLM (whose key guards /v1/* only) must have those routes guarded by the deployment. The deploy
    refuses anything else before it touches the fleet, the registry or the store."""
    problems = deploy.exposed_routes(cfg, environ)
    if refused is None:
        assert problems == []
        return
    reliability.security(f"a fleet configuration exposing control routes ({request.node.callspec.id}: "
                         f"{refused.replace(chr(92), '')}): deploy refused")
    assert len(problems) == 1
    assert re.search(refused, problems[0])
    assert problems[0].startswith("replica r0")
    monkeypatch.delenv("K", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(deploy.ExposedRoutes, match="exposes control routes; nothing was deployed"):
        deploy.deploy(cfg, None, None, "7")  # refused before the store or the registry is read


def test_rolling_deploy_and_rollback(models: dict[str, str], driver: StandInDriver) -> None:
    replicas = [ReplicaSpec(f"r{i}", "127.0.0.1", _free_port()) for i in range(2)]
    first = rolling_deploy(replicas, driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)
    assert [r.replica for r in first.replicas] == ["r0", "r1"]
    assert all(r.version == "1" and r.live_tau >= 1.0 and r.restarted for r in first.replicas)
    assert all(driver.serving(r) == (models["target"], models["v1"]) for r in replicas)

    # The same drafter on the same policy again: no replica restarts, each passes the gates again.
    pids = {name: process.pid for name, process in driver.processes.items()}
    again = rolling_deploy(replicas, driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)
    assert [(r.replica, r.restarted, r.update) for r in again.replicas] == [("r0", False, "none"),
                                                                            ("r1", False, "none")]
    assert all(r.live_tau >= 1.0 for r in again.replicas)
    assert {name: process.pid for name, process in driver.processes.items()} == pids

    with pytest.raises(GateError, match=r"replica r0: .*rolled back to version 1; deploy of version 2 stopped"):
        rolling_deploy(replicas, driver, models["target"], "2", models["broken"], StagedDrafter("1", models["v1"]),
                       GATES, PROMPTS)
    # r0 serves the previous drafter again, r1 was never touched: both keep serving.
    for replica in replicas:
        assert check_replica(replica, GATES, PROMPTS) >= 1.0
    assert driver.argv(replicas[0], models["target"], models["v1"]) == driver.processes["r0"].args

    # Another driver (the next Dagster run) takes over the replicas through their pid files.
    # It sees what they run, and with `fleet.update: restart` a new policy restarts a replica even with the
    # drafter it has (the hot path of a new policy: test_hot_update).
    successor = StandInDriver(k=3, state_dir=driver.state_dir)
    old_pid = driver.processes["r1"].pid
    driver.processes.clear()
    assert successor.alive(replicas[1])
    assert successor.serving(replicas[1]) == (models["target"], models["v1"])
    moved = rolling_deploy([replicas[1]], successor, models["target2"], "1", models["v1"], None, GATES, PROMPTS,
                           update="restart")
    assert moved.replicas[0].restarted
    assert (moved.replicas[0].update, moved.replicas[0].note) == ("restart", "")
    assert successor.serving(replicas[1]) == (models["target2"], models["v1"])
    assert successor.processes["r1"].pid != old_pid
    successor.stop_all(replicas)
    assert not any(successor.alive(r) for r in replicas)
    assert successor.serving(replicas[1]) is None


def test_live_tau_is_read_from_the_replicas_metrics_where_the_fleet_runs_the_version(
    models: dict[str, str], driver: StandInDriver, tmp_path: Path
) -> None:
    """What the `acceptance` schedule takes for the champion's tau now: the fleet's spec-decode counters since
    the version went live (a hot update does not reset them), over the replicas that run it."""
    cfg = load_config(overrides={"data_dir": str(tmp_path), "fleet": {"replicas": [
        {"name": f"r{i}", "port": _free_port()} for i in range(2)]}})
    store, replicas = open_store(cfg), deploy.replicas(cfg)
    report = rolling_deploy(replicas, driver, models["target"], "1", models["v1"], None, GATES, PROMPTS)
    assert deploy.live_tau(cfg, store, "1") is None  # the fleet's state does not say it runs version 1 yet

    def counters() -> list[serving_metrics.SpecCounters]:
        return [serving_metrics.parse(_get(r, "/metrics").decode()) for r in replicas]

    # No counters recorded at go-live (a state written before they were): everything since the replicas started.
    write_record(store, fleet_state_key(cfg.run), FleetState("1", 1, 0.0, report.replicas))
    since_start = counters()
    assert sum(c.drafts for c in since_start) > 0  # the canaries were decoded speculatively
    assert deploy.live_tau(cfg, store, "1") == pytest.approx(
        1 + sum(c.accepted for c in since_start) / sum(c.drafts for c in since_start))
    assert deploy.live_tau(cfg, store, "2") is None  # not the version the fleet runs

    # Counters recorded at go-live: only what was served since counts; nothing yet, then one request.
    write_record(store, fleet_state_key(cfg.run), FleetState("1", 1, 0.0, report.replicas, (),
                                                             {r.name: c.to_json() for r, c in zip(replicas, since_start,
                                                                                                  strict=True)}))
    assert deploy.live_tau(cfg, store, "1") is None
    request = urllib.request.Request(
        replicas[1].url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "policy", "prompt": PROMPTS[0], "max_tokens": 12}).encode())
    with urllib.request.urlopen(request, timeout=30):
        pass
    served = counters()[1] - since_start[1]
    assert served.drafts > 0
    assert deploy.live_tau(cfg, store, "1") == pytest.approx(served.mean_acceptance_length)
    driver.stop(replicas[1])  # an unreachable replica has no say
    assert deploy.live_tau(cfg, store, "1") is None


@pytest.mark.parametrize("planted", ["/etc", "file:///home/someone/their-policy", "s3://elsewhere/p", "; rm -rf ~"])
def test_a_recorded_policy_the_run_never_committed_is_not_trusted(planted: str, tmp_path: Path, reliability) -> None:
    """fleet/<run>/state.json is read as untrusted input: a replica's recorded policy is used (for a hot update's
    /update_weights, a restart's `vllm serve` line) only if it is one of the run's committed policies."""
    reliability.bad_input(f"fleet/<run>/state.json naming a policy the run never committed ({planted}): not sent "
                          "to a replica, the replica restarts on the served policy")
    cfg = load_config(overrides={"data_dir": str(tmp_path)})
    store = open_store(cfg)
    rows = [Rollout(f"s{i}", [1, 2, 3, 4], [0, 0, 1, 1], 0.5, 1) for i in range(3)]
    write_rollouts(store, cfg.run, 1, rows, PolicyPointer(1, f"policies/{cfg.run}/step-000001", "m"))
    committed = store.resolve(f"policies/{cfg.run}/step-000001")
    entry = ReplicaDeploy("standin-0", "3", 2.0, 1.0, False, "hot", "", 0.0, committed)
    write_record(store, fleet_state_key(cfg.run), FleetState("3", 1, 1.0, (entry, replace(
        entry, replica="standin-1", target=planted))))

    recorded = deploy.recorded_replicas(store, cfg, read_fleet_state(store, cfg.run).replicas, committed)
    assert recorded["standin-0"].target == committed
    assert recorded["standin-1"].target == ""  # unknown: `rolling_deploy` restarts it on the served policy


@pytest.mark.reliability("security", "a replica's port held by a process the fleet did not start (another demo's "
                                     "stand-in): the driver refuses to start there, naming the port, and sends nothing")
def test_a_port_held_by_another_process_is_refused(tmp_path: Path) -> None:
    with socket.socket() as theirs:
        theirs.bind(("127.0.0.1", 0))
        theirs.listen()
        replica = ReplicaSpec("standin-0", "127.0.0.1", theirs.getsockname()[1])
        driver = StandInDriver(4, tmp_path / "replicas")
        with pytest.raises(PortTakenError, match=rf"127.0.0.1:{replica.port} is held by a process this fleet did "
                                                 "not start"):
            driver.restart(replica, "file:///nowhere", "/nowhere")
        assert not driver.alive(replica)
        assert not (tmp_path / "replicas" / "standin-0.pid").exists()


def _committed_policy(tmp_path: Path) -> tuple[PipelineConfig, ObjectStore, deploy.ServedPolicy]:
    cfg = load_config(overrides={"data_dir": str(tmp_path)})
    store = open_store(cfg)
    rows = [Rollout(f"s{i}", [1, 2, 3, 4], [0, 0, 1, 1], 0.5, 1) for i in range(3)]
    write_rollouts(store, cfg.run, 1, rows, PolicyPointer(1, f"policies/{cfg.run}/step-000001", "m"))
    return cfg, store, deploy.ServedPolicy(1, store.resolve(f"policies/{cfg.run}/step-000001"), [])


def _stored(store: ObjectStore) -> dict[str, bytes]:
    """Every file in the store, links not followed."""
    root = Path(store.local_path(""))
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*")
            if path.is_file() and not path.is_symlink()}


@pytest.mark.parametrize("planted", ["/etc", "file:///home/someone/their-policy", "s3://elsewhere/p", "; rm -rf ~",
                                     "symlink"])
def test_a_pushed_fleet_policy_is_checked_as_a_trainers_checkpoint_uri_is(
    planted: str, tmp_path: Path, reliability
) -> None:
    """fleet/<run>/policy.json names the policy every replica decodes rollouts with, and a deploy serves it when it
    is newer: its target reached /update_weights and `vllm serve` as read. It is refused, naming the file and the
    field, unless it is a URI the store's policy allows that stays inside the store."""
    reliability.bad_input(f"fleet/<run>/policy.json naming a policy outside the store ({planted}): refused naming "
                          "the file and field, not sent to a replica")
    cfg, store, served = _committed_policy(tmp_path)
    if planted == "symlink":  # inside the store by name, elsewhere once followed
        link = Path(store.local_path("fleet")) / cfg.run / "policies" / "step-000002"
        link.parent.mkdir(parents=True)
        (tmp_path / "elsewhere").mkdir()
        link.symlink_to(tmp_path / "elsewhere")
        planted = store.resolve(f"fleet/{cfg.run}/policies/step-000002")
    store.write_json(fleet_policy_key(cfg.run), {"schema_version": 1, "step": 2, "target": planted,
                                                 "label": "policy-step-000002", "at": 1.0})
    before = _stored(store)

    with pytest.raises(RecordError, match=rf"fleet/{cfg.run}/policy\.json: field target"):
        deploy.newest_policy(store, cfg, served)
    assert _stored(store) == before


@pytest.mark.reliability("bad_input", "a committed step's policy.json with sampling.temperature of 400 digits: that "
                                      "step refused by name, every later deploy still reads the run's policies")
def test_one_steps_policy_of_hundreds_of_digits_stops_no_deploy(tmp_path: Path) -> None:
    """math.isfinite raised OverflowError, past the deploy's catch of a step refused at its commit point: every later
    deploy failed until someone deleted the step."""
    cfg, store, served = _committed_policy(tmp_path)
    pointer = store.read_json(policy_pointer_key(cfg.run, 1))
    store.write_json(policy_pointer_key(cfg.run, 1), {**pointer, "sampling": {"temperature": 10**400}})
    rows = [Rollout(f"s{i}", [1, 2, 3, 4], [0, 0, 1, 1], 0.5, 2) for i in range(3)]
    write_rollouts(store, cfg.run, 2, rows, PolicyPointer(2, f"policies/{cfg.run}/step-000002", "m"))
    newer = store.resolve(f"policies/{cfg.run}/step-000002")
    entry = ReplicaDeploy("standin-0", "3", 2.0, 1.0, False, "hot", "", 0.0, newer)

    with pytest.raises(RolloutsError, match=r"step-000001/policy\.json: field sampling: .*temperature"):
        read_policy_pointer(store, cfg.run, 1)
    assert deploy.recorded_replicas(store, cfg, (entry,), served.target)["standin-0"].target == newer
