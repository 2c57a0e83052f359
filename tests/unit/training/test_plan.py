"""The orchestrator's half of a training: plans only read; settling a plan is what touches MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import PipelineConfig, load_config
from pipeline.data.buffer import write_buffer
from pipeline.data.records import BufferEntry
from pipeline.data.rollouts import PolicyPointer, Rollout, write_rollouts
from pipeline.data.store import ObjectStore, open_store
from pipeline.registry import DrafterRegistry, open_registry
from pipeline.training.outcome import TrainOutcome, outcome_metadata
from pipeline.training.plan import TrainJob, plan_training, settle_plan

STEP = 1
RETRAIN = "live tau 1.20 < fleet.live_tau_floor 1.5"


@pytest.fixture
def step(tmp_path: Path) -> tuple[PipelineConfig, ObjectStore, DrafterRegistry]:
    """A committed step whose buffer holds three samples, and an empty registry."""
    cfg = load_config(overrides={"data_dir": str(tmp_path), "train": {"min_samples": 3}})
    store = open_store(cfg)
    rows = [Rollout(f"s{i}", [1, 2, 3, 4], [0, 0, 1, 1], 0.5, STEP) for i in range(3)]
    write_rollouts(store, cfg.run, STEP, rows, PolicyPointer(STEP, f"policies/{cfg.run}/x", "m"))
    write_buffer(store, cfg.run, STEP, [BufferEntry(STEP, f"s{i}", "part-00000.arrow", i, 4) for i in range(3)])
    return cfg, store, open_registry(cfg)


def _register(registry: DrafterRegistry, input_id: str, tmp_path: Path, finish: bool = True) -> tuple[str, str]:
    """A version registered for `input_id`, as a training registers it; its run left open unless `finish`."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "config.json").write_text("{}")
    run_id = registry.start_run("drafter-step-000001", {"input_id": input_id})
    version = registry.register(run_id, checkpoint, {"input_id": input_id})
    if finish:
        registry.end_run(run_id, ok=True)
    return version, run_id


def test_a_requested_retraining_trains_where_a_rerun_reuses(step, tmp_path: Path) -> None:
    cfg, store, registry = step
    scheduled = plan_training(store, cfg, STEP, registry)
    version, _ = _register(registry, scheduled.input_id, tmp_path)

    rerun = plan_training(store, cfg, STEP, registry)
    assert rerun.existing is not None
    assert rerun.existing.version == version
    retrain = plan_training(store, cfg, STEP, registry, RETRAIN)
    assert retrain.existing is None  # the scheduled training's version is not what the request asked for
    assert retrain.input_id != scheduled.input_id
    job = settle_plan(retrain, cfg, registry, {})
    assert isinstance(job, TrainJob)
    assert job.requested_by == RETRAIN
    assert job.reason == f"requested ({RETRAIN}); buffer holds 3 samples"
    assert TrainJob.from_dict(job.to_dict()) == job


def test_planning_writes_nothing_settling_finishes_a_killed_attempt(step, tmp_path: Path) -> None:
    """An attempt killed after registering its version: the plan sees it, only settling finishes it."""
    cfg, store, registry = step
    identity = plan_training(store, cfg, STEP, registry).input_id
    version, run_id = _register(registry, identity, tmp_path, finish=False)

    plan = plan_training(store, cfg, STEP, registry)
    assert plan.existing is not None
    assert not plan.existing.run_finished
    assert not registry.run_finished(run_id)
    assert registry.alias_version("challenger") is None

    outcome = settle_plan(plan, cfg, registry, {})
    assert isinstance(outcome, TrainOutcome)
    assert (outcome.version, outcome.reason) == (version, f"reused version {version}, trained on identical inputs")
    assert registry.run_finished(run_id)
    assert registry.alias_version("challenger") == registry.alias_version("baseline") == version


def test_a_refused_request_says_what_was_requested(step) -> None:
    cfg, store, registry = step
    few = cfg.model_copy(update={"train": cfg.train.model_copy(update={"min_samples": 10})})
    outcome = settle_plan(plan_training(store, few, STEP, registry, RETRAIN), few, registry, {})
    assert isinstance(outcome, TrainOutcome)
    metadata = outcome_metadata(outcome)
    assert metadata["trained"] is False
    assert metadata["retrain_requested_by"] == RETRAIN
    assert "fewer than train.min_samples=10" in metadata["reason"]
