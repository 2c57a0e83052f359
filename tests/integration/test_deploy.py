"""Promotion to serving through Dagster: the champion sensor, the deploy job, stand-in replicas, on the
production stack's Dagster instance (PostgreSQL) and MLflow server (PostgreSQL, artifacts on S3) of
tests/integration/test_postgres.py; a file of its own, so that it runs beside that file's daemon test.

The replicas are stand-in processes (`pipeline.serving.standin.replica`, not vLLM) on loopback ports.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import dagster as dg
import pytest

from definitions import build_definitions
from jobs.sensors import DEPLOY_SENSOR_NAME, champion_sensor, live_tau_sensor
from ops.local_stack import write_dagster_home
from pipeline.config import load_config
from pipeline.data.fleet_state import read_fleet_state
from pipeline.data.store import open_store
from pipeline.registry import DrafterRegistry
from pipeline.serving import deploy
from pipeline.serving.drivers import StandInDriver
from pipeline.sources.simulation import SimulatedRL
from tests.integration.test_postgres import Stack, _environ, stack  # noqa: F401  (the production stack fixture)
from tests.integration.test_s3 import s3_endpoint  # noqa: F401  (the moto server fixture)
from tests.support.config import write_config

pytestmark = pytest.mark.postgres


def _tick(defs: dg.Definitions, instance: dg.DagsterInstance, cursor: str | None):
    return champion_sensor(dg.build_sensor_context(instance=instance, cursor=cursor, sensor_name=DEPLOY_SENSOR_NAME,
                                                   definitions=defs, resources=defs.resources))


def _live(defs: dg.Definitions, instance: dg.DagsterInstance, cursor: str | None):
    return live_tau_sensor(dg.build_sensor_context(instance=instance, cursor=cursor, sensor_name="live_tau_sensor",
                                                   definitions=defs, resources=defs.resources))


def _complete(url: str, prompt: list[int], max_tokens: int) -> None:
    body = json.dumps({"model": "policy", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["choices"][0]["token_ids"]


def check_promotions_reach_the_fleet_once_each(tmp_path: Path, instance: dg.DagsterInstance, overrides: dict) -> None:
    """Promotions on `instance` with the config's MLflow server and object store given by `overrides`."""
    # A floor above any reachable tau, so that the live-tau sensor's retraining request shows; every round speculates
    # (a measured threshold may turn speculation off on a tiny target, and live tau counts speculative rounds only).
    path = write_config(tmp_path, {"promotion": {"policy": "manual"},
                                   "fleet": {"live_tau_floor": 4.9, "speculation_max_batch": 64}, **overrides,
                                   "mlflow": {**overrides["mlflow"], "model_name": "deploy-test-drafter"}},
                        replicas=2)
    cfg = load_config(path)
    store = open_store(cfg)
    simulator = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    defs = build_definitions(str(path))
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    try:
        # Step 1 trains version 1; with nothing to compare against, even the manual policy has no
        # champion: a person promotes it in the MLflow UI (here: the MLflow client).
        simulator.run_step(1)
        instance.add_dynamic_partitions("rl_step", ["step-000001"])
        assert defs.resolve_job_def("rl_step_job").execute_in_process(
            instance=instance, partition_key="step-000001").success
        assert isinstance(_tick(defs, instance, None), dg.SkipReason)
        registry.client.set_registered_model_alias(cfg.mlflow.model_name, "champion", "1")

        tick = _tick(defs, instance, None)
        assert [r.run_key for r in tick.run_requests] == [f"{cfg.mlflow.model_name}:1"]
        deploy_job = defs.resolve_job_def("deploy_job")
        assert deploy_job.execute_in_process(instance=instance, run_config=tick.run_requests[0].run_config).success
        assert isinstance(_tick(defs, instance, tick.cursor), dg.SkipReason)  # exactly once
        assert registry.alias_version("live") == "1"

        simulator.run_step(2)
        instance.add_dynamic_partitions("rl_step", ["step-000002"])
        assert defs.resolve_job_def("rl_step_job").execute_in_process(
            instance=instance, partition_key="step-000002").success
        assert registry.alias_version("champion") == "1"  # manual: the new version waits for a person
        registry.client.set_registered_model_alias(cfg.mlflow.model_name, "champion", "2")
        second = _tick(defs, instance, tick.cursor)
        assert [r.run_key for r in second.run_requests] == [f"{cfg.mlflow.model_name}:2"]
        run_config = second.run_requests[0].run_config
        assert deploy_job.execute_in_process(instance=instance, run_config=run_config).success

        md = instance.get_latest_materialization_event(dg.AssetKey("fleet")).asset_materialization.metadata
        assert md["version"].value == "2"
        assert md["mean_live_tau"].value >= 1.0

        # Live tau: the first tick sets the baseline, traffic flows, the next tick observes it.
        first = _live(defs, instance, None)
        assert first.run_requests == []
        for replica in deploy.replicas(cfg):
            _complete(replica.url, [1, 2, 3, 4], 12)
        observed = _live(defs, instance, first.cursor)
        taus = {k: v for k, v in observed.asset_events[0].metadata.items() if k.endswith("_live_tau")}
        assert sorted(taus) == ["standin-0_live_tau", "standin-1_live_tau"]
        assert all(1.0 <= float(getattr(v, "value", v)) <= 5.0 for v in taus.values())
        [retrain] = observed.run_requests
        assert retrain.partition_key == "step-000002"
        assert retrain.run_key == "retrain:step-000002"
        assert "< fleet.live_tau_floor 4.9" in retrain.tags["retrain_reason"]
        # The request retrains: the step's scheduled training (version 2) is not reused.
        assert defs.resolve_job_def("rl_step_job").execute_in_process(
            instance=instance, partition_key=retrain.partition_key, tags=retrain.tags,
            asset_selection=retrain.asset_selection).success
        md = instance.get_latest_materialization_event(dg.AssetKey("drafter")).asset_materialization.metadata
        assert (md["trained"].value, md["model_version"].value) == (True, "3")
        assert md["retrain_requested_by"].value == retrain.tags["retrain_reason"]
        assert md["reason"].value.startswith(f"requested ({retrain.tags['retrain_reason']})")
        state = read_fleet_state(store, cfg.run)
        assert state.version == "2"
        assert [r.replica for r in state.replicas] == ["standin-0", "standin-1"]
        # Step 2 brought a new policy: sent in place with the drafter (both on local disk), no restart.
        assert [(r.update, r.note, r.restarted) for r in state.replicas] == [
            ("hot", "the new policy and the drafter sent in place", False)] * 2
        assert all(r.target.endswith("step-000002") for r in state.replicas)
        assert registry.alias_version("live") == "2"
        for replica in deploy.replicas(cfg):  # both serve after the second rollout
            with urllib.request.urlopen(f"{replica.url}/v1/models", timeout=10) as response:
                assert json.loads(response.read())["data"][0]["id"] == "policy"

        # Version 3, trained on the same policy, reaches the running replicas in place (vLLM's dev-mode routes).
        pids = [(cfg.data_path / "fleet" / "replicas" / f"{r.name}.pid").read_text() for r in deploy.replicas(cfg)]
        assert deploy_job.execute_in_process(instance=instance, run_config={
            "ops": {"fleet": {"config": {"version": "3"}}}}).success
        state = read_fleet_state(store, cfg.run)
        assert (state.version, [h.version for h in state.history]) == ("3", ["1", "2", "3"])
        assert [(r.version, r.update, r.restarted) for r in state.replicas] == [("3", "hot", False)] * 2
        assert [(cfg.data_path / "fleet" / "replicas" / f"{r.name}.pid").read_text()
                for r in deploy.replicas(cfg)] == pids
        for replica in deploy.replicas(cfg):
            with urllib.request.urlopen(f"{replica.url}/weight_info", timeout=10) as response:
                assert json.loads(response.read()) == {"weight_version": "drafter-v3"}
        md = instance.get_latest_materialization_event(dg.AssetKey("fleet")).asset_materialization.metadata
        assert (md["hot_updated"].value, md["restarted"].value) == (2, 0)
    finally:
        StandInDriver(4, cfg.data_path / "fleet" / "replicas").stop_all(deploy.replicas(cfg))


@pytest.mark.slow
def test_promotions_reach_the_fleet_on_postgres_and_s3(stack: Stack, tmp_path: Path) -> None:  # noqa: F811
    """The champion sensor redeploying, a manual alias change in the MLflow client driving exactly one deploy:
    the Dagster instance and the MLflow server of the production stack. The object store stays a local
    directory: a stand-in replica reads its target from a URI with no S3 endpoint to go with it."""
    db = stack.pg.create_database(f"dagster_deploy_{uuid.uuid4().hex[:6]}")
    home = write_dagster_home(tmp_path / "dagster", stack.pg.port)
    overrides = {"mlflow": {"tracking_uri": stack.mlflow, "experiment": "pg-deploy"}}
    with _environ(stack.pg.dagster_env(db)), dg.DagsterInstance.from_config(str(home)) as instance:
        check_promotions_reach_the_fleet_once_each(tmp_path, instance, overrides)
    deploys = stack.pg.query(db, "SELECT count(*) FROM runs WHERE pipeline_name = 'deploy_job'")
    assert deploys == [(3,)]  # one per alias change, and version 3's hot update, in PostgreSQL
