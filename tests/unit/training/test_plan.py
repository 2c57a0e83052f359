"""The orchestrator's half of a training: plans only read; settling a plan is what touches MLflow."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.accounting.cost import DecodingCost, StepCost
from pipeline.config import PipelineConfig, load_config
from pipeline.data import order
from pipeline.data.acceptance_record import AcceptanceRecord, DrafterTau
from pipeline.data.buffer import write_buffer
from pipeline.data.buffer_record import BufferEntry
from pipeline.data.keys import acceptance_key, cost_key, drafter_key, policy_pointer_key, refresh_key
from pipeline.data.records import write_record
from pipeline.data.refresh_record import RefreshRecord
from pipeline.data.rollouts import PolicyPointer, Rollout, write_rollouts
from pipeline.data.store import ObjectStore, open_store
from pipeline.data.training_record import TrainingRecord
from pipeline.registry import DrafterRegistry, open_registry
from pipeline.stages import EVALUATION, EXTRACTION, TRAINING
from pipeline.training.outcome import TrainOutcome, outcome_metadata
from pipeline.training.plan import TrainJob, plan_training, read_history, settle_plan
from pipeline.training.schedule import AgedTau, aged_taus, median_decoding

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
    assert job.pipeline_config == cfg
    assert job.pipeline_config is job.pipeline_config  # parsed once, at its first use: the worker reads it often


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


def _committed(store: ObjectStore, cfg: PipelineConfig, step: int) -> None:
    rows = [Rollout(f"s{step}-{i}", [1, 2, 3, 4], [0, 0, 1, 1], 0.5, step) for i in range(3)]
    write_rollouts(store, cfg.run, step, rows, PolicyPointer(step, f"policies/{cfg.run}/x", "m"))
    write_buffer(store, cfg.run, step, [BufferEntry(step, f"s{step}-{i}", "part-00000.arrow", i, 4) for i in range(3)])


def _measured(store: ObjectStore, cfg: PipelineConfig, step: int, served: tuple[str, float] | None,
              cotrained: tuple[str, float] | None = None, promoted: bool = False) -> None:
    """The records a step's acceptance leaves: its drafters' taus and its cost entry (training took 30 s)."""
    def tau(measured: tuple[str, float] | None) -> DrafterTau | None:
        return DrafterTau(measured[0], measured[1], 0.5, (0.5,), 10, 40, 20, 3) if measured else None

    write_record(store, acceptance_key(cfg.run, step), AcceptanceRecord(
        step, step, 3, 4, 8, tau(cotrained), tau(served), None, tau(served), promoted, "",
        cotrained[0] if promoted else None))
    write_record(store, cost_key(cfg.run, step), StepCost(
        step, {EXTRACTION: 1.0, TRAINING: 30.0 if cotrained else 0.0, EVALUATION: 2.0}, 6,
        served[0] if served else None, served[1] if served else 1.0, DecodingCost(0.01, 0.05, 4)))


def test_the_acceptance_schedule_retrains_after_a_drift(step, tmp_path: Path) -> None:
    """v1 is promoted at step 1 with tau 3.4; the policy drifts at step 3, where v1 measures 2.9: step 4 retrains."""
    cfg, store, registry = step
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"schedule": cfg.train.schedule.model_copy(update={"kind": "acceptance", "tau_drop": 0.3})})})
    version, _ = _register(registry, "first", tmp_path)
    registry.set_alias("champion", version)
    _measured(store, cfg, 1, None, (version, 3.4), promoted=True)
    decisions = {}
    for s, served_tau in ((2, 3.3), (3, 2.9), (4, None)):
        _committed(store, cfg, s)
        decisions[s] = plan_training(store, cfg, s, registry)
        if served_tau is not None:
            _measured(store, cfg, s, (version, served_tau))
    assert not decisions[2].train  # nothing measured since the promotion
    assert not decisions[3].train  # step 2: 3.3, a fall of 0.1
    assert decisions[3].reason == (f"champion v{version} evaluated tau 3.300 at step 2 fell 0.100 since its "
                                   "promotion (3.400), within train.schedule.tau_drop=0.3")
    assert decisions[4].train  # step 3, after the drift: 2.9, a fall of 0.5
    assert decisions[4].reason.startswith(f"champion v{version} evaluated tau 2.900 at step 3 fell 0.500")


def test_the_acceptance_schedule_takes_the_fleets_live_tau_when_it_runs_the_champion(step, tmp_path: Path) -> None:
    """Evaluated at step 2, v1 fell 0.1 only; the fleet serving step 3's policy counts tau 2.9: step 3 retrains.
    Live tau of another version is not the champion's; below fleet.live_tau_floor the champion retrains too."""
    cfg, store, registry = step
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"schedule": cfg.train.schedule.model_copy(update={"kind": "acceptance", "tau_drop": 0.3})})})
    version, _ = _register(registry, "first", tmp_path)
    registry.set_alias("champion", version)
    _measured(store, cfg, 1, None, (version, 3.4), promoted=True)
    _committed(store, cfg, 2)
    _measured(store, cfg, 2, (version, 3.3))
    _committed(store, cfg, 3)
    assert not plan_training(store, cfg, 3, registry).train  # evaluated: 3.3
    assert not plan_training(store, cfg, 3, registry, live_tau={"99": 2.0}.get).train  # not the champion's
    live = plan_training(store, cfg, 3, registry, live_tau={version: 2.9}.get)
    assert live.train
    assert live.reason.startswith(f"champion v{version} live tau 2.900 at step 3 fell 0.500 since its promotion")
    floor = cfg.model_copy(update={"fleet": cfg.fleet.model_copy(update={"live_tau_floor": 3.35})})
    below = plan_training(store, floor, 3, registry, live_tau={version: 3.3}.get)
    assert below.train  # a fall of 0.1, within tau_drop, but under the floor
    assert "below fleet.live_tau_floor=3.35" in below.reason


def test_the_cost_schedule_weighs_the_expected_gain_against_the_last_trainings(step, tmp_path: Path) -> None:
    """v1 measured 3.4 on its own step and 2.9 one step on, beside v2 at 3.4 on its own step 2: drafters keep
    1.9 / 2.4 of their excess tau per step, read from the records. Step 3's 6 response tokens can never pay for
    a 30 s training: no interval up to the longest weighed makes it pay."""
    cfg, store, registry = step
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"schedule": cfg.train.schedule.model_copy(update={"kind": "cost"})})})
    version, _ = _register(registry, "first", tmp_path)
    registry.set_alias("champion", version)
    _measured(store, cfg, 1, None, (version, 3.4), promoted=True)
    _committed(store, cfg, 2)
    _measured(store, cfg, 2, (version, 2.9), ("99", 3.4))  # v2 (version 99) trained, not promoted
    _committed(store, cfg, 3)
    decision = plan_training(store, cfg, 3, registry)
    assert not decision.train
    assert decision.reason.startswith(f"keeping champion v{version} (evaluated tau 2.900 at step 2, expected 2.191 "
                                      "on step 4)")
    assert ("drafters keep 0.79 of their excess tau per step, 1 same-step pairs) on 6 tokens per step <="
            in decision.reason)
    assert "the training (30.0 s) and its staleness at the best interval of 50 chance(s)" in decision.reason


def test_a_newer_committed_step_supersedes_a_waiting_training(step) -> None:
    cfg, store, registry = step
    _committed(store, cfg, 2)
    waiting = plan_training(store, cfg, STEP, registry, coalesce=True)
    assert not waiting.train
    assert waiting.reason == "superseded: step 2 was committed while this step waited, and trains on the newer buffer"
    assert plan_training(store, cfg, STEP, registry).train  # a backfill's run does not coalesce
    assert plan_training(store, cfg, 2, registry, coalesce=True).train  # the newest step trains


def _drafters(store: ObjectStore, cfg: PipelineConfig, step: int, **roles: tuple[str, float]) -> None:
    def tau(measured: tuple[str, float] | None) -> DrafterTau | None:
        return DrafterTau(measured[0], measured[1], 0.5, (0.5,), 10, 40, 20, 3) if measured else None

    write_record(store, acceptance_key(cfg.run, step), AcceptanceRecord(
        step, step, 3, 4, 8, *(tau(roles.get(r)) for r in ("cotrained", "served", "baseline", "champion")),
        False, "", None))


def test_drafters_are_aged_from_the_step_they_trained_on(tmp_path: Path) -> None:
    """v1 trained at step 1 (its training record), v2 at step 2, v3 a refresh of step 3 (on its first parts): every
    drafter measured on the recent steps counts with its age there, the newly promoted ones included, so the
    staleness is known the step after a promotion."""
    cfg = load_config(overrides={"data_dir": str(tmp_path)})
    store = open_store(cfg)
    for step, version in ((1, "1"), (2, "2")):
        write_record(store, drafter_key(cfg.run, step), TrainingRecord(step, True, "", 3, "r", version, None,
                                                                       (step - 1, step) if step > 1 else (1,)))
    write_record(store, drafter_key(cfg.run, 3), TrainingRecord(3, False, "kept", 3))
    write_record(store, refresh_key(cfg.run, 3), RefreshRecord(3, 4, (0, 1, 2, 3, 4), 40, 0.0, "3", "2", 2.9, 2.6,
                                                               True, "beats the champion"))
    _drafters(store, cfg, 1, cotrained=("1", 3.0), baseline=("1", 3.0))
    _drafters(store, cfg, 2, cotrained=("2", 3.2), served=("1", 2.4), baseline=("1", 2.4))
    # no training at step 3: the co-trained drafter is still v2, measured once
    _drafters(store, cfg, 3, cotrained=("2", 2.7), served=("2", 2.7), baseline=("1", 1.9), champion=("2", 2.7))
    _drafters(store, cfg, 4, cotrained=("2", 2.4), served=("3", 2.8), baseline=("1", 1.7), champion=("2", 2.4))
    taus = aged_taus(read_history(store, cfg.run, [1, 2, 3, 4]), [2, 3, 4])
    assert sorted(taus, key=lambda t: (t.step, t.version)) == [
        AgedTau("1", 2, 1, 2.4), AgedTau("2", 2, 0, 3.2),
        AgedTau("1", 3, 2, 1.9), AgedTau("2", 3, 1, 2.7),  # in three roles, one measurement
        AgedTau("1", 4, 3, 1.7), AgedTau("2", 4, 2, 2.4), AgedTau("3", 4, 1, 2.8)]


def test_one_timing_on_a_loaded_machine_does_not_move_the_price() -> None:
    timings = [DecodingCost(3e-4, 0.45, 4), DecodingCost(8e-3, 0.45, 4), DecodingCost(2.3e-4, 0.37, 4)]
    assert median_decoding(timings) == DecodingCost(3e-4, 0.45, 4)
    assert median_decoding([]) is None


def _commit_at(store: ObjectStore, cfg: PipelineConfig, step: int, at: float) -> None:
    """Step `step` committed, its commit point seen by the store at `at` (epoch seconds)."""
    _committed(store, cfg, step)
    os.utime(store.local_path(policy_pointer_key(cfg.run, step)), (at, at))


@pytest.mark.reliability("bad_input", "a step numbered 10**12 committed first: later ordinary steps are neither "
                                      "superseded by it nor served behind it (order by commit time)")
def test_a_step_number_chosen_by_the_trainer_orders_nothing(step) -> None:
    """Step 10**12 is committed first, then steps 2 and 3: the store's commit times decide which is newer, so
    step 2 waits for step 3 (not for 10**12), step 3 trains, and the fleet serves step 3's policy."""
    cfg, store, registry = step
    huge = 10**12
    for number, at in ((STEP, 1000.0), (huge, 2000.0), (2, 3000.0), (3, 4000.0)):
        _commit_at(store, cfg, number, at)
    assert order.commit_order(store, cfg.run) == [STEP, huge, 2, 3]

    assert plan_training(store, cfg, 3, registry, coalesce=True).train
    assert plan_training(store, cfg, 2, registry, coalesce=True).reason.startswith("superseded: step 3 was committed")
    assert plan_training(store, cfg, huge, registry, coalesce=True).reason.startswith("superseded: step 3 was")
    assert order.newest_committed(store, cfg.run) == 3  # the policy the fleet serves (deploy.served_policy)
