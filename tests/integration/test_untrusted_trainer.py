"""What the RL trainer writes, tried as a broken or hostile trainer would, through the real layers:
the step sensor, the Dagster assets on a temporary instance, and training tracked in MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from definitions import build_definitions
from jobs.sensors import SENSOR_NAME, rl_step_sensor
from pipeline.config import load_config
from pipeline.data import buffer, shard_format, shards
from pipeline.data.keys import hidden_states_prefix, policy_pointer_key
from pipeline.data.store import open_store
from pipeline.registry import DrafterRegistry
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from pipeline.training import cotrain
from pipeline.training.dataset import UnreadableDataError
from tests.integration.test_dagster import _fake_step
from tests.support.config import write_config

SECRET = "TrainerSecret-9f3a"


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.reliability("bad_input", f"step directory named {n!r} (sensor skip reason)"))
    for n in ("step-12", "step-0000001", "Step-000002", "step-00003a",
              # beyond int64: no step key can be formed, and the tick must not raise on it
              "step-9223372036854775808", "step-99999999999999999999")
])
def test_the_sensor_names_malformed_step_directories(tiny_config_path: Path, name: str) -> None:
    cfg = load_config(tiny_config_path)
    store = open_store(cfg)
    _fake_step(store, cfg.run, 1)
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        def tick(cursor: str | None) -> dg.SensorResult | dg.SkipReason:
            return rl_step_sensor(dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs,
                                                          sensor_name=SENSOR_NAME, resources=defs.resources))

        first = tick(None)  # step 1 launched: the cursor holds its store time
        assert [r.run_key for r in first.run_requests] == ["step-000001"]
        instance.add_dynamic_partitions("rl_step", ["step-000001"])  # as the daemon applies the tick's request
        store.write_bytes(f"rollouts/{cfg.run}/{name}/policy.json", b"{}")
        store.write_bytes(f"rollouts/{cfg.run}/notes/readme.txt", b"not a step: not reported")
        tick = tick(first.cursor)
    assert isinstance(tick, dg.SkipReason)
    assert "ignored 1 step director(ies) whose name is not 'step-' and the step in six digits" in tick.skip_message
    assert tick.skip_message.endswith(f": {name}")
    assert "notes" not in tick.skip_message


def _events_text(instance: dg.DagsterInstance, run_id: str) -> str:
    return "\n".join(str(e) for e in instance.all_logs(run_id))


@pytest.mark.reliability("security", "credentials in checkpoint_uri: in no Dagster event, run record, asset "
                                     "metadata or stored file")
def test_a_pointer_with_credentials_never_reaches_the_run_database(tiny_config_path: Path) -> None:
    cfg = load_config(tiny_config_path)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    key = policy_pointer_key(cfg.run, 1)
    pointer = store.read_json(key)
    pointer["checkpoint_uri"] = f"{store.root}/policies/{cfg.run}/step-000001?token={SECRET}"
    store.write_json(key, pointer)
    defs = build_definitions(str(tiny_config_path))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", ["step-000001"])
        result = defs.resolve_job_def("rl_step_job").execute_in_process(
            instance=instance, partition_key="step-000001", raise_on_error=False)
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "field checkpoint_uri" in str(failure.step_failure_data.error)
        assert SECRET not in _events_text(instance, result.run_id)
        assert SECRET not in str(instance.get_run_by_id(result.run_id))
    stored = [k for k, _, _ in store.list_files("") if k != key]
    assert not any(SECRET.encode() in store.read_bytes(k) for k in stored if k.endswith((".json", ".parquet")))
    assert not store.exists(f"{hidden_states_prefix(cfg.run, 1)}/{shard_format.MANIFEST}")


@pytest.mark.reliability("bad_input", "a step whose policy changes the hidden size, through Dagster: refused at "
                                      "the rollouts asset, the next valid step still trains")
def test_a_policy_of_another_layout_is_refused_at_the_rollouts_asset(tiny_config_path: Path) -> None:
    cfg = load_config(tiny_config_path)
    store = open_store(cfg)
    rl = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    rl.run_step(1)
    rl.run_step(2)
    config_key = f"policies/{cfg.run}/step-000002/config.json"
    config = json.loads(store.read_bytes(config_key))
    store.write_bytes(config_key, json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}).encode())
    defs = build_definitions(str(tiny_config_path))
    job = defs.resolve_job_def("rl_step_job")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", ["step-000001", "step-000002"])
        rollouts_only = [dg.AssetKey("rollouts")]
        assert job.execute_in_process(instance=instance, partition_key="step-000001", raise_on_error=False,
                                      asset_selection=rollouts_only).success
        second = job.execute_in_process(instance=instance, partition_key="step-000002", raise_on_error=False,
                                        asset_selection=rollouts_only)
    assert not second.success
    failure = next(e for e in second.all_events if e.event_type_value == "STEP_FAILURE")
    assert failure.step_key == "rollouts"
    message = str(failure.step_failure_data.error)
    assert "hidden_size" in message
    assert "start a new run" in message
    assert not shards.has_manifest(store, cfg.run, 2)


@pytest.mark.slow
def test_training_counts_only_the_samples_it_read(tmp_path: Path, reliability) -> None:  # noqa: ANN001
    reliability.fault("corrupt shard during training, within train.max_unreadable_share: MLflow params, the result "
                      "and the version count only samples read")
    cfg = load_config(write_config(tmp_path, {"train": {"max_unreadable_share": 0.6, "min_samples": 1}}))
    store = open_store(cfg)
    rl = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    manifests = []
    for step in (1, 2):
        rl.run_step(step)
        manifests.append(extract.extract_hidden_states(store, cfg, step))
    buffer.build_buffer(store, cfg.run, 2, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)
    lost = manifests[0]  # the step is committed and in the buffer; then its shard is lost from storage
    for shard in lost.shards:
        store.delete_prefix(f"{hidden_states_prefix(cfg.run, 1)}/{shard.name}")
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.artifact_root)

    outcome = cotrain.train_step(store, cfg, 2, registry, {})

    read = manifests[1].num_samples
    assert outcome.result.samples == read
    params = registry.client.get_run(outcome.run_id).data.params
    assert (params["samples_read"], params["samples_unreadable"]) == (str(read), str(lost.num_samples))
    assert params["buffer_samples"] == str(read + lost.num_samples)
    version = registry.client.get_model_version(cfg.mlflow.model_name, outcome.version)
    assert version.tags["train_samples"] == str(read)

    strict = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_unreadable_share": 0.3})})
    with pytest.raises(UnreadableDataError, match=f"shard {lost.shards[0].name}"):
        cotrain.train_step(store, strict, 2, registry, {"attempt": "strict"})
