"""A step published in parts (pipeline.data.parts, through pipeline.client): parts are validated like whole
steps, idempotent, in any order, and never change a committed step; the commit lists its parts and reads
back as a step published whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import save_file

from pipeline.client import Rollout, RolloutsError, commit_rollouts_parts, publish_rollouts_part, publish_step
from pipeline.config import load_config
from pipeline.data import parts as parts_lib
from pipeline.data.keys import part_manifest_key, part_rollouts_key, parts_prefix, parts_step_key, policy_prefix
from pipeline.data.rollouts import is_committed, read_policy_pointer, read_rollouts, rollouts_table
from pipeline.data.store import ObjectStore
from pipeline.refresh.plan import qualified_parts
from tests.support.contract_cases import BAD, BAD_ROLLOUTS, LIMITS, ok

RUN, STEP = "r", 3


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
    # When the store saw each manifest, not the time its writer put in it (100.0, 101.0).
    assert [m.published_at for m in manifests] == [store.modified(part_manifest_key(RUN, STEP, p)) for p in (0, 1)]


# --- the readers check again what only the trainer's client checked ---------------------------------------------


def _qualified(store: ObjectStore) -> parts_lib.Qualified | None:
    """What the refresh sensor and the refresh read of the step (refresh.qualified_parts)."""
    refresh = {"min_share": 0.5, "min_tokens": 100}  # 3 of the 6 rollouts expected, or 100 response tokens
    return qualified_parts(store, load_config(overrides={"run": RUN, "refresh": refresh}), STEP)


def _rewrite(store: ObjectStore, key: str, **changes: object) -> None:
    store.write_json(key, {**store.read_json(key), **changes})


@pytest.mark.reliability("bad_input", "part manifests under alias names (part-1.json, part-01.json, part-².json) "
                                      "beside part-0001.json: not read, progress counted once, no reader raises")
def test_a_manifest_under_another_name_counts_no_part_twice(store: ObjectStore, checkpoint: Path) -> None:
    publish(store, checkpoint, 0, rows(0))
    publish(store, checkpoint, 1, rows(1))
    manifest = store.read_bytes(part_manifest_key(RUN, STEP, 1))
    for alias in ("part-1.json", "part-01.json", "part-00001.json", "part-².json", "part-١.json"):
        store.write_bytes(f"{parts_prefix(RUN, STEP)}/{alias}", manifest)

    assert [m.part for m in parts_lib.published_parts(store, RUN, STEP)] == [0, 1]
    assert parts_lib.step_progress(parts_lib.published_parts(store, RUN, STEP), 6) == pytest.approx(4 / 6)
    assert _qualified(store).parts == (0, 1)


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("rows", 1000, "holds 2 rollouts of 4 response tokens; its manifest claims 1000 of 2000"),
    ("response_tokens", 400, "holds 2 rollouts of 4 response tokens; its manifest claims 2 of 400"),
    ("rows", 0, "must be a positive integer"),
    ("rows", True, "must be a positive integer"),
    ("part", 7, "is not the part its name says"),
    ("step", 4, "is not this step's"),
    ("digest", "../x", "must be a sha256 in hex"),
    ("published_at", "soon", "must be a time"),
])
def test_a_manifest_claiming_what_its_rollouts_do_not_hold_qualifies_nothing(
    store: ObjectStore, checkpoint: Path, field: str, value: object, problem: str, reliability
) -> None:
    """A manifest that claims 1,000 rows over 2 rollouts would qualify the step for a refresh on its own: the
    readers count the rollouts themselves, and refuse the part naming its file and the field."""
    reliability.bad_input(f"a part manifest whose {field} is {value!r}: refused by the readers, nothing qualifies")
    publish(store, checkpoint, 0, rows(0))
    changes = {field: value}
    if field == "rows" and value == 1000:
        changes["response_tokens"] = 2000
    _rewrite(store, part_manifest_key(RUN, STEP, 0), **changes)

    with pytest.raises(RolloutsError, match=f"part-0000.*{re.escape(problem)}"):
        _qualified(store)


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("expected_rollouts", 0, "must be a positive integer"),
    ("expected_rollouts", -5, "must be a positive integer"),
    ("expected_rollouts", "8", "must be a positive integer"),
    ("expected_rollouts", 2**64, "must be a positive integer"),
    ("vocab_size", 0, "must be a positive integer"),
    ("max_positions", -1, "must be a positive integer or null"),
    ("step", 4, "is not this step's"),
    ("started_at", float("nan"), "must be a time"),
])
def test_a_step_record_out_of_its_range_is_refused_by_its_readers(
    store: ObjectStore, checkpoint: Path, field: str, value: object, problem: str, reliability
) -> None:
    """`expected_rollouts` of 0 or -5 qualified a step at once and then divided by zero."""
    reliability.bad_input(f"a step record (parts/_step.json) whose {field} is {value!r}: refused by its readers")
    publish(store, checkpoint, 0, rows(0))
    _rewrite(store, parts_step_key(RUN, STEP), **{field: value})

    with pytest.raises(RolloutsError, match=f"_step.json: field {field}: {re.escape(problem)}"):
        _qualified(store)


@pytest.mark.reliability("bad_input", "a step record claiming vocab_size 10**6 over a policy of 50: readers enforce "
                                      "the policy's own limits, a token id of 999 is refused")
def test_readers_enforce_the_policys_limits_not_the_ones_the_record_claims(store: ObjectStore,
                                                                           checkpoint: Path) -> None:
    publish(store, checkpoint, 0, rows(0))
    publish(store, checkpoint, 1, rows(1))
    _rewrite(store, parts_step_key(RUN, STEP), vocab_size=10**6)
    outside = [ok("p0-0", input_ids=[1, 999, 3]), ok("p0-1")]  # written past the client, manifest to match
    with store.open_write(part_rollouts_key(RUN, STEP, 0)) as f:
        pq.write_table(rollouts_table(outside), f)
    _rewrite(store, part_manifest_key(RUN, STEP, 0), digest=parts_lib.content_digest(outside))

    with pytest.raises(RolloutsError, match="part-0000.parquet: sample 'p0-0': field input_ids: .*50"):
        _qualified(store)


@pytest.mark.reliability("bad_input", "a part written after its step's commit, past the client: not one of the "
                                      "step's parts for any reader")
def test_a_part_written_after_the_commit_is_not_one_of_the_steps_parts(store: ObjectStore, checkpoint: Path) -> None:
    publish(store, checkpoint, 0, rows(0))
    publish(store, checkpoint, 1, rows(1))
    commit_rollouts_parts(store, RUN, STEP)
    late = rows(9)
    with store.open_write(part_rollouts_key(RUN, STEP, 9)) as f:
        pq.write_table(rollouts_table(late), f)
    store.write_json(part_manifest_key(RUN, STEP, 9), parts_lib.PartManifest(
        STEP, 9, 2, 4, parts_lib.content_digest(late), 200.0).to_json())

    assert [m.part for m in parts_lib.published_parts(store, RUN, STEP)] == [0, 1]


@pytest.mark.parametrize("field", ["started_at", "published_at"])
def test_a_time_of_hundreds_of_digits_refuses_its_step_and_no_other(
    store: ObjectStore, checkpoint: Path, field: str, reliability
) -> None:
    """math.isfinite raised OverflowError on it, past the refresh sensor's catch of a step's bad files: one open
    step's record stopped every tick. Now it is a bad value like any other, refused naming the file and field."""
    reliability.bad_input(f"an open step's {field} of 400 digits: that step refused naming the file and field, the "
                          "other open steps still qualify")
    for step in (STEP, STEP + 1):
        for part in (0, 1):
            publish_rollouts_part(store, RUN, step, part, rows(part), checkpoint, policy_version=2, model_id="tiny",
                                  expected_rollouts=6, now=100.0 + part)
    key = parts_step_key(RUN, STEP) if field == "started_at" else part_manifest_key(RUN, STEP, 0)
    _rewrite(store, key, **{field: 10**400})

    with pytest.raises(RolloutsError, match=f"{re.escape(key)}: field {field}: must be a time in epoch seconds"):
        _qualified(store)
    cfg = load_config(overrides={"run": RUN, "refresh": {"min_share": 0.5}})
    assert qualified_parts(store, cfg, STEP + 1).parts == (0, 1)
