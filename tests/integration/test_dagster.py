"""The Dagster layer against a real (temporary) Dagster instance."""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from definitions import build_definitions
from jobs.sensors import SENSOR_NAME, rl_step_sensor
from pipeline.config import PROJECT_ROOT, load_config
from pipeline.data import shard_format, shards
from pipeline.data.keys import hidden_states_prefix, policy_pointer_key, rollouts_prefix, step_key
from pipeline.data.rollouts import PolicyPointer, Rollout, write_rollouts
from pipeline.data.store import ObjectStore, open_store
from pipeline.registry import DrafterRegistry
from pipeline.sources.simulation import SimulatedRL
from resources import PipelineResource, pipeline_resource

ASSETS = ["rollouts", "hidden_states", "drafter_buffer", "drafter", "acceptance"]
ALL_ASSETS = [*ASSETS, "fleet", "refreshed_drafter"]


def _fake_step(store: ObjectStore, run: str, step: int) -> None:
    rows = [Rollout(f"s{step}-{i}", [1, 2, 3, 4], [0, 0, 1, 1], 0.5, step) for i in range(3)]
    write_rollouts(store, run, step, rows, PolicyPointer(step, f"policies/{run}/x", "m"))


def test_definitions_load(tiny_config_path: Path) -> None:
    defs = build_definitions(str(tiny_config_path))
    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == set(ALL_ASSETS)
    for key in graph.get_all_asset_keys():
        assert graph.get(key).description, f"asset {key} has no description"
    assert defs.resolve_job_def("rl_step_job").partitions_def.name == "rl_step"


def test_sensor_adds_committed_steps_once(tiny_config_path: Path) -> None:
    cfg = load_config(tiny_config_path)
    store = open_store(cfg)
    _fake_step(store, cfg.run, 1)
    _fake_step(store, cfg.run, 2)
    # An uncommitted step (no policy.json yet) and a stray directory are not steps.
    store.write_bytes(f"{rollouts_prefix(cfg.run, 3)}/rollouts.parquet", b"partial")
    store.write_bytes(f"rollouts/{cfg.run}/notes/readme.txt", b"x")
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance, sensor_name=SENSOR_NAME, definitions=defs,
                                          resources=defs.resources)
        result = rl_step_sensor(context)
        assert [r.run_key for r in result.run_requests] == ["step-000001", "step-000002"]
        assert [r.partition_key for r in result.run_requests] == ["step-000001", "step-000002"]
        assert list(result.dynamic_partitions_requests[0].partition_keys) == ["step-000001", "step-000002"]
        assert json.loads(result.cursor)["step"] == 2
        instance.add_dynamic_partitions("rl_step", ["step-000001", "step-000002"])  # as the daemon does

        again = rl_step_sensor(dg.build_sensor_context(instance=instance, cursor=result.cursor, definitions=defs,
                                                       sensor_name=SENSOR_NAME, resources=defs.resources))
        assert isinstance(again, dg.SkipReason)
        assert "step-000002" in again.skip_message

        _fake_step(store, cfg.run, 3)  # the trainer commits step 3
        third = rl_step_sensor(dg.build_sensor_context(instance=instance, cursor=result.cursor, definitions=defs,
                                                       sensor_name=SENSOR_NAME, resources=defs.resources))
        assert [r.run_key for r in third.run_requests] == ["step-000003"]


@pytest.mark.reliability("fault", "RL trainer commits a step late, behind the sensor's cursor")
def test_sensor_requests_a_step_committed_behind_its_cursor(tiny_config_path: Path) -> None:
    cfg = load_config(tiny_config_path)
    store = open_store(cfg)
    for step in (1, 2, 4):
        _fake_step(store, cfg.run, step)
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        first = rl_step_sensor(dg.build_sensor_context(instance=instance, definitions=defs,
                                                       sensor_name=SENSOR_NAME, resources=defs.resources))
        instance.add_dynamic_partitions("rl_step", ["step-000001", "step-000002", "step-000004"])
        _fake_step(store, cfg.run, 3)  # step 3's commit point lands after step 4's
        tick = rl_step_sensor(dg.build_sensor_context(instance=instance, cursor=first.cursor, definitions=defs,
                                                      sensor_name=SENSOR_NAME, resources=defs.resources))
        assert [r.run_key for r in tick.run_requests] == ["step-000003"]
        assert json.loads(tick.cursor)["step"] == 3  # the newest commit the store saw, whatever its number


@pytest.mark.reliability("bad_input", "a step numbered 10**12 committed first: the sensor requests steps in the "
                                      "order the store saw their commits, and every later step")
def test_the_sensor_orders_steps_by_their_commits_not_their_numbers(tiny_config_path: Path) -> None:
    cfg = load_config(tiny_config_path)
    store = open_store(cfg)
    huge = 10**12
    for number, at in ((huge, 1000.0), (1, 2000.0), (2, 3000.0)):
        _fake_step(store, cfg.run, number)
        os.utime(store.local_path(policy_pointer_key(cfg.run, number)), (at, at))
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        tick = rl_step_sensor(dg.build_sensor_context(instance=instance, definitions=defs,
                                                      sensor_name=SENSOR_NAME, resources=defs.resources))
        assert [r.run_key for r in tick.run_requests] == [step_key(huge), "step-000001", "step-000002"]
        instance.add_dynamic_partitions("rl_step", [r.partition_key for r in tick.run_requests])
        _fake_step(store, cfg.run, 3)
        later = rl_step_sensor(dg.build_sensor_context(instance=instance, cursor=tick.cursor, definitions=defs,
                                                       sensor_name=SENSOR_NAME, resources=defs.resources))
        assert [r.run_key for r in later.run_requests] == ["step-000003"]


def _run_step(defs: dg.Definitions, instance: dg.DagsterInstance, key: str) -> dg.ExecuteInProcessResult:
    instance.add_dynamic_partitions("rl_step", [key])
    return defs.resolve_job_def("rl_step_job").execute_in_process(
        instance=instance, partition_key=key, raise_on_error=False
    )


def test_one_rl_step_through_the_instance_and_its_rerun(tiny_config_path: Path) -> None:
    """A step's run materializes every asset and registers version 1; running the step again (e.g. a
    re-execution from the UI) neither trains nor registers a second time."""
    cfg = load_config(tiny_config_path)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        result = _run_step(defs, instance, "step-000001")
        assert result.success
        for asset in ASSETS:
            event = instance.get_latest_materialization_event(dg.AssetKey(asset))
            assert event is not None, asset
            assert event.dagster_event.partition == "step-000001"
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks == {"shards_valid": True, "buffer_within_limits": True, "tau_in_range": True}

        drafter_md = instance.get_latest_materialization_event(dg.AssetKey("drafter")).asset_materialization.metadata
        assert drafter_md["trained"].value is True
        assert drafter_md["model_version"].value == "1"
        assert drafter_md["trained_on_steps"].value == "[1]"
        assert drafter_md["mlflow_model_version"].value.endswith(f"/#/models/{cfg.mlflow.model_name}/versions/1")
        assert drafter_md["loss_curve"].value.startswith("![training loss per iteration](data:image/png;base64,")
        buffer_md = instance.get_latest_materialization_event(
            dg.AssetKey("drafter_buffer")).asset_materialization.metadata
        assert [(r.data["rl_step"], r.data["samples"]) for r in buffer_md["composition"].value.records] == [
            (1, buffer_md["samples"].value)]
        acceptance_md = instance.get_latest_materialization_event(
            dg.AssetKey("acceptance")).asset_materialization.metadata
        assert 1.0 <= acceptance_md["tau_cotrained"].value <= cfg.eval.num_speculative_tokens + 1
        assert acceptance_md["promoted"].value is True  # the first drafter becomes champion
        plot = acceptance_md["tau_by_step"].value
        assert plot.startswith("![tau per RL step")
        assert "data:image/png;base64," in plot

        assert _run_step(defs, instance, "step-000001").success  # the rerun
        rerun_md = instance.get_latest_materialization_event(dg.AssetKey("drafter")).asset_materialization.metadata
        assert rerun_md["reason"].value == "reused version 1, trained on identical inputs"

    # One MLflow run and one model version, after both runs.
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    assert {a: registry.alias_version(a) for a in ("champion", "challenger", "baseline")} == {
        "champion": "1", "challenger": "1", "baseline": "1"}
    runs = registry.client.search_runs([registry.experiment_id])
    assert len(runs) == 1
    assert runs[0].data.tags["rl_step"] == "step-000001"
    assert runs[0].info.run_name == "drafter-step-000001"
    assert "eval_tau" in runs[0].data.metrics
    assert runs[0].data.params["buffer_samples"] == str(buffer_md["samples"].value)
    version = registry.client.get_model_version(cfg.mlflow.model_name, "1")
    assert version.description.startswith(f"{cfg.drafter.kind} drafter trained at RL step 1 of run {cfg.run}")
    assert version.tags["trained_on_steps"] == "[1]"
    assert version.tags["train_samples"] == str(buffer_md["samples"].value)
    assert 1.0 <= float(version.tags["tau"]) <= cfg.eval.num_speculative_tokens + 1
    assert len(registry.client.get_metric_history(runs[0].info.run_id, "loss")) > 1


def test_skipped_training_says_why(tmp_path: Path) -> None:
    from tests.support.config import write_config

    path = write_config(tmp_path, {"train": {"min_samples": 10_000}})
    cfg = load_config(path)
    SimulatedRL(cfg.simulation, open_store(cfg), cfg.run, cfg.data_path / "cache").run_step(1)
    defs = build_definitions(str(path))
    with dg.instance_for_test() as instance:
        assert _run_step(defs, instance, "step-000001").success
        md = instance.get_latest_materialization_event(dg.AssetKey("drafter")).asset_materialization.metadata
        assert md["trained"].value is False
        assert "train.min_samples=10000" in md["reason"].value
        acceptance_md = instance.get_latest_materialization_event(
            dg.AssetKey("acceptance")).asset_materialization.metadata
        assert acceptance_md["decision"].value == "no new drafter at this step"


@pytest.mark.parametrize("key", ["step-12", "rl-000001", "step-000001x"], ids=["short", "prefix", "suffix"])
@pytest.mark.reliability("bad_input", "partition key that is not `step-` plus digits (Dagster run)")
def test_bad_partition_key_is_rejected_by_name(tiny_config_path: Path, key: str) -> None:
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        result = _run_step(defs, instance, key)
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert key in failure.step_failure_data.error.cause.message
        assert instance.get_latest_materialization_event(dg.AssetKey("rollouts")) is None


def test_rollouts_missing_column_fail_before_anything_is_written(tiny_config_path: Path) -> None:
    cfg = load_config(tiny_config_path)
    store = open_store(cfg)
    _fake_step(store, cfg.run, 1)
    table = pa.table({"sample_id": ["a"], "input_ids": [[1, 2]], "loss_mask": [[0, 1]], "policy_version": [1]})
    with store.open_write(f"{rollouts_prefix(cfg.run, 1)}/rollouts.parquet") as f:
        pq.write_table(table.replace_schema_metadata({"schema_version": "1"}), f)
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        result = _run_step(defs, instance, "step-000001")
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "missing column(s) reward" in failure.step_failure_data.error.cause.message
    assert not store.exists(f"{hidden_states_prefix(cfg.run, 1)}/{shard_format.MANIFEST}")


def test_failed_shard_check_blocks_downstream(tiny_config_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shards check is blocking: training never reads shards that failed it."""
    cfg = load_config(tiny_config_path)
    SimulatedRL(cfg.simulation, open_store(cfg), cfg.run, cfg.data_path / "cache").run_step(1)
    # Stand-in for a corrupted shard: the check in the extraction worker reports a problem.
    monkeypatch.setenv("PYTHONPATH", f"{PROJECT_ROOT / 'tests' / 'support' / 'worker_faults'}:{PROJECT_ROOT}")
    monkeypatch.setenv("DRAFTER_TEST_SHARD_PROBLEM", "part-00000: checksum differs")
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        result = _run_step(defs, instance, "step-000001")
        assert not result.success
        assert {e.check_name: e.passed for e in result.get_asset_check_evaluations()}["shards_valid"] is False
        assert instance.get_latest_materialization_event(dg.AssetKey("hidden_states")) is not None
        for downstream in ("drafter_buffer", "drafter", "acceptance"):
            assert instance.get_latest_materialization_event(dg.AssetKey(downstream)) is None


def test_external_trainer_step_runs_like_a_simulated_one(tmp_path: Path) -> None:
    """An RL trainer drops rollouts + a pointer to a checkpoint it keeps elsewhere; the sensor takes it from there."""
    import torch

    from tests.support.config import write_config

    # The trainer keeps its checkpoints outside the store: the config allows that place (and only it).
    path = write_config(tmp_path, {"rollout_source": "external",
                                   "storage": {"checkpoint_prefixes": [(tmp_path / "trainer-ckpt").parent.as_uri()]}})
    cfg = load_config(path)
    store = open_store(cfg)
    # The trainer's own checkpoint directory, outside the pipeline's store.
    trainer = SimulatedRL(cfg.simulation, ObjectStore((tmp_path / "trainer").as_uri()), "rl", tmp_path / "cache")
    policy = trainer.pretrained()
    policy.save_pretrained(tmp_path / "trainer-ckpt", safe_serialization=True)
    rows = trainer.generate_rollouts(policy, 1, torch.Generator().manual_seed(0))
    pointer = PolicyPointer(policy_version=7, checkpoint_uri=(tmp_path / "trainer-ckpt").as_uri(), model_id="ext")
    write_rollouts(store, cfg.run, 1, rows, pointer)

    defs = build_definitions(str(path))
    with dg.instance_for_test() as instance:
        tick = rl_step_sensor(dg.build_sensor_context(instance=instance, sensor_name=SENSOR_NAME, definitions=defs,
                                                      resources=defs.resources))
        assert [r.run_key for r in tick.run_requests] == ["step-000001"]
        assert _run_step(defs, instance, "step-000001").success
        md = instance.get_latest_materialization_event(dg.AssetKey("rollouts")).asset_materialization.metadata
        assert md["policy_version"].value == 7
    manifest = shards.read_manifest(store, cfg.run, 1)
    assert manifest.target["policy_version"] == "7"
    assert manifest.target["checkpoint_uri"] == pointer.checkpoint_uri
    assert store.read_json(f"acceptance/{cfg.run}/step-000001.json")["policy_version"] == 7


def test_a_run_reads_the_config_once_and_the_next_run_sees_an_edit(tiny_config_path: Path) -> None:
    """Editing the YAML while a run is under way changes nothing in that run; the next run sees the edit
    (the code location is not reloaded in between)."""
    seen: list[str] = []

    @dg.asset
    def first(pipeline: PipelineResource) -> None:
        seen.append(pipeline.config.run)
        data = yaml.safe_load(tiny_config_path.read_text())
        tiny_config_path.write_text(yaml.safe_dump({**data, "run": f"{data['run']}-edited"}))

    @dg.asset(deps=[first])
    def second(pipeline: PipelineResource) -> None:
        seen.append(pipeline.config.run)

    resources = {"pipeline": pipeline_resource(str(tiny_config_path))}
    with dg.instance_for_test() as instance:
        assert dg.materialize([first, second], resources=resources, instance=instance).success
        assert dg.materialize([second], resources=resources, instance=instance).success
    assert seen == ["test", "test", "test-edited"]
