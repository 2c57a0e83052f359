"""A trainer that never waits: steps committed faster than the drafter trains are coalesced, and the
lag and cost of every step are read back from the pipeline's own records."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from definitions import build_definitions
from demo.daemon import SensorTicks, pipeline_tick
from jobs.sensors import champion_sensor
from pipeline.accounting.cost import read_cost
from pipeline.accounting.ledger import read_ledger
from pipeline.config import load_config
from pipeline.data.fleet_state import read_fleet_state
from pipeline.data.rollouts import published_at
from pipeline.data.store import open_store
from pipeline.data.training_record import read_training
from pipeline.registry import DrafterRegistry
from pipeline.serving import deploy
from pipeline.sources.simulation import SimulatedRL
from pipeline.stages import DEPLOYMENT, EVALUATION, EXTRACTION, TRAINING
from tests.support.config import write_config


@pytest.mark.slow
def test_steps_published_faster_than_training_are_coalesced(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    cfg = load_config(config)
    store = open_store(cfg)
    source = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    defs = build_definitions(str(config))
    try:
        with dg.instance_for_test() as instance:
            ticks = SensorTicks(instance, defs)
            source.run_step(1)
            assert pipeline_tick(ticks, True, lambda _: None)  # step 1 trains v1; v1 is deployed
            # The trainer publishes steps 2 and 3 while the pipeline was busy: one tick sees both.
            source.run_step(2)
            source.run_step(3)
            assert pipeline_tick(ticks, True, lambda _: None)
            # v2 (step 3's) reaches the fleet whatever its tau: a person promotes it in the MLflow UI if need be.
            DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name).set_alias("champion", "2")
            ticks.tick(champion_sensor, "deploy_job", lambda _: None)
            runs = instance.get_runs(dg.RunsFilter(job_name="rl_step_job"))
            assert sorted(r.tags["dagster/run_key"] for r in runs) == ["step-000001", "step-000002", "step-000003"]
            assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)  # no step lost

            trainings = {s: read_training(store, cfg.run, s) for s in (1, 2, 3)}
            assert trainings[1].trained
            assert trainings[3].trained
            assert not trainings[2].trained
            assert trainings[2].reason.startswith("superseded: step 3 was committed")
            assert trainings[3].trained_on_steps == (2, 3)  # step 2's hidden states are in step 3's buffer

            # Lag, from the fleet's history and the steps' commit times: v1 served steps 2 and 3.
            history = read_fleet_state(store, cfg.run).history
            assert [d.version for d in history] == ["1", "2"]
            ledger = read_ledger(store, cfg.run, [1, 2, 3])
            lags = {lag.step: lag for lag in ledger.lags}
            assert lags[1].served_version is None
            assert (lags[2].served_version, lags[2].lag_steps) == ("1", 1)
            assert (lags[3].served_version, lags[3].lag_steps) == ("1", 2)
            v2_live = history[1].live_at
            assert lags[3].lag_s == pytest.approx(v2_live - published_at(store, cfg.run, 3), abs=1e-3)
            assert lags[2].lag_s == pytest.approx(v2_live - published_at(store, cfg.run, 2), abs=1e-3)

            # The ledger: training seconds only where a training ran, deployments on the step that trained
            costs = {c.step: c for c in ledger.costs}
            assert costs[1].seconds[TRAINING] > 0
            assert costs[3].seconds[TRAINING] > 0
            assert costs[2].seconds[TRAINING] == 0
            assert costs[1].seconds[DEPLOYMENT] == pytest.approx(history[0].deploy_s)
            assert costs[3].seconds[DEPLOYMENT] == pytest.approx(history[1].deploy_s)
            assert all(c.seconds[EXTRACTION] > 0 and c.seconds[EVALUATION] > 0 for c in costs.values())
            assert costs[1].saved_s == 0.0  # nothing served step 1
            assert costs[2].served_version == "1"
            assert read_cost(store, cfg.run, 2).decoding is not None
            assert ledger.totals.spent_s == pytest.approx(sum(sum(c.seconds.values()) for c in costs.values()))
    finally:
        deploy.make_driver(cfg).stop_all(deploy.replicas(cfg))


@pytest.mark.slow
def test_a_backfill_trains_every_step_in_order(tmp_path: Path) -> None:
    """Runs tagged as a backfill's are not coalesced: steps 1 and 2 train although step 3 is committed."""
    config = write_config(tmp_path, {"fleet": {"driver": "none"}})
    cfg = load_config(config)
    store = open_store(cfg)
    source = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    for step in (1, 2, 3):
        source.run_step(step)
    defs = build_definitions(str(config))
    job = defs.resolve_job_def("rl_step_job")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", ["step-000001", "step-000002", "step-000003"])
        for step in (1, 2):
            result = job.execute_in_process(instance=instance, partition_key=f"step-{step:06d}",
                                            tags={"dagster/backfill": "abcdefgh"})
            assert result.success
    trainings = [read_training(store, cfg.run, s) for s in (1, 2)]
    assert [t.trained for t in trainings] == [True, True]
    assert [t.version for t in trainings] == ["1", "2"]
