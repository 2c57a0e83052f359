"""Retention: only shards no live buffer and no registered drafter refers to are deleted, after a dry run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from pipeline.data import buffer, retention, shard_format, shards
from pipeline.data.keys import buffer_key, hidden_states_prefix, refresh_data_run
from pipeline.data.store import ObjectStore

RUN = "r"


def _samples(step: int, n: int = 3) -> list[shard_format.HiddenSample]:
    g = torch.Generator().manual_seed(step)
    return [shard_format.HiddenSample(f"s{step}-{i}", step, torch.arange(6), torch.tensor([0, 0, 1, 1, 1, 1]),
                                torch.randn(6, 1, 8, generator=g).to(torch.bfloat16)) for i in range(n)]


def build_history(store: ObjectStore, steps: int, buffered: int, buffer_steps: int = 2) -> None:
    """Hidden states of steps 1..steps, buffers built at steps 1..buffered (the loop's order)."""
    for step in range(1, steps + 1):
        shards.write_hidden_states(store, RUN, step, _samples(step), hidden_size=8, layer_ids=[1],
                                   target={"model_id": "m"}, samples_per_shard=2)
        if step <= buffered:
            buffer.build_buffer(store, RUN, step, buffer_steps, max_samples=100)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_dry_run_lists_and_changes_nothing_then_apply_deletes_exactly_that(store: ObjectStore, tmp_path: Path) -> None:
    # Steps 1..6 extracted, buffers built through step 5 (window of 2 steps); a drafter was registered at step 2.
    build_history(store, steps=6, buffered=5)
    before = snapshot(tmp_path)

    plan = retention.plan_retention(store, RUN, registered_steps={2}, buffer_steps=2)

    assert snapshot(tmp_path) == before  # planning deletes nothing
    assert plan.live_buffers == [2, 5]
    step3 = hidden_states_prefix(RUN, 3)
    manifest3 = shards.read_manifest(store, RUN, 3)
    assert [d.key for d in plan.delete] == [
        buffer_key(RUN, 1), buffer_key(RUN, 3), buffer_key(RUN, 4),
        f"{step3}/{shard_format.MANIFEST}", *(f"{step3}/{s.name}" for s in manifest3.shards),
    ]
    assert plan.bytes == sum(store.size(d.key) for d in plan.delete) > manifest3.total_bytes
    assert plan.kept_steps == {1: "referenced by a live buffer", 2: "referenced by a live buffer",
                               4: "inside the current buffer window or newer",
                               5: "inside the current buffer window or newer",
                               6: "inside the current buffer window or newer"}

    freed = retention.apply_retention(store, plan)

    assert freed == plan.bytes
    assert not shards.has_manifest(store, RUN, 3)
    assert not any(store.exists(d.key) for d in plan.delete)
    # What the live buffers and the registered drafter's data point at still reads, bit for bit.
    for step in (2, 5):
        entries = buffer.read_buffer(store, RUN, step).entries
        assert [s.sample_id for s in buffer.iter_buffer_samples(store, RUN, entries)] == [e.sample_id for e in entries]
    for step in (1, 2, 4, 5, 6):
        assert len(list(shards.iter_samples(store, RUN, shards.read_manifest(store, RUN, step)))) == 3
    # A second run finds nothing more to delete.
    assert retention.plan_retention(store, RUN, registered_steps={2}, buffer_steps=2).delete == []


@pytest.mark.reliability("bad_input", "a step numbered 10**12 buffered first: retention keeps the buffer written "
                                      "last and its window, and deletes the far-future buffer, not the run's data")
def test_the_newest_buffer_is_the_one_the_store_saw_last_not_the_highest_number(store: ObjectStore) -> None:
    far = 10**12
    shards.write_hidden_states(store, RUN, far, _samples(far), hidden_size=8, layer_ids=[1],
                               target={"model_id": "m"}, samples_per_shard=2)
    buffer.build_buffer(store, RUN, far, 2, max_samples=100)
    earlier = time.time() - 1000
    os.utime(store.local_path(buffer_key(RUN, far)), (earlier, earlier))
    build_history(store, steps=4, buffered=4)

    plan = retention.plan_retention(store, RUN, registered_steps=set(), buffer_steps=2)

    assert plan.live_buffers == [4]  # what the next training reads
    deleted = {d.key for d in plan.delete}
    assert buffer_key(RUN, far) in deleted
    assert buffer_key(RUN, 4) not in deleted
    assert {3, 4} <= plan.kept_steps.keys()
    retention.apply_retention(store, plan)
    entries = buffer.read_buffer(store, RUN, 4).entries
    assert [s.sample_id for s in buffer.iter_buffer_samples(store, RUN, entries)] == [e.sample_id for e in entries]


def _refresh_data(store: ObjectStore, step: int, part: int) -> str:
    """A refresh's hidden states and buffer in its own namespace, as the refresh process writes them."""
    data_run = refresh_data_run(RUN, step, part)
    manifest = shards.write_hidden_states(store, data_run, step, _samples(step), hidden_size=8, layer_ids=[1],
                                          target={"model_id": "m"}, samples_per_shard=2)
    buffer.write_buffer(store, data_run, step, buffer.select_buffer([manifest], step, 1, 100))
    return data_run


def test_refresh_data_goes_once_its_step_leaves_the_buffer_window(store: ObjectStore) -> None:
    build_history(store, steps=6, buffered=5)
    old, kept = _refresh_data(store, 3, 2), _refresh_data(store, 4, 5)  # window of 2 steps ending at 5: 4, 5

    plan = retention.plan_retention(store, RUN, registered_steps={2}, buffer_steps=2)

    doomed = [d for d in plan.delete if d.reason.startswith("refresh")]
    keys = [d.key for d in doomed]
    manifest = shards.read_manifest(store, old, 3)
    # manifests first
    assert keys[:2] == [buffer_key(old, 3), f"{hidden_states_prefix(old, 3)}/{shard_format.MANIFEST}"]
    assert sorted(keys[2:]) == sorted(f"{hidden_states_prefix(old, 3)}/{s.name}" for s in manifest.shards)
    assert all(d.reason == "refresh of a step before the buffer window (step 3 < 4)" for d in doomed)
    retention.apply_retention(store, plan)
    assert store.list_files(hidden_states_prefix(old, 3)) == []
    assert not store.exists(buffer_key(old, 3))
    # The one still inside the window reads as written; a second plan deletes nothing more of the refreshes.
    assert len(list(shards.iter_samples(store, kept, shards.read_manifest(store, kept, 4)))) == 3
    assert not [d for d in retention.plan_retention(store, RUN, {2}, 2).delete if d.reason.startswith("refresh")]


def test_evicting_from_the_buffer_deletes_no_data(store: ObjectStore, tmp_path: Path) -> None:
    build_history(store, steps=3, buffered=2)
    files = set(snapshot(tmp_path / "store" / "hidden_states"))

    buffer.build_buffer(store, RUN, 3, buffer_steps=1, max_samples=1)  # evicts all but one sample

    assert [e.sample_id for e in buffer.read_buffer(store, RUN, 3).entries] == ["s3-2"]
    assert set(snapshot(tmp_path / "store" / "hidden_states")) == files


def test_nothing_is_judged_before_the_first_buffer(store: ObjectStore) -> None:
    build_history(store, steps=3, buffered=0)
    plan = retention.plan_retention(store, RUN, registered_steps=set(), buffer_steps=1)
    assert plan.delete == []
    assert plan.live_buffers == []


def test_unlisted_files_are_deleted_only_after_the_grace_period(store: ObjectStore, tmp_path: Path) -> None:
    build_history(store, steps=2, buffered=2, buffer_steps=1)
    directory = tmp_path / "store" / hidden_states_prefix(RUN, 2)
    stale, fresh = directory / "part-00000-deadbeef.arrow", directory / "part-00000-cafecafe.arrow"
    stale.write_bytes(b"left by a crashed write")
    fresh.write_bytes(b"a write whose manifest is not committed yet")
    an_hour_ago = time.time() - 2 * retention.ORPHAN_GRACE_S
    os.utime(stale, (an_hour_ago, an_hour_ago))

    plan = retention.plan_retention(store, RUN, registered_steps=set(), buffer_steps=1)
    orphan_keys = [d.key for d in plan.delete if "not listed" in d.reason]

    assert orphan_keys == [f"{hidden_states_prefix(RUN, 2)}/{stale.name}"]
    retention.apply_retention(store, plan)
    assert not stale.exists()
    assert fresh.exists()
    assert len(list(shards.iter_samples(store, RUN, shards.read_manifest(store, RUN, 2)))) == 3


def test_registered_training_steps_come_from_the_registry(tmp_path: Path) -> None:
    from pipeline.registry import DrafterRegistry

    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}", "exp", "drafter",
                               (tmp_path / "artifacts").as_uri())
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    for tags in ({"pipeline_run": RUN, "rl_step": "4"}, {"pipeline_run": "other", "rl_step": "5"},
                 {"pipeline_run": RUN}, {"pipeline_run": RUN, "rl_step": "7"}):
        registry.register(registry.start_run("r", {}), checkpoint, tags)

    assert retention.registered_training_steps(registry.client, "drafter", RUN) == {4, 7}


def test_cli_dry_run_then_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import cli
    from pipeline.config import CONFIG_ENV

    monkeypatch.setenv(CONFIG_ENV, "")  # `--config` exports the path: restored after the test
    from pipeline.config import load_config
    from pipeline.data.store import open_store
    from tests.support.config import write_config

    config = write_config(tmp_path, {"train": {"buffer_steps": 1}})
    cfg = load_config(config)
    store = open_store(cfg)
    for step in (1, 2, 3):
        shards.write_hidden_states(store, cfg.run, step, _samples(step), hidden_size=8, layer_ids=[1],
                                   target={"model_id": "m"})
        buffer.build_buffer(store, cfg.run, step, 1, max_samples=100)
    doomed = [buffer_key(cfg.run, 1), buffer_key(cfg.run, 2),
              f"{hidden_states_prefix(cfg.run, 1)}/{shard_format.MANIFEST}"]

    cli.main(["--config", str(config), "retention"])
    dry = capsys.readouterr().out

    assert all(f"would delete {key} (" in dry for key in doomed)
    assert "dry run: 6 objects" in dry  # 2 expired buffers, 2 steps of manifest + 1 shard each
    assert all(store.exists(key) for key in doomed)

    cli.main(["--config", str(config), "retention", "--apply"])
    applied = capsys.readouterr().out

    assert "deleted 6 objects" in applied
    assert not any(store.exists(key) for key in doomed)
    assert shards.has_manifest(store, cfg.run, 3)
