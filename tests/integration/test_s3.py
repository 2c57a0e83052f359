"""The storage suite on `file://` and on a real S3-compatible server on loopback (moto's server).

Everything the pipeline does with its object store must behave the same on both.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import s3fs
import torch
from moto.server import ThreadedMotoServer

from definitions import build_definitions
from pipeline.config import load_config
from pipeline.data import buffer, shard_format, shards
from pipeline.data.acceptance_record import read_acceptance
from pipeline.data.keys import hidden_states_prefix
from pipeline.data.rollouts import PolicyPointer, Rollout, committed_steps, read_rollouts, write_rollouts
from pipeline.data.store import ObjectStore, open_store, storage_options_for
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.sources.simulation import SimulatedRL
from tests.support.config import write_config
from tests.support.targets import tiny_target

BUCKET = "pipeline-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        # exist_ok: moto keeps its buckets per process, and other modules start their own server too.
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
        fs.makedirs(BUCKET, exist_ok=True)
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return ObjectStore((tmp_path / "store").as_uri())
    endpoint = request.getfixturevalue("s3_endpoint")
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    return ObjectStore(root, storage_options_for(root, endpoint))


def _rollouts(step: int, n: int = 4) -> list[Rollout]:
    return [Rollout(f"s{step}-{i}", [1, 2, 3, 4, 5], [0, 0, 1, 1, 1], 0.5, step) for i in range(n)]


def test_objects_round_trip_and_list(store: ObjectStore) -> None:
    store.write_json("a/b/one.json", {"x": 1})
    store.write_bytes("a/c/two.bin", b"\x00\x01")
    assert store.read_json("a/b/one.json") == {"x": 1}
    assert store.read_bytes("a/c/two.bin") == b"\x00\x01"
    assert store.size("a/c/two.bin") == 2
    assert store.list_dirs("a") == ["b", "c"]
    assert store.list_dirs("missing") == []
    store.delete_prefix("a/b")
    assert not store.exists("a/b/one.json")
    assert store.exists("a/c/two.bin")


def _write_and_fail(store: ObjectStore, key: str) -> None:
    with store.open_write(key) as f:
        f.write(b"half of the new")
        raise RuntimeError("boom")


def test_a_failed_write_leaves_nothing(store: ObjectStore) -> None:
    store.write_bytes("k/obj", b"old")
    with pytest.raises(RuntimeError, match="boom"):
        _write_and_fail(store, "k/obj")
    assert store.read_bytes("k/obj") == b"old"
    with pytest.raises(RuntimeError, match="boom"):
        _write_and_fail(store, "k/new")
    assert not store.exists("k/new")


def test_keys_cannot_leave_the_root(store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="stay under the root"):
        store.read_bytes("../elsewhere")


def test_rollouts_and_commit_point(store: ObjectStore) -> None:
    write_rollouts(store, "run", 1, _rollouts(1), PolicyPointer(1, "policies/run/x", "m"))
    store.write_bytes("rollouts/run/step-000002/rollouts.parquet", b"uncommitted")
    assert committed_steps(store, "run") == [1]
    assert [r.sample_id for r in read_rollouts(store, "run", 1)] == [f"s1-{i}" for i in range(4)]


def test_shards_buffer_and_bad_input(store: ObjectStore) -> None:
    g = torch.Generator().manual_seed(0)
    samples = [
        shard_format.HiddenSample(f"s{i}", 1, torch.arange(6), torch.tensor([0, 0, 1, 1, 1, 1]),
                            torch.randn(6, 1, 8, generator=g).to(torch.bfloat16))
        for i in range(5)
    ]
    manifest = shards.write_hidden_states(store, "run", 1, samples, hidden_size=8, layer_ids=[2],
                                          target={"model_id": "m"}, samples_per_shard=2)
    assert len(manifest.shards) == 3
    read = list(shards.iter_samples(store, "run", shards.read_manifest(store, "run", 1)))
    assert all(torch.equal(a.hidden.view(torch.int16), b.hidden.view(torch.int16))
               for a, b in zip(samples, read, strict=True))

    assert buffer.build_buffer(store, "run", 1, buffer_steps=2, max_samples=3).composition == {1: 3}
    loaded = list(buffer.iter_buffer_samples(store, "run", buffer.read_buffer(store, "run", 1).entries))
    assert [s.sample_id for s in loaded] == ["s2", "s3", "s4"]
    assert all(torch.equal(a.hidden.view(torch.int16), b.hidden.view(torch.int16))
               for a, b in zip(samples[2:], loaded, strict=True))

    bad = [*samples[:1], shard_format.HiddenSample("nan", 2, torch.arange(6), torch.ones(6, dtype=torch.int64),
                                             torch.full((6, 1, 8), float("nan"), dtype=torch.bfloat16))]
    with pytest.raises(shard_format.ShardError, match="NaN"):
        shards.write_hidden_states(store, "run", 2, bad, hidden_size=8, layer_ids=[2], target={})
    assert store.list_dirs(f"hidden_states/run/{'step-000002'}") == []
    assert not store.exists(f"{hidden_states_prefix('run', 2)}/{shard_format.MANIFEST}")


def test_policy_checkpoint_round_trip(store: ObjectStore) -> None:
    model = tiny_target(16, 16, 1, 2)
    uri = target_lib.save_checkpoint(model, store, "policies/run/step-000001")
    loaded = target_lib.load_policy(store, "policies/run/step-000001")
    assert uri.startswith(store.root)
    ids = torch.randint(0, 16, (1, 5))
    torch.testing.assert_close(target_forward.forward(loaded, ids).logits, target_forward.forward(model, ids).logits)


def test_one_rl_step_on_s3(s3_endpoint: str, tmp_path: Path) -> None:
    """The whole step (simulated trainer, shards, buffer, training, evaluation) against S3."""
    path = write_config(tmp_path, {"storage": {"root": f"s3://{BUCKET}/e2e-{uuid.uuid4().hex[:6]}",
                                               "endpoint_url": s3_endpoint}})
    cfg = load_config(path)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    defs = build_definitions(str(path))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", ["step-000001"])
        result = defs.resolve_job_def("rl_step_job").execute_in_process(instance=instance,
                                                                         partition_key="step-000001")
        assert result.success
        uri = instance.get_latest_materialization_event(
            dg.AssetKey("hidden_states")).asset_materialization.metadata["uri"].value
    assert uri.startswith("s3://")
    assert read_acceptance(store, cfg.run, 1).cotrained.version == "1"


def test_training_checkpoints_commit_and_restore(store: ObjectStore) -> None:
    """Resumable training state on both stores: latest.json commits, older checkpoints go, state restores exactly."""
    import torch

    from pipeline.training.state import ResumeState, TrainingCheckpoints

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    checkpoints = TrainingCheckpoints(store, "training/run/abc")
    for iteration in (5, 10):
        checkpoints.save(model, optimizer, ResumeState(iteration, 20, 1, loss_history=[1.0] * iteration))
    assert store.list_dirs("training/run/abc") == ["iter-00000010"]

    other = torch.nn.Linear(4, 3)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.5)
    state = checkpoints.restore(other, other_optimizer)
    assert (state.iteration, state.total_iterations, len(state.loss_history)) == (10, 20, 10)
    assert torch.equal(other.weight, model.weight)
    assert torch.equal(other_optimizer.state[other.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"])
    checkpoints.clear()
    assert checkpoints.latest() is None


@pytest.mark.parametrize("compression", shard_format.LOSSLESS)
def test_ranged_reads_of_some_layers(store: ObjectStore, compression: str) -> None:
    g = torch.Generator().manual_seed(1)
    samples = [shard_format.HiddenSample(f"s{i}", 1, torch.arange(5 + i), torch.ones(5 + i, dtype=torch.int64),
                                   torch.randn(5 + i, 3, 8, generator=g).to(torch.bfloat16)) for i in range(11)]
    manifest = shards.write_hidden_states(store, "run", 1, samples, hidden_size=8, layer_ids=[3, 9, 12], target={},
                                          compression=compression)
    rows = list(range(11))[::-1]  # more rows than are fetched at once, out of order

    # One layer of three: ranged reads; all layers: most of the shard, read whole.
    for layers, positions in (([9], [1]), (None, [0, 1, 2])):
        got = shards.read_rows(store, "run", manifest, manifest.shards[0].name, rows, layers=layers)

        assert [s.sample_id for s in got] == [f"s{r}" for r in rows]
        for sample, r in zip(got, rows, strict=True):
            assert torch.equal(sample.input_ids, samples[r].input_ids)
            assert torch.equal(sample.hidden.view(torch.int16), samples[r].hidden[:, positions].view(torch.int16))
    assert torch.equal(shards.read_sample(store, "run", manifest, "s4").hidden.view(torch.int16),
                       samples[4].hidden.view(torch.int16))


def test_retention_plans_then_deletes_only_unreferenced_steps(store: ObjectStore) -> None:
    from pipeline.data import buffer, retention

    for step in (1, 2, 3):
        samples = [shard_format.HiddenSample(f"s{step}-{i}", step, torch.arange(6), torch.tensor([0, 0, 1, 1, 1, 1]),
                                       torch.full((6, 1, 8), float(step), dtype=torch.bfloat16)) for i in range(2)]
        shards.write_hidden_states(store, "run", step, samples, hidden_size=8, layer_ids=[2], target={})
        buffer.build_buffer(store, "run", step, buffer_steps=1, max_samples=10)
    before = store.list_files("hidden_states")

    plan = retention.plan_retention(store, "run", registered_steps={1}, buffer_steps=1)

    assert store.list_files("hidden_states") == before
    assert plan.live_buffers == [1, 3]
    assert sorted(plan.kept_steps) == [1, 3]
    assert {d.key.split("/")[2] for d in plan.delete if d.key.startswith("hidden_states/")} == {"step-000002"}
    retention.apply_retention(store, plan)
    assert not shards.has_manifest(store, "run", 2)
    assert not store.exists("buffer/run/step-000002/_manifest.json")
    for step in (1, 3):
        (got, _) = shards.iter_samples(store, "run", shards.read_manifest(store, "run", step))
        assert float(got.hidden[0, 0, 0]) == step
