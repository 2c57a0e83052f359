"""Extraction and evaluation as launched stages: their workers started through Dagster Pipes by the
`hidden_states` and `acceptance` assets, on one rank and on two gloo ranks (torchrun), against the
same stages run in this process; a rank killed mid-way; warm stage workers against fresh processes, a
warm worker killed mid-job, a Dagster step killed under one; the run process's imports; each stage's pod."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import kubernetes
import pytest
import torch
import yaml
from dagster_k8s.pipes import build_pod_body

from assets.cotraining import acceptance, hidden_states
from pipeline.accounting.cost import read_cost
from pipeline.config import PROJECT_ROOT, load_config
from pipeline.data import shard_format, shards
from pipeline.data.acceptance_record import read_acceptance
from pipeline.data.keys import drafter_key, hidden_states_prefix, placement_key
from pipeline.data.lease import LEASE_FILE
from pipeline.data.records import write_record
from pipeline.data.rollouts import read_policy_pointer
from pipeline.data.store import open_store
from pipeline.data.training_record import TrainingRecord
from pipeline.evaluation import acceptance as acceptance_lib
from pipeline.launch import process as launch
from pipeline.launch.warm import server_files
from pipeline.models import target as target_lib
from pipeline.models.checkpoint import save_drafter
from pipeline.models.drafter import fresh_drafter
from pipeline.registry import open_registry
from pipeline.serving.drivers import running
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from pipeline.stages import EVALUATION, EXTRACTION, LAUNCHED, Stage
from resources import pipeline_resource
from tests.support.config import write_config
from tests.support.processes import wait_until

STEP, KEY = 1, "step-000001"
WORKER_FAULTS = Path(__file__).resolve().parent.parent / "support" / "worker_faults"
DEPLOY = PROJECT_ROOT / "deploy"


def _variant(config_path: Path, name: str, overrides: dict) -> Path:
    data = yaml.safe_load(config_path.read_text())
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values}
    path = config_path.with_name(name)
    path.write_text(yaml.safe_dump(data))
    return path


def _materialize(asset: dg.AssetsDefinition, config_path: Path, instance: dg.DagsterInstance):
    return dg.materialize([asset], partition_key=KEY, resources={"pipeline": pipeline_resource(str(config_path))},
                          instance=instance, raise_on_error=False)


def _shard_bytes(store, cfg, manifest: shard_format.Manifest) -> list[bytes]:
    prefix = hidden_states_prefix(cfg.run, STEP)
    return [store.read_bytes(f"{prefix}/{s.name}") for s in manifest.shards]


def _step_files(store, cfg) -> set[str]:
    return {k for k, _, _ in store.list_files(hidden_states_prefix(cfg.run, STEP))}


def _failure(result) -> str:
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    return failure.step_failure_data.error.to_string()


def _server_pids(cfg, stage: str) -> list[int]:
    """The pids of every warm worker of `stage` started in the config's warm folder, in start order (from their
    logs)."""
    pids = []
    for log in sorted(cfg.warm_path.glob(f"{stage}-*.log"), key=lambda p: p.stat().st_mtime):
        pids += [int(line.split(" pid ")[1].split()[0]) for line in log.read_text().splitlines()
                 if line.startswith(f"stage server {stage} pid ")]
    return pids


@pytest.mark.slow
@pytest.mark.reliability("fault", "a rank of a two-rank extraction SIGKILLed after its first shard, then a rerun")
def test_extraction_on_two_ranks_writes_one_process_shards_and_a_killed_rank_commits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Pipes: two gloo ranks with rank 1 killed as it starts its second shard (the stage fails, no
    manifest), the rerun on two ranks, one rank; then the one-process function in this process. Every run
    commits byte-identical shards and the same content digest; the killed rank's shard is swept."""
    base = write_config(tmp_path, {"simulation": {"rollouts_per_step": 48},
                                   "hidden_states": {"samples_per_shard": 5, "tokens_per_batch": 64}})
    two = _variant(base, "two.yaml", {"launch": {"extraction": {"nproc": 2}}})
    cfg = load_config(base)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
    digests, shard_bytes = {}, {}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        with monkeypatch.context() as faults:
            faults.setenv("PYTHONPATH", f"{WORKER_FAULTS}:{PROJECT_ROOT}")
            faults.setenv("DRAFTER_TEST_KILL_RANK", "1")
            killed = _materialize(hidden_states, two, instance)
        assert not killed.success
        assert not shards.has_manifest(store, cfg.run, STEP)
        left = [k.rsplit("/", 1)[-1] for k, _, _ in store.list_files(hidden_states_prefix(cfg.run, STEP))]
        assert any(name.startswith("part-00001-") for name in left)  # rank 1's first shard, named by no manifest

        for name, path in {"two": two, "one": base}.items():
            result = _materialize(hidden_states, path, instance)
            assert result.success, name
            metadata = result.asset_materializations_for_node("hidden_states")[0].metadata
            assert (metadata["ranks"].value, metadata["ran_in"].value) == ({"two": 2, "one": 1}[name], "process")
            assert metadata["peak_memory_gb"].value > 0
            assert metadata["stage_seconds"].value > 0
            assert all(c.passed for c in result.get_asset_check_evaluations())
            manifest = shards.read_manifest(store, cfg.run, STEP)
            assert metadata["content_digest"].value == manifest.content_digest()
            digests[name], shard_bytes[name] = manifest.content_digest(), _shard_bytes(store, cfg, manifest)
    manifest = extract.extract_hidden_states(store, cfg, STEP)  # the function the worker runs, in this process
    digests["in-process"], shard_bytes["in-process"] = manifest.content_digest(), _shard_bytes(store, cfg, manifest)

    assert len(manifest.shards) >= 4  # both ranks had shards to write
    assert digests["two"] == digests["one"] == digests["in-process"]
    assert shard_bytes["two"] == shard_bytes["one"] == shard_bytes["in-process"]
    left = {k.rsplit("/", 1)[-1] for k, _, _ in store.list_files(hidden_states_prefix(cfg.run, STEP))}
    assert left - {LEASE_FILE} == {s.name for s in manifest.shards} | {shard_format.MANIFEST}


def _register_drafter(cfg) -> str:
    """A fresh drafter for the step's policy, registered as the step's training would register it."""
    store = open_store(cfg)
    pointer = read_policy_pointer(store, cfg.run, STEP)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, "cpu", target_lib.load_settings(cfg))
    registry = open_registry(cfg)
    run_id = registry.start_run("drafter-step-000001", {"rl_step": "1"})
    drafter = fresh_drafter(cfg.drafter, target, torch.ones(target.config.vocab_size), seed=0)
    version = registry.register(run_id, save_drafter(drafter, cfg.data_path / "d"),
                                {"rl_step": "1", "input_id": "stages-test"}, identity="input_id")
    registry.end_run(run_id)
    write_record(store, drafter_key(cfg.run, STEP),
                 TrainingRecord(STEP, True, "test", 0, run_id, version, None, (STEP,)))
    return version


@pytest.mark.slow
def test_evaluation_on_two_ranks_measures_the_tau_of_one_process(tmp_path: Path) -> None:
    """34 held-out prompts in three decoding batches and three estimate passes: through Pipes on two gloo ranks
    and on one, then `measure_step` in this process. The same counts, so the same tau, to the last bit; the
    step's cost record carries where the evaluation ran."""
    base = write_config(tmp_path, {"simulation": {"rollouts_per_step": 96},
                                   "eval": {"num_prompts": 34, "held_out_fraction": 0.4, "max_new_tokens": 6}})
    two = _variant(base, "two.yaml", {"launch": {"evaluation": {"nproc": 2}}})
    cfg = load_config(base)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
    version = _register_drafter(cfg)
    measured = {}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        for name, path in {"two": two, "one": base}.items():
            result = _materialize(acceptance, path, instance)
            assert result.success, name
            metadata = result.asset_materializations_for_node("acceptance")[0].metadata
            assert (metadata["ranks"].value, metadata["ran_in"].value) == ({"two": 2, "one": 1}[name], "process")
            assert [c.passed for c in result.get_asset_check_evaluations()] == [True]
            measured[name] = read_acceptance(store, cfg.run, STEP).cotrained
            placements = read_cost(store, cfg.run, STEP).placements
            assert [(p.stage, p.ranks) for p in placements] == [(EVALUATION, {"two": 2, "one": 1}[name])]
    in_process = acceptance_lib.measure_step(store, cfg, STEP, open_registry(cfg), version).measured[version]

    assert measured["two"].prompts == 34
    assert measured["two"] == measured["one"] == in_process


@pytest.mark.slow
def test_warm_workers_write_the_shards_and_measure_the_tau_of_fresh_processes(tmp_path: Path) -> None:
    """The same step's extraction and evaluation through fresh processes (`launcher: subprocess`) and through
    warm workers (`launcher: warm`), each stage twice on one worker: byte-identical shards, the same content
    digest and the same counts, so the same tau, for the first job and the next."""
    warm = write_config(tmp_path, {"simulation": {"rollouts_per_step": 48},
                                   "hidden_states": {"samples_per_shard": 5, "tokens_per_batch": 64},
                                   "eval": {"num_prompts": 6, "held_out_fraction": 0.3, "max_new_tokens": 6},
                                   "launch": {"launcher": "warm", "warm_idle_s": 120.0, "warm_dir": ""}})
    fresh = _variant(warm, "fresh.yaml", {"launch": {"launcher": "subprocess"}})
    cfg = load_config(warm)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
    _register_drafter(cfg)
    shard_bytes, digests, measured = {}, {}, {}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        for name, path in [("fresh", fresh), ("warm-1", warm), ("warm-2", warm)]:
            extracted = _materialize(hidden_states, path, instance)
            assert extracted.success, name
            manifest = shards.read_manifest(store, cfg.run, STEP)
            metadata = extracted.asset_materializations_for_node("hidden_states")[0].metadata
            assert metadata["content_digest"].value == manifest.content_digest()
            assert metadata["ran_in"].value == "process"
            digests[name], shard_bytes[name] = manifest.content_digest(), _shard_bytes(store, cfg, manifest)
            evaluated = _materialize(acceptance, path, instance)
            assert evaluated.success, name
            assert [c.passed for c in evaluated.get_asset_check_evaluations()] == [True]
            measured[name] = read_acceptance(store, cfg.run, STEP).cotrained

    assert [len(_server_pids(cfg, stage)) for stage in ("extraction", "evaluation")] == [1, 1]  # one worker each
    assert digests["fresh"] == digests["warm-1"] == digests["warm-2"]
    assert shard_bytes["fresh"] == shard_bytes["warm-1"] == shard_bytes["warm-2"]
    assert measured["fresh"].prompts == 6
    assert measured["fresh"] == measured["warm-1"] == measured["warm-2"]


@pytest.mark.slow
@pytest.mark.reliability("fault", "the warm extraction worker SIGKILLed as it starts its second shard, then a rerun")
def test_a_warm_worker_killed_mid_job_fails_its_step_and_commits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step fails with an error naming the worker's death and its log; no manifest; the rerun starts a new
    worker and commits the content digest of this process's extraction."""
    path = write_config(tmp_path, {"simulation": {"rollouts_per_step": 48},
                                   "hidden_states": {"samples_per_shard": 5, "tokens_per_batch": 64},
                                   "launch": {"launcher": "warm", "warm_dir": ""}})
    cfg = load_config(path)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        with monkeypatch.context() as faults:
            faults.setenv("PYTHONPATH", f"{WORKER_FAULTS}:{PROJECT_ROOT}")
            faults.setenv("DRAFTER_TEST_KILL_SHARD", "1")
            killed = _materialize(hidden_states, path, instance)
        assert not killed.success
        error = _failure(killed)
        assert "the warm extraction worker died mid-job" in error
        assert "stage server extraction pid" in error  # the tail of its log
        assert not shards.has_manifest(store, cfg.run, STEP)
        assert not store.exists(placement_key(cfg.run, STEP, EXTRACTION))
        rerun = _materialize(hidden_states, path, instance)
        assert rerun.success
    (dead, new) = _server_pids(cfg, "extraction")
    assert not running(dead)
    assert running(new)
    committed = shards.read_manifest(store, cfg.run, STEP).content_digest()
    assert committed == extract.extract_hidden_states(store, cfg, STEP).content_digest()


@pytest.mark.slow
def test_a_worker_started_ahead_takes_the_first_job_and_its_probe_is_no_job(tmp_path: Path) -> None:
    """`StageLauncher.prestart` starts the extraction worker before any step (and finds it listening when asked
    again); the step's job then runs on that worker as its job 1: the prestart's connections were probes."""
    path = write_config(tmp_path, {"launch": {"launcher": "warm", "warm_idle_s": 60.0, "warm_dir": ""}})
    cfg = load_config(path)
    SimulatedRL(cfg.simulation, open_store(cfg), cfg.run, cfg.data_path / "cache").run_step(STEP)
    launcher = pipeline_resource(str(path)).launcher()
    with dg.instance_for_test() as instance:
        assert launcher.prestart([EXTRACTION]) == [EXTRACTION]
        (worker,) = _server_pids(cfg, "extraction")
        assert launcher.prestart([EXTRACTION]) == [EXTRACTION]  # listening already: probed, not started again
        instance.add_dynamic_partitions("rl_step", [KEY])
        assert _materialize(hidden_states, path, instance).success
        files = server_files(cfg.warm_path, EXTRACTION, PROJECT_ROOT)
    assert _server_pids(cfg, "extraction") == [worker]
    jobs = [line for line in files.log.read_text().splitlines() if line.startswith("job ")]
    assert len(jobs) == 1
    assert jobs[0].startswith("job 1: ok")
    subprocess_launcher = pipeline_resource(str(_variant(path, "fresh.yaml", {"launch": {"launcher": "subprocess"}})))
    assert subprocess_launcher.launcher().prestart([EXTRACTION]) == []  # a process per step: nothing to start


STEP_PROCESS = """
import sys
import dagster as dg
from assets.cotraining import hidden_states
from resources import pipeline_resource
with dg.instance_for_test() as instance:
    instance.add_dynamic_partitions("rl_step", ["step-000001"])
    dg.materialize([hidden_states], partition_key="step-000001", instance=instance,
                   resources={"pipeline": pipeline_resource(sys.argv[1])})
"""


@pytest.mark.slow
@pytest.mark.reliability("fault", "a Dagster step SIGKILLed while its warm extraction worker writes shards")
def test_a_warm_worker_stops_with_its_killed_step_and_leaves_when_idle(tmp_path: Path) -> None:
    """A Dagster step in a process of its own, SIGKILLed once the first shard is written: its warm worker exits
    at once and nothing more is written (no shard, no manifest, no placement record). A worker idle for
    `launch.warm_idle_s` exits by itself and removes its socket."""
    path = write_config(tmp_path, {"simulation": {"rollouts_per_step": 48},
                                   "hidden_states": {"samples_per_shard": 5, "tokens_per_batch": 64},
                                   "launch": {"launcher": "warm", "warm_idle_s": 3.0, "warm_dir": ""}})
    cfg = load_config(path)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
    env = {**os.environ, "PYTHONPATH": f"{WORKER_FAULTS}:{PROJECT_ROOT}", "DRAFTER_TEST_SLOW_SHARDS": "3"}
    step = subprocess.Popen([sys.executable, "-c", STEP_PROCESS, str(path)], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: any(k.endswith(".arrow") for k in _step_files(store, cfg)), 300, "a first shard")
    finally:
        step.kill()
        step.wait()
    (worker,) = _server_pids(cfg, "extraction")
    wait_until(lambda: not running(worker), 10, "the worker's exit")
    left = _step_files(store, cfg)
    time.sleep(4)  # longer than a shard's write
    assert _step_files(store, cfg) == left
    assert not shards.has_manifest(store, cfg.run, STEP)
    assert not store.exists(placement_key(cfg.run, STEP, EXTRACTION))

    with dg.instance_for_test() as instance:  # a job on a new worker (this process's environment), then idle
        instance.add_dynamic_partitions("rl_step", [KEY])
        assert _materialize(hidden_states, path, instance).success
        files = server_files(cfg.warm_path, EXTRACTION, PROJECT_ROOT)
    (_, idle) = _server_pids(cfg, "extraction")
    wait_until(lambda: not running(idle), 3 + 30, "the idle worker's exit")
    assert not files.socket.exists()
    assert files.log.read_text().splitlines()[-1] == "idle for 3.0 s after 1 job(s): exiting"


def test_the_run_process_imports_no_model_code_for_the_stages() -> None:
    """The code location and the assets' run-side modules (the warm protocol's launcher end too), imported in a
    fresh interpreter: no policy forward, drafter, decoding or extraction module, no stage worker and no warm
    worker's job runner comes in (those run in the stages' own processes only)."""
    probe = ("import sys, definitions, assets.cotraining, assets.fleet, resources.launcher, resources.warm; "
             "print('\\n'.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, check=True, capture_output=True,
                                text=True).stdout.split())
    forbidden = {"pipeline.sources.extract", "pipeline.evaluation.speculative", "pipeline.evaluation.teacher_forced",
                 "pipeline.evaluation.acceptance", "pipeline.models.target", "pipeline.models.target_forward",
                 "pipeline.models.drafter", "pipeline.models.eagle", "pipeline.models.eagle3",
                 "pipeline.models.peagle", "pipeline.models.checkpoint", "pipeline.sources.simulation",
                 "pipeline.training.loop", "transformers.models.llama.modeling_llama",
                 "pipeline.launch.worker", *(s.worker for s in LAUNCHED)}  # a warm worker's jobs: its own process too
    assert loaded & forbidden == set()
    assert "pipeline.launch.process" in loaded  # the stages are launched from there


@pytest.mark.parametrize("stage", [EXTRACTION, EVALUATION], ids=str)
def test_each_stage_pod_is_the_stage_worker_with_its_own_resources(stage: Stage) -> None:
    """deploy/pipeline.yaml's pod of each stage, as data: the project's image, the stage's worker under torchrun,
    one GPU per rank and the stage's own memory, secrets only by reference."""
    cfg = load_config(DEPLOY / "pipeline.yaml", {"hidden_states": {"source": "forward"},
                                                 "launch": {"extraction": {"nproc": 2, "memory": "200Gi"},
                                                            "evaluation": {"nproc": 4, "memory": "300Gi"}}})
    spec = launch.stage_pod_spec(cfg, stage)
    (container,) = spec["containers"]
    ranks, memory = {EXTRACTION: (2, "200Gi"), EVALUATION: (4, "300Gi")}[stage]
    assert container["image"] == cfg.launch.k8s.image
    assert container["command"] == ["python", "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc-per-node={ranks}", "-m", stage.worker]
    assert container["resources"]["limits"] == container["resources"]["requests"] == {
        "cpu": cfg.launch.of(stage).cpu, "memory": memory,
        cfg.launch.k8s.gpu_resource: str(ranks)}
    assert container["envFrom"] == [{"secretRef": {"name": cfg.launch.k8s.env_secret}}]
    assert "env" not in container  # no value inline: PipesK8sClient adds only its bootstrap variables
    assert spec["restartPolicy"] == "Never"
    assert spec["nodeSelector"] == cfg.launch.k8s.node_selector
    assert launch.pod_labels(cfg, stage, 7)["drafter-cotraining/stage"] == stage.name
    # What PipesK8sClient.run submits: dagster-k8s merges the spec with the Pipes bootstrap environment into the
    # kubernetes client's V1Pod (unknown fields are refused).
    pod = build_pod_body(pod_name=f"dagster-{stage}-abc123", image=None, command=None,
                         env_vars={"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msg"},
                         base_pod_meta={"labels": launch.pod_labels(cfg, stage, 7)}, base_pod_spec=spec)
    assert isinstance(pod, kubernetes.client.V1Pod)
    assert {e.name for e in pod.spec.containers[0].env} == {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES"}
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert mounts == ["/dev/shm", *(["/shared/hidden_states"] if stage == EXTRACTION else [])]
    one = load_config(DEPLOY / "pipeline.yaml")
    assert launch.stage_pod_spec(one, stage)["containers"][0]["command"] == ["python", "-m", stage.worker]
    split = load_config(DEPLOY / "pipeline.yaml", {"target": {"split": "layers", "split_devices": 4}})
    limits = launch.stage_pod_spec(split, stage)["containers"][0]["resources"]["limits"]
    assert limits[cfg.launch.k8s.gpu_resource] == "4"  # one rank, its policy split over a block of 4 GPUs


@pytest.mark.parametrize(("overrides", "message"), [
    ({"launch": {"extraction": {"nproc": 0}}}, "launch.extraction.nproc"),
    ({"launch": {"evaluation": {"memory": "lots"}}}, "launch.evaluation.memory"),
    ({"launch": {"extraction": {"nproc": 2}},
      "hidden_states": {"source": "vllm", "vllm_path": "/x", "vllm_layer_ids": [1]}}, "launch.extraction.nproc is 2"),
    ({"launch": {"evaluation": {"nproc": 2}}, "device": "mps"}, "launch.extraction.nproc / launch.evaluation.nproc"),
])
def test_stage_ranks_are_validated_with_the_key_named(overrides: dict, message: str) -> None:
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
