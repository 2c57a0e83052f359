"""A step published in parts (pipeline.data.parts, through pipeline.client): parts are validated like whole
steps, idempotent, in any order, and never change a committed step; the commit lists its parts and reads
back as a step published whole."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.client import Rollout, RolloutsError, commit_rollouts_parts, publish_rollouts_part, publish_step
from pipeline.data import parts as parts_lib
from pipeline.data.keys import part_manifest_key, part_rollouts_key, policy_prefix
from pipeline.data.rollouts import is_committed, read_policy_pointer, read_rollouts
from pipeline.data.store import ObjectStore
from tests.support.contract_cases import BAD, BAD_ROLLOUTS, LIMITS, ok

RUN, STEP = "r", 3


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore((tmp_path / "store").as_uri())


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "staging"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"vocab_size": LIMITS.vocab_size,
                                                       "max_position_embeddings": LIMITS.max_positions}))
    save_file({"w": np.zeros((2, 3), dtype=np.float32)}, str(directory / "model.safetensors"))
    return directory


def rows(part: int, n: int = 2) -> list[Rollout]:
    return [ok(f"p{part}-{i}", reward=0.25 * i) for i in range(n)]


def publish(store: ObjectStore, checkpoint: Path, part: int, items: list[Rollout], **changes):
    at = 100.0 + (part if isinstance(part, int) else 0)
    kwargs = {"policy_version": 2, "model_id": "tiny", "expected_rollouts": 6, "now": at, **changes}
    return publish_rollouts_part(store, RUN, STEP, part, items, checkpoint, **kwargs)


def stored_files(store: ObjectStore) -> dict[str, bytes]:
    return {key: store.read_bytes(key) for key, _, _ in store.list_files("")}


def test_parts_in_any_order_commit_as_one_step_in_part_order(store: ObjectStore, checkpoint: Path) -> None:
    for part in (2, 0, 1):  # groups finish in any order; the trainer's numbers order the step
        assert publish(store, checkpoint, part, rows(part)).written

    assert not is_committed(store, RUN, STEP)  # the sensor does not see the step before its commit
    assert [m.part for m in parts_lib.published_parts(store, RUN, STEP)] == [0, 1, 2]
    assert parts_lib.read_step_parts(store, RUN, STEP).pointer.checkpoint_uri == policy_prefix(RUN, STEP)
    assert store.exists(f"{policy_prefix(RUN, STEP)}/model.safetensors")  # with the first part

    assert commit_rollouts_parts(store, RUN, STEP) == [0, 1, 2]

    assert [r.sample_id for r in read_rollouts(store, RUN, STEP, LIMITS)] == [
        "p0-0", "p0-1", "p1-0", "p1-1", "p2-0", "p2-1"]
    assert read_policy_pointer(store, RUN, STEP).policy_version == 2
    assert parts_lib.committed_part_numbers(store, RUN, STEP) == [0, 1, 2]
    assert commit_rollouts_parts(store, RUN, STEP) == [0, 1, 2]  # again: a no-op


def test_the_same_part_again_is_a_no_op(store: ObjectStore, checkpoint: Path) -> None:
    first = publish(store, checkpoint, 0, rows(0))
    before = stored_files(store)

    again = publish(store, checkpoint, 0, rows(0), now=999.0)

    assert not again.written
    assert again.manifest == first.manifest
    assert stored_files(store) == before


@BAD("a part published again with other content (client)")
def test_other_content_for_a_published_part_is_refused_by_name(store: ObjectStore, checkpoint: Path) -> None:
    publish(store, checkpoint, 0, rows(0))
    before = stored_files(store)

    with pytest.raises(RolloutsError, match="part 0 of step-000003 was published already with other content"):
        publish(store, checkpoint, 0, [ok("p0-0", reward=0.5), ok("p0-1")])
    assert stored_files(store) == before


@BAD("a part after its step's commit (client)")
def test_a_part_after_the_commit_is_refused(store: ObjectStore, checkpoint: Path) -> None:
    publish(store, checkpoint, 0, rows(0))
    commit_rollouts_parts(store, RUN, STEP)
    before = stored_files(store)

    with pytest.raises(RolloutsError, match=r"step-000003 is committed: a part published after the commit \(part 1\)"):
        publish(store, checkpoint, 1, rows(1))
    assert not publish(store, checkpoint, 0, rows(0)).written  # a retry of a part the step consists of
    assert stored_files(store) == before


@BAD("a part of a step published whole (client)")
def test_a_part_of_a_step_published_whole_is_refused(store: ObjectStore, checkpoint: Path) -> None:
    publish_step(store, RUN, STEP, rows(0), checkpoint, policy_version=2, model_id="tiny")

    with pytest.raises(RolloutsError, match="is committed"):
        publish(store, checkpoint, 0, rows(0))


@pytest.mark.parametrize(("change", "field"), [
    pytest.param({"policy_version": 5}, "policy_version", id="pointer",
                 marks=BAD("a part naming another policy than the step's first part (client)")),
    pytest.param({"expected_rollouts": 7}, "expected_rollouts", id="expected",
                 marks=BAD("a part expecting another step size than the first part (client)")),
])
def test_a_part_disagreeing_with_the_first_is_refused(store: ObjectStore, checkpoint: Path, change: dict,
                                                      field: str) -> None:
    publish(store, checkpoint, 0, rows(0))
    with pytest.raises(RolloutsError, match=f"field {field}"):
        publish(store, checkpoint, 1, rows(1), **change)
    assert not store.exists(part_manifest_key(RUN, STEP, 1))


@BAD("a sample id another part of the step holds (client)")
def test_a_sample_of_another_part_is_refused(store: ObjectStore, checkpoint: Path) -> None:
    publish(store, checkpoint, 0, rows(0))
    with pytest.raises(RolloutsError, match="sample 'p0-1': field sample_id: already published in part 0"):
        publish(store, checkpoint, 1, [ok("x"), ok("p0-1")])
    assert not store.exists(part_rollouts_key(RUN, STEP, 1))


@pytest.mark.parametrize(("items", "sample", "field", "message"), [
    pytest.param(*p.values, id=p.id) for p in BAD_ROLLOUTS])
def test_a_part_is_validated_like_a_whole_step(store: ObjectStore, checkpoint: Path, items, sample, field,
                                               message) -> None:
    with pytest.raises(RolloutsError) as refused:
        publish(store, checkpoint, 0, items)
    assert message in str(refused.value)
    assert (refused.value.sample, refused.value.field) == (sample, field)
    assert stored_files(store) == {}  # not even the checkpoint went up


@pytest.mark.parametrize("part", [-1, 10_000, True, "1"])
def test_a_part_number_out_of_range_is_refused(store: ObjectStore, checkpoint: Path, part) -> None:
    with pytest.raises(RolloutsError, match="field part"):
        publish(store, checkpoint, part, rows(0))


def test_a_part_whose_file_was_changed_is_refused_on_read(store: ObjectStore, checkpoint: Path) -> None:
    publish(store, checkpoint, 0, rows(0))
    publish(store, checkpoint, 1, rows(1))
    store.write_bytes(part_rollouts_key(RUN, STEP, 0), store.read_bytes(part_rollouts_key(RUN, STEP, 1)))

    with pytest.raises(RolloutsError, match="do not match the digest of its manifest"):
        commit_rollouts_parts(store, RUN, STEP)
    assert not is_committed(store, RUN, STEP)


def test_progress_is_the_share_of_the_expected_rollouts(store: ObjectStore, checkpoint: Path) -> None:
    publish(store, checkpoint, 0, rows(0, 3))
    publish(store, checkpoint, 1, rows(1, 1))
    manifests = parts_lib.published_parts(store, RUN, STEP)
    assert parts_lib.step_progress(manifests, 6) == pytest.approx(4 / 6)
    assert [m.response_tokens for m in manifests] == [6, 2]
    assert [m.published_at for m in manifests] == [100.0, 101.0]
