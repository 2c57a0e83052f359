"""The rollouts contract (pipeline.data.rollouts) and RL step keys (pipeline.data.keys)."""

from __future__ import annotations

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
    committed_steps,
    is_committed,
    read_policy_pointer,
    read_rollouts,
    write_rollouts,
)
from pipeline.data.store import ObjectStore
from tests.support.contract_cases import BAD, BAD_ROLLOUTS, LIMITS

RUN = "r"
STEP = 3
POINTER = PolicyPointer(policy_version=3, checkpoint_uri="policies/r/step-000003", model_id="tiny")


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

    with pytest.raises(RolloutsError, match="does not match the rollouts schema"):
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


def assert_names(exc: RolloutsError, sample: str | None, field: str | None, message: str) -> None:
    assert "rollouts/r/step-000003/" in exc.where
    assert (exc.sample, exc.field) == (sample, field)
    assert message in str(exc)


@pytest.mark.parametrize(("items", "sample", "field", "message"), BAD_ROLLOUTS)
def test_write_rejects_bad_rollouts_before_writing(
    store: ObjectStore, tmp_path: Path, items: list[Rollout], sample: str | None, field: str | None, message: str
) -> None:
    with pytest.raises(RolloutsError) as excinfo:
        write_rollouts(store, RUN, STEP, items, POINTER, LIMITS)

    assert_names(excinfo.value, sample, field, message)
    assert not is_committed(store, RUN, STEP)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(("items", "sample", "field", "message"), BAD_ROLLOUTS)
def test_read_rejects_bad_rollouts_from_an_external_writer(
    store: ObjectStore, items: list[Rollout], sample: str | None, field: str | None, message: str
) -> None:
    write_parquet(store, rows_of(items), ROLLOUTS_SCHEMA)

    with pytest.raises(RolloutsError) as excinfo:
        read_rollouts(store, RUN, STEP, LIMITS)
    assert_names(excinfo.value, sample, field, message)


def write_file(store: ObjectStore, name: str, data: bytes) -> None:
    store.write_bytes(f"{rollouts_prefix(RUN, STEP)}/{name}", data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b"", "empty file (0 bytes)", id="empty", marks=BAD("empty rollouts.parquet (0 bytes)")),
        pytest.param(b"PAR1 this is not parquet PAR1", "not a readable Parquet file", id="garbage",
                     marks=BAD("corrupt rollouts.parquet")),
    ],
)
def test_corrupt_parquet_is_a_named_error(store: ObjectStore, data: bytes, message: str) -> None:
    write_file(store, ROLLOUTS_FILE, data)

    with pytest.raises(RolloutsError, match=re.escape(message)) as excinfo:
        read_rollouts(store, RUN, STEP)
    assert excinfo.value.where.endswith("rollouts/r/step-000003/rollouts.parquet")


def test_truncated_parquet_is_a_named_error(store: ObjectStore) -> None:
    write_parquet(store, rows_of(rollouts()), ROLLOUTS_SCHEMA)
    key = f"{rollouts_prefix(RUN, STEP)}/{ROLLOUTS_FILE}"
    write_file(store, ROLLOUTS_FILE, store.read_bytes(key)[:-40])

    with pytest.raises(RolloutsError, match="not a readable Parquet file"):
        read_rollouts(store, RUN, STEP)


NULLABLE = pa.schema([f.with_nullable(True) for f in ROLLOUTS_SCHEMA], metadata={"schema_version": "1"})


@pytest.mark.parametrize(
    ("row", "sample", "field", "message"),
    [
        pytest.param({"reward": None}, "id-1", "reward", "null value", id="reward"),
        pytest.param({"policy_version": None}, "id-1", "policy_version", "null value", id="policy-version"),
        pytest.param({"input_ids": None, "loss_mask": None}, "id-1", "input_ids", "null value", id="input-ids"),
        pytest.param({"input_ids": [1, None, 3]}, "id-1", "input_ids", "null inside the list", id="null-token"),
        pytest.param({"sample_id": None}, "row 1", "sample_id", "null value", id="sample-id"),
    ],
)
@pytest.mark.reliability("bad_input", "null values in rollouts.parquet")
def test_nulls_are_refused_naming_the_sample_and_field(
    store: ObjectStore, row: dict, sample: str, field: str, message: str
) -> None:
    rows = rows_of(rollouts(3))
    rows[1].update(row)
    write_parquet(store, rows, NULLABLE)

    with pytest.raises(RolloutsError) as excinfo:
        read_rollouts(store, RUN, STEP)
    assert_names(excinfo.value, sample, field, message)


@pytest.mark.parametrize(
    ("field", "arrow_type", "value"),
    [
        pytest.param("policy_version", pa.bool_(), True, id="bool-version"),
        pytest.param("policy_version", pa.float64(), 2.5, id="fractional-version"),
        pytest.param("loss_mask", pa.list_(pa.bool_()), [False, True, True], id="bool-mask"),
    ],
)
@pytest.mark.reliability("bad_input", "boolean or fractional column where the contract has integers (rollouts)")
def test_booleans_and_fractions_are_not_cast_to_integers(
    store: ObjectStore, field: str, arrow_type: pa.DataType, value: object
) -> None:
    schema = pa.schema([pa.field(f.name, arrow_type) if f.name == field else f for f in ROLLOUTS_SCHEMA],
                       metadata={"schema_version": "1"})
    write_parquet(store, [{**row, field: value} for row in rows_of(rollouts(2))], schema)

    with pytest.raises(RolloutsError, match="does not match the rollouts schema") as excinfo:
        read_rollouts(store, RUN, STEP)
    assert excinfo.value.field == field


@pytest.mark.reliability("bad_input", "token id too large for int32 (rollouts)")
def test_token_ids_that_do_not_fit_int32_are_refused(store: ObjectStore) -> None:
    schema = pa.schema([pa.field("input_ids", pa.list_(pa.int64())) if f.name == "input_ids" else f
                        for f in ROLLOUTS_SCHEMA], metadata={"schema_version": "1"})
    write_parquet(store, [{**row, "input_ids": [1, 2**40, 3][: len(row["input_ids"])]}
                          for row in rows_of(rollouts(2))], schema)

    with pytest.raises(RolloutsError, match="values do not fit") as excinfo:
        read_rollouts(store, RUN, STEP)
    assert excinfo.value.field == "input_ids"


# -- policy pointer ---------------------------------------------------------------------------------------------


GOOD_POINTER = {"schema_version": 1, "policy_version": 1, "model_id": "m", "checkpoint_uri": "policies/x"}


@pytest.mark.parametrize(
    ("pointer", "field", "message"),
    [
        pytest.param({"schema_version": 1, "policy_version": 1, "model_id": "m"}, None,
                     "missing key(s) checkpoint_uri", id="missing-key"),
        pytest.param({**GOOD_POINTER, "schema_version": 2}, "schema_version", "schema_version 2, expected 1",
                     id="other-version"),
        pytest.param({**GOOD_POINTER, "policy_version": -1}, "policy_version", "-1 is outside", id="negative",
                     marks=BAD("negative policy_version (policy.json)")),
        pytest.param({**GOOD_POINTER, "policy_version": 1.5}, "policy_version", "got 1.5", id="fractional",
                     marks=BAD("fractional policy_version (policy.json)")),
        pytest.param({**GOOD_POINTER, "policy_version": True}, "policy_version", "got True", id="bool",
                     marks=BAD("boolean policy_version (policy.json)")),
        pytest.param({**GOOD_POINTER, "policy_version": "3"}, "policy_version", "got a str", id="string-version",
                     marks=BAD("policy.json value of the wrong type")),
        pytest.param({**GOOD_POINTER, "policy_version": 2**63}, "policy_version", "outside [0, 2**63 - 1]",
                     id="beyond-int64", marks=BAD("policy_version too large for int64 (policy.json)")),
        pytest.param({**GOOD_POINTER, "checkpoint_uri": 7}, "checkpoint_uri", "non-empty string, got int",
                     id="uri-not-a-string", marks=BAD("policy.json value of the wrong type")),
        pytest.param([GOOD_POINTER], None, "must hold a JSON object, got list", id="a-list",
                     marks=BAD("policy.json value of the wrong type")),
        pytest.param({**GOOD_POINTER, "sampling": {"temperature": 10**400}}, "sampling",
                     "sampling.temperature must be a finite number", id="temperature-400-digits",
                     marks=BAD("policy.json sampling.temperature of 400 digits: refused naming the file and field, "
                               "never OverflowError")),
        pytest.param({**GOOD_POINTER, "sampling": {"top_p": 10**400}}, "sampling",
                     "sampling.top_p must be a finite number", id="top-p-400-digits",
                     marks=BAD("policy.json sampling.top_p of 400 digits: refused naming the file and field, "
                               "never OverflowError")),
        pytest.param({**GOOD_POINTER, "sampling": {"top_p": 1e-300}}, "sampling",
                     "sampling.top_p must be in (0, 1] in float32", id="top-p-zero-in-float32",
                     marks=BAD("policy.json sampling.top_p of 1e-300 (valid in float64, 0 in the float32 sampler): "
                               "refused naming the file and field")),
    ],
)
def test_bad_policy_pointer(store: ObjectStore, pointer: object, field: str | None, message: str) -> None:
    store.write_json(f"{rollouts_prefix(RUN, STEP)}/{POLICY_FILE}", pointer)
    with pytest.raises(RolloutsError, match=re.escape(message)) as excinfo:
        read_policy_pointer(store, RUN, STEP)
    assert excinfo.value.field == field
    assert excinfo.value.where.endswith("rollouts/r/step-000003/policy.json")


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe"], ids=["broken", "empty", "not-utf8"])
@pytest.mark.reliability("bad_input", "policy.json that is not JSON")
def test_policy_pointer_that_is_not_json(store: ObjectStore, data: bytes) -> None:
    write_file(store, POLICY_FILE, data)
    with pytest.raises(RolloutsError, match="policy.json: not JSON"):
        read_policy_pointer(store, RUN, STEP)


def test_policy_pointer_errors_do_not_echo_the_uri(store: ObjectStore) -> None:
    secret = "s3://AKIAEXAMPLE:hunter2@bucket/x"
    store.write_json(f"{rollouts_prefix(RUN, STEP)}/{POLICY_FILE}", {**GOOD_POINTER, "checkpoint_uri": secret,
                                                                     "policy_version": "x"})
    with pytest.raises(RolloutsError) as excinfo:
        read_policy_pointer(store, RUN, STEP)
    assert "hunter2" not in str(excinfo.value)


# -- step keys --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 42, 123, 999_999, 1_000_000, 12_345_678, 2**63 - 1])
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
    assert steps.hidden_states_shard_key("run", 5, "part-00000-ab.arrow") == \
        "hidden_states/run/step-000005/part-00000-ab.arrow"
    assert steps.layout_key("run") == "hidden_states/run/_target_layout.json"


def test_step_key_rejects_negative_steps() -> None:
    with pytest.raises(ValueError, match="-1"):
        step_key(-1)


@pytest.mark.reliability("bad_input", "step number too large for int64")
def test_steps_beyond_int64_are_refused(store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="too large for int64"):
        step_key(2**63)
    with pytest.raises(ValueError, match="step too large for int64"):
        parse_step_key("step-9223372036854775808")
    store.write_bytes("rollouts/r/step-9223372036854775808/policy.json", b"{}")
    store.write_bytes("rollouts/r/step-9223372036854775808/rollouts.parquet", b"")
    assert committed_steps(store, RUN) == []  # never a partition: Dagster and the int64 columns could not hold it


@pytest.mark.reliability("bad_input", "step directories named beyond int64, or by thousands of digits: reported as "
                                      "malformed, never an error")
def test_step_names_beyond_int64_are_malformed_not_errors() -> None:
    huge = ["step-9223372036854775808", "step-99999999999999999999", "step-" + "9" * 5000, "step-" + "0" * 4990 + "1"]
    assert steps.malformed_step_names(["step-000001", *huge, "notes"]) == huge
    assert not any(steps.is_step_key(name) for name in huge)
    assert steps.is_step_key("step-9223372036854775807")
    with pytest.raises(ValueError, match="too large for int64"):
        parse_step_key(huge[2])


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


@pytest.mark.parametrize("digits", [4000, 5000])
@pytest.mark.reliability("bad_input", "policy.json with a number thousands of digits long: refused naming the file "
                                      "and field, the number not echoed")
def test_a_number_thousands_of_digits_long_is_refused_by_name(store: ObjectStore, digits: int) -> None:
    huge = "1" + "0" * (digits - 1)
    store.write_bytes(f"rollouts/{RUN}/step-{STEP:06d}/policy.json", (
        f'{{"schema_version": 1, "policy_version": {huge}, "model_id": "m", "checkpoint_uri": "policies/x"}}'
    ).encode())
    with pytest.raises(RolloutsError, match=f"step-{STEP:06d}/policy.json") as failure:
        read_policy_pointer(store, RUN, STEP)
    assert len(str(failure.value)) < 300
    if digits < 4300:
        assert "policy_version" in str(failure.value)
        assert "a 13285-bit integer is outside" in str(failure.value)
