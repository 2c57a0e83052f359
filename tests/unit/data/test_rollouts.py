"""The rollouts contract (pipeline.data.rollouts) and RL step keys (pipeline.data.keys)."""

from __future__ import annotations

import functools
import io
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import keys as steps
from pipeline.data.keys import POLICY_FILE, ROLLOUTS_FILE, parse_step_key, rollouts_prefix, step_key
from pipeline.data.rollouts import (
    ROLLOUTS_SCHEMA,
    PolicyPointer,
    Rollout,
    RolloutsError,
    is_committed,
    is_held_out,
    read_policy_pointer,
    read_rollouts,
    write_rollouts,
)
from pipeline.data.store import ObjectStore

RUN = "r"
STEP = 3
POINTER = PolicyPointer(policy_version=3, checkpoint_uri="policies/r/step-000003", model_id="tiny")


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore((tmp_path / "store").as_uri())


def rollouts(n: int = 4) -> list[Rollout]:
    return [
        Rollout(f"id-{i}", [1, 2 + i, 3, 4, 5][: 3 + i % 3], [0, 1, 1, 1, 1][: 3 + i % 3], 0.25 * i, 3)
        for i in range(n)
    ]


def rows_of(items: list[Rollout]) -> list[dict]:
    return [dict(r.__dict__) for r in items]


def write_parquet(store: ObjectStore, rows: list[dict], schema: pa.Schema) -> None:
    """Write a rollouts file by hand, as an external trainer would (bypassing write_rollouts' checks)."""
    table = pa.Table.from_pylist(rows, schema=schema)
    with store.open_write(f"{rollouts_prefix(RUN, STEP)}/{ROLLOUTS_FILE}") as f:
        pq.write_table(table, f)


# -- write / read -----------------------------------------------------------------------------------------------


def test_round_trip(store: ObjectStore) -> None:
    items = rollouts(5)

    uri = write_rollouts(store, RUN, STEP, items, POINTER)

    assert uri == store.uri(f"rollouts/{RUN}/step-000003/{ROLLOUTS_FILE}")
    assert read_rollouts(store, RUN, STEP) == items
    assert read_policy_pointer(store, RUN, STEP) == POINTER
    table = pq.read_table(io.BytesIO(store.read_bytes(f"rollouts/{RUN}/step-000003/{ROLLOUTS_FILE}")))
    assert table.schema.metadata[b"schema_version"] == b"1"
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.int8())


def test_prompt_len() -> None:
    assert Rollout("a", [1, 2, 3, 4], [0, 0, 1, 1], 0.0, 0).prompt_len == 2
    assert Rollout("a", [1, 2, 3], [0, 0, 0], 0.0, 0).prompt_len == 3
    assert Rollout("a", [1, 2], [1, 1], 0.0, 0).prompt_len == 0


def test_is_committed_only_once_policy_json_exists(store: ObjectStore) -> None:
    assert not is_committed(store, RUN, STEP)
    write_parquet(store, rows_of(rollouts()), ROLLOUTS_SCHEMA)  # rollouts written, no commit point yet
    assert not is_committed(store, RUN, STEP)

    write_rollouts(store, RUN, STEP, rollouts(), POINTER)

    assert is_committed(store, RUN, STEP)
    assert store.exists(f"{rollouts_prefix(RUN, STEP)}/{POLICY_FILE}")
    assert not is_committed(store, RUN, STEP + 1)


def test_read_missing_file_names_it(store: ObjectStore) -> None:
    with pytest.raises(RolloutsError, match="step-000003/rollouts.parquet: not found"):
        read_rollouts(store, RUN, STEP)


def test_missing_column_is_named(store: ObjectStore) -> None:
    schema = pa.schema([f for f in ROLLOUTS_SCHEMA if f.name != "reward"], metadata={"schema_version": "1"})
    rows = [{k: v for k, v in row.items() if k != "reward"} for row in rows_of(rollouts())]
    write_parquet(store, rows, schema)

    with pytest.raises(RolloutsError, match=r"missing column\(s\) reward"):
        read_rollouts(store, RUN, STEP)


def test_wrong_column_type_is_reported(store: ObjectStore) -> None:
    schema = pa.schema(
        [pa.field("sample_id", pa.string()), pa.field("input_ids", pa.list_(pa.string())),
         *[f for f in ROLLOUTS_SCHEMA if f.name not in ("sample_id", "input_ids")]],
        metadata={"schema_version": "1"},
    )
    rows = [{**row, "input_ids": ["a", "b"], "loss_mask": [0, 1]} for row in rows_of(rollouts(2))]
    write_parquet(store, rows, schema)

    with pytest.raises(RolloutsError, match="column types do not match"):
        read_rollouts(store, RUN, STEP)


@pytest.mark.parametrize(
    ("metadata", "found"),
    [
        pytest.param({"schema_version": "2"}, "'2'", id="version-2"),
        pytest.param({"schema_version": "0"}, "'0'", id="version-0"),
        pytest.param(None, "'?'", id="no-version"),
    ],
)
@pytest.mark.reliability("bad_input", "rollouts file from a different schema version")
def test_other_schema_version_is_rejected(store: ObjectStore, metadata: dict | None, found: str) -> None:
    write_parquet(store, rows_of(rollouts()), ROLLOUTS_SCHEMA.remove_metadata().with_metadata(metadata or {}))

    with pytest.raises(RolloutsError, match=re.escape(f"schema_version {found}, this pipeline reads 1")):
        read_rollouts(store, RUN, STEP)


BAD = functools.partial(pytest.mark.reliability, "bad_input")

BAD_ROLLOUTS = [
    pytest.param(
        [Rollout("a", [1, 2, 3], [0, 1], 1.0, 0)], "sample 'a' has 3 input_ids but 2 loss_mask values",
        id="mask-length", marks=BAD("loss mask and token ids of different lengths (rollouts)"),
    ),
    pytest.param(
        [Rollout("a", [1, 2], [0, 1], 1.0, 0), Rollout("a", [3, 4], [0, 1], 1.0, 0)], "duplicate sample_id 'a'",
        id="duplicate-ids", marks=BAD("duplicate sample ids (rollouts)"),
    ),
    pytest.param([], "empty step", id="empty", marks=BAD("empty step (rollouts)")),
    pytest.param([Rollout("a", [1], [1], 1.0, 0)], "sample 'a' has fewer than 2 tokens", id="one-token"),
    pytest.param(
        [Rollout("a", [1, 2], [0, 2], 1.0, 0)], "sample 'a' has a loss_mask value other than 0/1", id="mask-2"
    ),
    pytest.param([Rollout("a", [1, -2], [0, 1], 1.0, 0)], "sample 'a' has a negative token id", id="negative-id"),
]


@pytest.mark.parametrize(("items", "message"), BAD_ROLLOUTS)
def test_write_rejects_bad_rollouts_before_writing(
    store: ObjectStore, tmp_path: Path, items: list[Rollout], message: str
) -> None:
    with pytest.raises(RolloutsError, match=re.escape(message)):
        write_rollouts(store, RUN, STEP, items, POINTER)

    assert not is_committed(store, RUN, STEP)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(("items", "message"), BAD_ROLLOUTS)
def test_read_rejects_bad_rollouts_from_an_external_writer(
    store: ObjectStore, items: list[Rollout], message: str
) -> None:
    write_parquet(store, rows_of(items), ROLLOUTS_SCHEMA)

    with pytest.raises(RolloutsError, match=re.escape(message)) as excinfo:
        read_rollouts(store, RUN, STEP)
    assert "rollouts/r/step-000003/rollouts.parquet" in str(excinfo.value)


# -- policy pointer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pointer", "message"),
    [
        pytest.param({"schema_version": 1, "policy_version": 1, "model_id": "m"}, "missing key(s) checkpoint_uri",
                     id="missing-key"),
        pytest.param({"schema_version": 2, "policy_version": 1, "model_id": "m", "checkpoint_uri": "x"},
                     "schema_version 2, expected 1", id="other-version"),
    ],
)
def test_bad_policy_pointer(store: ObjectStore, pointer: dict, message: str) -> None:
    store.write_json(f"{rollouts_prefix(RUN, STEP)}/{POLICY_FILE}", pointer)
    with pytest.raises(RolloutsError, match=re.escape(message)):
        read_policy_pointer(store, RUN, STEP)


# -- held-out split ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.05, 0.125, 0.5, 0.9])
def test_is_held_out_is_deterministic_and_close_to_the_fraction(fraction: float) -> None:
    sample_ids = [f"step-{i // 100}-rollout-{i}" for i in range(10_000)]

    first = [is_held_out(s, fraction) for s in sample_ids]
    second = [is_held_out(s, fraction) for s in sample_ids]

    assert first == second
    assert sum(first) / len(first) == pytest.approx(fraction, abs=0.02)


def test_held_out_sets_grow_with_the_fraction() -> None:
    sample_ids = [f"sample-{i}" for i in range(2000)]
    small = {s for s in sample_ids if is_held_out(s, 0.1)}
    large = {s for s in sample_ids if is_held_out(s, 0.3)}
    assert small < large


# -- step keys --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 42, 123, 999_999, 1_000_000, 12_345_678])
def test_step_key_round_trip(step: int) -> None:
    key = step_key(step)
    assert re.fullmatch(r"step-\d{6,}", key)
    assert parse_step_key(key) == step


def test_step_key_format() -> None:
    assert step_key(123) == "step-000123"
    assert step_key(1_234_567) == "step-1234567"
    assert steps.hidden_states_prefix("run", 5) == "hidden_states/run/step-000005"
    assert steps.buffer_key("run", 5) == "buffer/run/step-000005/_manifest.json"
    assert steps.acceptance_key("run", 5) == "acceptance/run/step-000005.json"


def test_step_key_rejects_negative_steps() -> None:
    with pytest.raises(ValueError, match="-1"):
        step_key(-1)


@pytest.mark.parametrize(
    "key",
    ["step-12", "step-0001a", "123", "step-000001,step-000002", "", "step-", "Step-000001", " step-000001",
     "step--00001", "step-000001 "],
)
@pytest.mark.reliability("bad_input", "partition key that is not `step-` plus digits")
def test_parse_step_key_rejects(key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(key))):
        parse_step_key(key)


@pytest.mark.parametrize("key", ["step-000001\n", "step-\u0661\u0662\u0663\u0664\u0665\u0666", "step-0000001"],
                         ids=["trailing-newline", "arabic-indic-digits", "extra-leading-zero"])
@pytest.mark.reliability("bad_input", "partition key that is not `step-` plus digits")
def test_parse_step_key_rejects_near_misses(key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(key))):
        parse_step_key(key)
