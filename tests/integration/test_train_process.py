"""The drafter asset's training process, launched as production launches it (Dagster Pipes
running torchrun): data parallel over two gloo ranks, and killed with SIGKILL then resumed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import torch
import yaml

from assets.cotraining import drafter
from pipeline.config import load_config
from pipeline.data import buffer as buffer_lib
from pipeline.data.store import open_store
from pipeline.data.training_record import read_training
from pipeline.registry import DrafterRegistry
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from pipeline.stages import TRAINING
from pipeline.training import plan as plan_lib
from resources import pipeline_resource
from tests.support.config import write_config

STEP, KEY = 1, "step-000001"


def _prepare_step(config_path: Path) -> None:
    """Rollouts, hidden states and the buffer of step 1, written by the pipeline's own code."""
    cfg = load_config(config_path)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
    extract.extract_hidden_states(store, cfg, STEP)
    buffer_lib.build_buffer(store, cfg.run, STEP, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)


def _materialize_drafter(config_path: Path, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    return dg.materialize([drafter], partition_key=KEY, resources={"pipeline": pipeline_resource(str(config_path))},
                          instance=instance, raise_on_error=False)


def _variant(config_path: Path, name: str, train: dict, training: dict | None = None) -> Path:
    """The config at `config_path` with `train` and `launch.training` settings over its own."""
    data = yaml.safe_load(config_path.read_text())
    data["train"] = {**data["train"], **train}
    launch = data.setdefault("launch", {})
    launch["training"] = {**launch.get("training", {}), **(training or {})}
    path = config_path.with_name(name)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_two_ranks_through_the_launcher_equal_one_process_and_two_loopback_nodes(tmp_path: Path) -> None:
    """torchrun --nproc-per-node=2 (gloo), 4 samples per rank, vs one process with the same 8-sample global
    batch, vs two torchrun nodes of one rank each, joined by a c10d rendezvous on loopback and sharding
    the drafter (FSDP2): the same steps, the same losses."""
    base = write_config(tmp_path, {"train": {"epochs": 2, "batch_size_per_gpu": 4, "checkpoint_every": 0},
                                   "launch": {"launcher": "subprocess"}})  # one rank: a process of its own too
    _prepare_step(base)
    variants = {
        "two": _variant(base, "two.yaml", {"parallelism": "ddp"}, {"nproc": 2}),
        "one": _variant(base, "one.yaml", {"batch_size_per_gpu": 8, "max_seq_len": 8192}, {"nproc": 1}),
        "nodes": _variant(base, "nodes.yaml", {"parallelism": "fsdp"}, {"nnodes": 2, "nproc": 1}),
    }
    store = open_store(load_config(base))
    records, metadata = {}, {}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        for name, path in variants.items():
            result = _materialize_drafter(path, instance)
            assert result.success, name
            metadata[name] = result.asset_materializations_for_node("drafter")[0].metadata
            records[name] = read_training(store, load_config(path).run, STEP).figures
    assert {name: m["world_size"].value for name, m in metadata.items()} == {"two": 2, "one": 1, "nodes": 2}
    assert {name: m["parallelism"].value for name, m in metadata.items()} == {
        "two": "ddp", "one": "single", "nodes": "fsdp"}
    assert "training_state_gb" in metadata["nodes"]
    # The demo's drafter is small: `train.fsdp_units: auto` gathers it whole once a step.
    assert metadata["nodes"]["fsdp_units"].value == "drafter"
    assert "fsdp_units" not in metadata["two"]
    assert records["two"].iterations == records["one"].iterations == records["nodes"].iterations >= 4
    torch.testing.assert_close(torch.tensor(records["two"].loss_history),
                               torch.tensor(records["one"].loss_history), rtol=2e-3, atol=1e-4)
    torch.testing.assert_close(torch.tensor(records["nodes"].loss_history),
                               torch.tensor(records["two"].loss_history), rtol=1e-5, atol=1e-6)


def _children(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def _training_ranks(warm_dir: Path | None = None) -> list[int]:
    """The training ranks below this process; with `warm_dir`, the warm training worker of that folder too."""
    ranks = []
    for pid in _children(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if TRAINING.worker.encode() in argv and b"torch.distributed.run" not in argv:
            ranks.append(pid)
        warm = b"pipeline.launch.warm" in argv and b"training" in argv
        if warm and warm_dir and any(a.startswith(str(warm_dir).encode()) for a in argv):  # its lock file
            ranks.append(pid)
    return ranks


@pytest.mark.slow
@pytest.mark.reliability("fault", "SIGKILL during training (its process, or its warm worker), then rerun resumes "
                                  "from its checkpoint")
@pytest.mark.parametrize("launcher", ["subprocess", "warm"])
def test_a_killed_training_resumes_from_its_checkpoint(tmp_path: Path, mlflow_server: str, launcher: str) -> None:
    name = f"kill-{tmp_path.name}"
    config_path = write_config(tmp_path, {
        "train": {"epochs": 12, "batch_size_per_gpu": 4, "checkpoint_every": 4},
        "launch": {"launcher": launcher, "warm_dir": ""},  # a warm training worker of its own, to kill
        "mlflow": {"tracking_uri": mlflow_server, "experiment": name, "model_name": name},
    })
    cfg = load_config(config_path)
    _prepare_step(config_path)
    store, prefix = open_store(cfg), Path(cfg.data_path / "store" / "training" / cfg.run)
    killed: list[int] = []

    def kill_after_first_checkpoint() -> None:
        deadline = time.monotonic() + 600
        while not list(prefix.glob("*/latest.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in _training_ranks(cfg.warm_path):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
        killer.start()
        first = _materialize_drafter(config_path, instance)
        killer.join()
        assert killed, "the training process was never seen"
        assert not first.success
        (pointer,) = prefix.glob("*/latest.json")
        checkpointed = json.loads(pointer.read_text())["iteration"]
        assert checkpointed % 4 == 0
        assert checkpointed > 0

        second = _materialize_drafter(config_path, instance)
        assert second.success
        metadata = second.asset_materializations_for_node("drafter")[0].metadata
        assert metadata["resumed_from_iteration"].value == checkpointed
        assert metadata["model_version"].value == "1"

    outcome = read_training(store, cfg.run, STEP)
    assert checkpointed < outcome.figures.iterations
    assert outcome.figures.resumed_from_iteration == checkpointed
    assert len(outcome.figures.loss_history) == outcome.figures.iterations
    assert not list(prefix.glob("*/latest.json"))  # checkpoints go once the version is registered
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    (run,) = registry.client.search_runs([registry.experiment_id])  # one run, continued
    assert run.info.status == "FINISHED"
    assert run.info.run_id == outcome.run_id
    assert [v.version for v in registry.client.search_model_versions(f"name = '{name}'")] == ["1"]
    # Metrics reach MLflow only with a committed checkpoint: each iteration is logged exactly once.
    history = registry.client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(outcome.figures.iterations))


def _torchrun_agents() -> list[int]:
    """The torchrun agents below this process, in start order."""
    agents = []
    for pid in _children(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"torch.distributed.run" in argv:
            agents.append(pid)
    return sorted(agents)


@pytest.mark.slow
@pytest.mark.reliability("fault", "a training node (torchrun agent) SIGKILLed mid-training: the run fails "
                                  "cleanly, the rerun resumes from its checkpoint")
def test_a_dead_node_fails_the_run_and_the_rerun_resumes(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, {
        "train": {"epochs": 4, "batch_size_per_gpu": 2, "checkpoint_every": 3},
        "launch": {"training": {"nnodes": 2, "nproc": 1}}})
    cfg = load_config(config_path)
    _prepare_step(config_path)
    prefix = Path(cfg.data_path / "store" / "training" / cfg.run)
    killed: list[int] = []

    def kill_a_node_after_the_first_checkpoint() -> None:
        deadline = time.monotonic() + 600
        while not list(prefix.glob("*/latest.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        agents = _torchrun_agents()
        if agents:
            os.kill(agents[-1], signal.SIGKILL)
            killed.append(agents[-1])

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", [KEY])
        killer = threading.Thread(target=kill_a_node_after_the_first_checkpoint, daemon=True)
        killer.start()
        started = time.monotonic()
        first = _materialize_drafter(config_path, instance)
        killer.join()
        assert killed, "no node was seen"
        assert not first.success
        assert time.monotonic() - started < 120  # failed, not hung on the dead peer
        assert not _training_ranks()  # nothing left running
        assert not _torchrun_agents()
        (pointer,) = prefix.glob("*/latest.json")
        checkpointed = json.loads(pointer.read_text())["iteration"]
        assert checkpointed > 0

        second = _materialize_drafter(config_path, instance)
        assert second.success
        assert second.asset_materializations_for_node("drafter")[0].metadata["resumed_from_iteration"].value \
            == checkpointed
    figures = read_training(open_store(cfg), cfg.run, STEP).figures
    assert figures.resumed_from_iteration == checkpointed < figures.iterations


def test_a_training_job_round_trips_as_json_and_names_what_is_missing(tiny_config_path: Path) -> None:
    cfg = load_config(tiny_config_path)
    job = plan_lib.TrainJob(3, cfg.model_dump(mode="json"), "run-1", "abc", "buffer holds 9 samples", None,
                           {"rl_step": "step-000003"})
    again = plan_lib.TrainJob.from_dict(json.loads(json.dumps(job.to_dict())))
    assert again == job
    assert again.pipeline_config == cfg  # the process rebuilds the very same config
    doc = job.to_dict()
    del doc["run_id"], doc["input_id"]
    with pytest.raises(ValueError, match="training job is missing input_id, run_id"):
        plan_lib.TrainJob.from_dict(doc)


def test_placement_settings_do_not_change_a_trainings_identity(tiny_config_path: Path) -> None:
    """Moving a training to a pod, or checkpointing more often, must still find its checkpoint and version."""
    cfg = load_config(tiny_config_path)
    moved = load_config(tiny_config_path, {"train": {"checkpoint_every": 7}, "launch": {"k8s": {"image": "x"}}})
    entries = [buffer_lib.BufferEntry(step=1, sample_id="a", shard="s", row=0, tokens=5)]
    assert plan_lib.input_identity(cfg, entries, "p") == plan_lib.input_identity(moved, entries, "p")
    wider = load_config(tiny_config_path, {"launch": {"training": {"nproc": 2}}})  # a different global batch
    assert plan_lib.input_identity(cfg, entries, "p") != plan_lib.input_identity(wider, entries, "p")
