"""Rollouts of one RL step: the contract between an RL trainer and this pipeline.

    <root>/rollouts/<run>/step-000123/
    ├── rollouts.parquet   one row per rollout (schema below)
    └── policy.json        written LAST: the step is complete once it exists

rollouts.parquet (file metadata `schema_version` = "1"), no nulls anywhere:
    sample_id       string        unique within the step, not empty
    input_ids       list<int32>   prompt + response token ids, no padding; each in [0, vocab_size)
    loss_mask       list<int8>    1 on response tokens, 0 on prompt tokens; same length; at least one 1
    reward          float32       finite
    policy_version  int64         >= 0: version of the policy that generated the rollout

policy.json:
    {"schema_version": 1, "policy_version": 123, "model_id": "...",
     "checkpoint_uri": "s3://.../step-000123"  (or a key relative to the store root),
     "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    The checkpoint is a transformers directory: config.json + safetensors weights. `sampling`
    (optional: pipeline/sampling.py) is how the rollouts were sampled; every tau of the
    step is measured at it (without it, at `eval.sampling`).

The validators below are the contract: the pipeline runs them on what it reads and the
trainer-side client (`pipeline/client.py`) runs the same ones before it writes, so a trainer
hears of a mistake when it makes it. Each refusal is a `RolloutsError` naming the file, the
sample and the field; values a trainer sent are echoed only where they cannot be a secret
(numbers, sample ids), never a URI.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.keys import MAX_STEP, parse_step_key, policy_pointer_key, rollouts_key, rollouts_root
from pipeline.data.store import ObjectStore
from pipeline.sampling import SamplingError, SamplingParams

SCHEMA_VERSION = 1
INT64_MAX = MAX_STEP

ROLLOUTS_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("reward", pa.float32()),
        ("policy_version", pa.int64()),
    ],
    metadata={"schema_version": str(SCHEMA_VERSION)},
)
POINTER_FIELDS = ("policy_version", "checkpoint_uri", "model_id")


class RolloutsError(ValueError):
    """A rollouts file or policy pointer breaks the contract; the message says the file, the sample and the field."""

    def __init__(self, where: str, problem: str, sample: str | None = None, field: str | None = None) -> None:
        self.where, self.problem, self.sample, self.field = where, problem, sample, field
        parts = [where]
        if sample is not None:
            parts.append(f"sample {sample!r}")
        if field is not None:
            parts.append(f"field {field}")
        super().__init__(f"{': '.join(parts)}: {problem}")


@dataclass(frozen=True)
class Rollout:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    reward: float
    policy_version: int

    @classmethod
    def from_prompt_and_response(
        cls, sample_id: str, prompt_ids: Sequence[int], response_ids: Sequence[int], reward: float,
        policy_version: int,
    ) -> Rollout:
        """One rollout from unpadded prompt and response ids: the mask is 1 exactly on the response."""
        prompt, response = [int(t) for t in prompt_ids], [int(t) for t in response_ids]
        return cls(sample_id, prompt + response, [0] * len(prompt) + [1] * len(response), float(reward),
                   int(policy_version))

    @property
    def prompt_len(self) -> int:
        """Tokens before the first response token."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)


@dataclass(frozen=True)
class PolicyPointer:
    policy_version: int
    checkpoint_uri: str
    model_id: str
    sampling: SamplingParams | None = None  # how the rollouts were sampled; None: the trainer did not say


@dataclass(frozen=True)
class TargetLimits:
    """What the policy that reads the rollouts accepts: token ids below `vocab_size`, at most
    `max_positions` tokens per sequence."""

    vocab_size: int
    max_positions: int | None = None

    @classmethod
    def of(cls, config: Any) -> TargetLimits:
        """From a transformers config (its text config for multimodal families), or anything with
        `vocab_size` and `max_position_embeddings`."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(int(config.vocab_size), getattr(config, "max_position_embeddings", None))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value for a message: an integer far beyond int64 by its size, not its digits (a trainer's number of
    thousands of digits makes no message, and past 4300 digits Python refuses to print it)."""
    if _is_int(value) and not -(2**64) < value < 2**64:
        return f"a {value.bit_length()}-bit integer"
    return repr(value)


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite JSON number; None for anything else: a bool, a string, NaN, an
    infinity, or an integer of hundreds of digits (float() and math.isfinite raise OverflowError on it, which no
    caller expects of a bad value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def check_policy_version(value: Any, where: str, sample: str | None = None) -> int:
    """A non-negative integer that fits int64 (booleans and fractions are refused, not rounded)."""
    if not _is_int(value):
        shown = repr(value) if isinstance(value, (bool, float, type(None))) else f"a {type(value).__name__}"
        raise RolloutsError(where, f"must be a non-negative integer, got {shown}", sample, "policy_version")
    if not 0 <= value <= INT64_MAX:
        raise RolloutsError(where, f"{_shown(value)} is outside [0, 2**63 - 1]", sample, "policy_version")
    return value


def check_step(step: Any, where: str) -> int:
    """An RL step number: an integer in [0, 2**63 - 1] (it becomes a partition key and an int64)."""
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        raise RolloutsError(where, f"RL step must be an integer in [0, 2**63 - 1], got {_shown(step)}", None, "step")
    return step


def validate_rollout(r: Rollout, where: str, limits: TargetLimits | None = None) -> None:
    """One rollout against the contract (and the target's limits when they are known)."""
    sid = r.sample_id
    if not isinstance(sid, str) or not sid:
        raise RolloutsError(where, "must be a non-empty string", str(sid), "sample_id")
    for name in ("input_ids", "loss_mask"):
        value = getattr(r, name)
        if not isinstance(value, (list, tuple)):
            raise RolloutsError(where, f"must be a list of integers, got {type(value).__name__}", sid, name)
        bad = next((i for i, t in enumerate(value) if not _is_int(t)), None)
        if bad is not None:
            raise RolloutsError(where, f"position {bad} holds {value[bad]!r}, not an integer", sid, name)
    if len(r.input_ids) != len(r.loss_mask):
        raise RolloutsError(where, f"{len(r.loss_mask)} values for {len(r.input_ids)} input_ids", sid, "loss_mask")
    if len(r.input_ids) < 2:
        raise RolloutsError(where, f"{len(r.input_ids)} token(s), fewer than 2", sid, "input_ids")
    bad = next((i for i, m in enumerate(r.loss_mask) if m not in (0, 1)), None)
    if bad is not None:
        raise RolloutsError(where, f"value {r.loss_mask[bad]} at position {bad} is not 0/1", sid, "loss_mask")
    if 1 not in r.loss_mask:
        raise RolloutsError(where, "all zeros (no response token)", sid, "loss_mask")
    low = min(r.input_ids)
    if low < 0:
        raise RolloutsError(where, f"negative token id {low} at position {r.input_ids.index(low)}", sid, "input_ids")
    high = max(r.input_ids)
    if limits is not None and high >= limits.vocab_size:
        raise RolloutsError(where, f"token id {high} at position {r.input_ids.index(high)} is not below the "
                                   f"vocabulary size {limits.vocab_size}", sid, "input_ids")
    if limits is None and high > 2**31 - 1:
        raise RolloutsError(where, f"token id {high} does not fit int32", sid, "input_ids")
    if limits is not None and limits.max_positions is not None and len(r.input_ids) > limits.max_positions:
        raise RolloutsError(where, f"{len(r.input_ids)} tokens, more than the target's {limits.max_positions} "
                                   "positions", sid, "input_ids")
    if finite_number(r.reward) is None:
        shown = _shown(r.reward) if isinstance(r.reward, (int, float, type(None))) else type(r.reward).__name__
        raise RolloutsError(where, f"must be a finite number, got {shown}", sid, "reward")
    check_policy_version(r.policy_version, where, sid)


def validate_rollouts(rollouts: Sequence[Rollout], where: str, limits: TargetLimits | None = None) -> None:
    if not rollouts:
        raise RolloutsError(where, "no rollouts (empty step)")
    seen: set[str] = set()
    for r in rollouts:
        validate_rollout(r, where, limits)
        if r.sample_id in seen:
            raise RolloutsError(where, "duplicate within the step", r.sample_id, "sample_id")
        seen.add(r.sample_id)


def pointer_record(pointer: PolicyPointer) -> dict[str, Any]:
    """policy.json's content for a pointer."""
    record = {"schema_version": SCHEMA_VERSION, "policy_version": pointer.policy_version,
              "checkpoint_uri": pointer.checkpoint_uri, "model_id": pointer.model_id}
    if pointer.sampling is not None:
        record["sampling"] = pointer.sampling.to_json()
    return record


def validate_pointer(data: Any, where: str) -> PolicyPointer:
    """policy.json's parsed content -> the pointer; wrong keys, versions or types are refused."""
    if not isinstance(data, dict):
        raise RolloutsError(where, f"must hold a JSON object, got {type(data).__name__}")
    missing = [k for k in POINTER_FIELDS if k not in data]
    if missing:
        raise RolloutsError(where, f"missing key(s) {', '.join(missing)}")
    found = data.get("schema_version")
    if found != SCHEMA_VERSION or isinstance(found, bool):
        raise RolloutsError(where, f"schema_version {_shown(found)}, expected {SCHEMA_VERSION}", None, "schema_version")
    version = check_policy_version(data["policy_version"], where)
    for key in ("checkpoint_uri", "model_id"):
        if not isinstance(data[key], str) or not data[key]:
            raise RolloutsError(where, f"must be a non-empty string, got {type(data[key]).__name__}", None, key)
    sampling = None
    if data.get("sampling") is not None:
        try:
            sampling = SamplingParams.from_json(data["sampling"], where)
        except SamplingError as exc:
            raise RolloutsError(where, str(exc).removeprefix(f"{where}: "), None, "sampling") from None
    return PolicyPointer(version, data["checkpoint_uri"], data["model_id"], sampling)


def rollouts_table(rollouts: Sequence[Rollout]) -> pa.Table:
    return pa.Table.from_pylist([r.__dict__ for r in rollouts], schema=ROLLOUTS_SCHEMA)


def write_rollouts(store: ObjectStore, run: str, step: int, rollouts: list[Rollout], pointer: PolicyPointer,
                   limits: TargetLimits | None = None) -> str:
    """Write the step's rollouts, then its policy pointer (the commit point). Returns the parquet URI."""
    where = store.uri(rollouts_key(run, step))
    validate_rollouts(rollouts, where, limits)
    validate_pointer(pointer_record(pointer), store.uri(policy_pointer_key(run, step)))
    write_rollouts_file(store, run, step, rollouts)
    store.write_json(policy_pointer_key(run, step), pointer_record(pointer))
    return where


def write_rollouts_file(store: ObjectStore, run: str, step: int, rollouts: Sequence[Rollout]) -> None:
    """rollouts.parquet alone (no commit point); callers have validated the rollouts."""
    with store.open_write(rollouts_key(run, step)) as f:
        pq.write_table(rollouts_table(rollouts), f)


def is_committed(store: ObjectStore, run: str, step: int) -> bool:
    return store.exists(policy_pointer_key(run, step)) and store.exists(rollouts_key(run, step))


def published_at(store: ObjectStore, run: str, step: int) -> float:
    """When the trainer committed the step (its policy pointer's write), as epoch seconds."""
    return store.modified(policy_pointer_key(run, step))


def committed_digest(store: ObjectStore, run: str, step: int) -> str:
    """sha256 of the committed step as stored, its rollouts.parquet and its policy.json: what the hidden states
    extracted from it record (`rollouts_digest` in their manifest's target), so a step republished since is seen."""
    h = hashlib.sha256()
    for key in (rollouts_key(run, step), policy_pointer_key(run, step)):
        data = store.read_bytes(key)
        h.update(struct.pack("<q", len(data)))
        h.update(data)
    return h.hexdigest()


def committed_steps(store: ObjectStore, run: str) -> list[int]:
    """Steps under rollouts/<run>/ whose policy pointer (the commit point) exists."""
    steps = []
    for name in store.list_dirs(rollouts_root(run)):
        try:
            step = parse_step_key(name)
        except ValueError:
            continue  # not a step directory; the RL trainer may keep other things there
        if is_committed(store, run, step):
            steps.append(step)
    return sorted(steps)


def parse_rollouts(data: bytes, where: str, limits: TargetLimits | None = None) -> list[Rollout]:
    """rollouts.parquet's bytes -> validated rollouts."""
    if not data:
        raise RolloutsError(where, "empty file (0 bytes), not a Parquet file")
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        raise RolloutsError(where, f"not a readable Parquet file ({type(exc).__name__})") from None
    version = (table.schema.metadata or {}).get(b"schema_version", b"?").decode(errors="replace")
    if version != str(SCHEMA_VERSION):
        raise RolloutsError(where, f"schema_version {version!r}, this pipeline reads {SCHEMA_VERSION}")
    missing = [name for name in ROLLOUTS_SCHEMA.names if name not in table.column_names]
    if missing:
        raise RolloutsError(where, f"missing column(s) {', '.join(missing)}")
    table = table.select(ROLLOUTS_SCHEMA.names)
    for field in ROLLOUTS_SCHEMA:
        found = table.schema.field(field.name).type
        if found != field.type:
            if _kind(found) != _kind(field.type):  # a cast would turn booleans or fractions into integers
                raise RolloutsError(where, f"column type {found} does not match the rollouts schema's {field.type}",
                                    None, field.name)
            try:
                table = table.set_column(table.schema.get_field_index(field.name), field.name,
                                         table.column(field.name).cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise RolloutsError(where, f"column type {found} does not match the rollouts schema's "
                                           f"{field.type}: values do not fit ({type(exc).__name__})", None,
                                    field.name) from None
    _refuse_nulls(table, where)
    rollouts = [Rollout(**row) for row in table.to_pylist()]
    validate_rollouts(rollouts, where, limits)
    return rollouts


def _kind(t: pa.DataType) -> str:
    """The family a column type belongs to; widening and narrowing within one is a checked cast."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_kind(t.value_type)}>"
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "floating"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    return str(t)


def _refuse_nulls(table: pa.Table, where: str) -> None:
    sample_ids = table.column("sample_id").to_pylist()
    for name in ROLLOUTS_SCHEMA.names:
        column = table.column(name)
        nulls = column.is_null()
        if pa.types.is_list(column.type):
            flat = pa.chunked_array([c.flatten() for c in column.chunks], column.type.value_type)
            if flat.null_count:
                row = next(i for i, v in enumerate(column.to_pylist()) if v is not None and None in v)
                raise RolloutsError(where, "null inside the list", str(sample_ids[row]), name)
        if column.null_count:
            row = nulls.to_pylist().index(True)
            raise RolloutsError(where, "null value", str(sample_ids[row]) if name != "sample_id" else f"row {row}",
                                name)


def read_rollouts(store: ObjectStore, run: str, step: int, limits: TargetLimits | None = None) -> list[Rollout]:
    key = rollouts_key(run, step)
    where = store.uri(key)
    if not store.exists(key):
        raise RolloutsError(where, "not found")
    return parse_rollouts(store.read_bytes(key), where, limits)


def read_policy_pointer(store: ObjectStore, run: str, step: int) -> PolicyPointer:
    key = policy_pointer_key(run, step)
    where = store.uri(key)
    if not store.exists(key):
        raise RolloutsError(where, "not found")
    raw = store.read_bytes(key)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RolloutsError(where, f"not JSON ({type(exc).__name__} at position {getattr(exc, 'pos', '?')})") from None
    except ValueError:  # Python's limit on integer digits: a number thousands of digits long
        raise RolloutsError(where, "not JSON this pipeline reads: a number of more than 4300 digits") from None
    pointer = validate_pointer(data, where)
    # The trainer's pointer is checked before anything can show or fetch it (uris.py).
    store.resolve(pointer.checkpoint_uri, f"{where}: field checkpoint_uri")
    return pointer
