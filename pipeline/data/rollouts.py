"""Rollouts of one RL step: the contract between an RL trainer and this pipeline.

    <root>/rollouts/<run>/step-000123/
    ├── rollouts.parquet   one row per rollout (schema below)
    └── policy.json        written LAST: the step is complete once it exists

rollouts.parquet (file metadata `schema_version` = "1"):
    sample_id       string        unique within the step
    input_ids       list<int32>   prompt + response token ids
    loss_mask       list<int8>    1 on response tokens, 0 on prompt tokens; same length
    reward          float32
    policy_version  int64         version of the policy that generated the rollout

policy.json:
    {"schema_version": 1, "policy_version": 123, "model_id": "...",
     "checkpoint_uri": "s3://.../step-000123"  (or a key relative to the store root)}
    The checkpoint is a transformers directory: config.json + model.safetensors.
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.keys import parse_step_key, rollouts_prefix
from pipeline.data.store import ObjectStore

SCHEMA_VERSION = 1
ROLLOUTS_FILE = "rollouts.parquet"
POLICY_FILE = "policy.json"

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


class RolloutsError(ValueError):
    """A rollouts file or policy pointer breaks the contract; the message says where."""


@dataclass(frozen=True)
class Rollout:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    reward: float
    policy_version: int

    @property
    def prompt_len(self) -> int:
        """Tokens before the first response token."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)


@dataclass(frozen=True)
class PolicyPointer:
    policy_version: int
    checkpoint_uri: str
    model_id: str


def validate_rollouts(rollouts: list[Rollout], where: str) -> None:
    if not rollouts:
        raise RolloutsError(f"{where}: no rollouts (empty step)")
    seen: set[str] = set()
    for r in rollouts:
        if r.sample_id in seen:
            raise RolloutsError(f"{where}: duplicate sample_id {r.sample_id!r}")
        seen.add(r.sample_id)
        if len(r.input_ids) != len(r.loss_mask):
            raise RolloutsError(
                f"{where}: sample {r.sample_id!r} has {len(r.input_ids)} input_ids but "
                f"{len(r.loss_mask)} loss_mask values"
            )
        if len(r.input_ids) < 2:
            raise RolloutsError(f"{where}: sample {r.sample_id!r} has fewer than 2 tokens")
        if any(m not in (0, 1) for m in r.loss_mask):
            raise RolloutsError(f"{where}: sample {r.sample_id!r} has a loss_mask value other than 0/1")
        if 1 not in r.loss_mask:
            raise RolloutsError(f"{where}: sample {r.sample_id!r} has a loss_mask of all zeros (no response token)")
        if min(r.input_ids) < 0:
            raise RolloutsError(f"{where}: sample {r.sample_id!r} has a negative token id")


def write_rollouts(store: ObjectStore, run: str, step: int, rollouts: list[Rollout], pointer: PolicyPointer) -> str:
    """Write the step's rollouts, then its policy pointer (the commit point). Returns the parquet URI."""
    prefix = rollouts_prefix(run, step)
    validate_rollouts(rollouts, store.uri(f"{prefix}/{ROLLOUTS_FILE}"))
    table = pa.Table.from_pylist([r.__dict__ for r in rollouts], schema=ROLLOUTS_SCHEMA)
    with store.open_write(f"{prefix}/{ROLLOUTS_FILE}") as f:
        pq.write_table(table, f)
    store.write_json(
        f"{prefix}/{POLICY_FILE}",
        {
            "schema_version": SCHEMA_VERSION,
            "policy_version": pointer.policy_version,
            "checkpoint_uri": pointer.checkpoint_uri,
            "model_id": pointer.model_id,
        },
    )
    return store.uri(f"{prefix}/{ROLLOUTS_FILE}")


def is_committed(store: ObjectStore, run: str, step: int) -> bool:
    prefix = rollouts_prefix(run, step)
    return store.exists(f"{prefix}/{POLICY_FILE}") and store.exists(f"{prefix}/{ROLLOUTS_FILE}")


def committed_steps(store: ObjectStore, run: str) -> list[int]:
    """Steps under rollouts/<run>/ whose policy pointer (the commit point) exists."""
    steps = []
    for name in store.list_dirs(f"rollouts/{run}"):
        try:
            step = parse_step_key(name)
        except ValueError:
            continue  # not a step directory; the RL trainer may keep other things there
        if is_committed(store, run, step):
            steps.append(step)
    return sorted(steps)


def read_rollouts(store: ObjectStore, run: str, step: int) -> list[Rollout]:
    key = f"{rollouts_prefix(run, step)}/{ROLLOUTS_FILE}"
    where = store.uri(key)
    if not store.exists(key):
        raise RolloutsError(f"{where}: not found")
    table = pq.read_table(io.BytesIO(store.read_bytes(key)))
    version = (table.schema.metadata or {}).get(b"schema_version", b"?").decode()
    if version != str(SCHEMA_VERSION):
        raise RolloutsError(f"{where}: schema_version {version!r}, this pipeline reads {SCHEMA_VERSION}")
    missing = [name for name in ROLLOUTS_SCHEMA.names if name not in table.column_names]
    if missing:
        raise RolloutsError(f"{where}: missing column(s) {', '.join(missing)}")
    try:
        table = table.select(ROLLOUTS_SCHEMA.names).cast(ROLLOUTS_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise RolloutsError(f"{where}: column types do not match the rollouts schema: {exc}") from exc
    rollouts = [Rollout(**row) for row in table.to_pylist()]
    validate_rollouts(rollouts, where)
    return rollouts


def read_policy_pointer(store: ObjectStore, run: str, step: int) -> PolicyPointer:
    key = f"{rollouts_prefix(run, step)}/{POLICY_FILE}"
    data = store.read_json(key)
    missing = [k for k in ("policy_version", "checkpoint_uri", "model_id") if k not in data]
    if missing:
        raise RolloutsError(f"{store.uri(key)}: missing key(s) {', '.join(missing)}")
    if data.get("schema_version") != SCHEMA_VERSION:
        found = data.get("schema_version")
        raise RolloutsError(f"{store.uri(key)}: schema_version {found!r}, expected {SCHEMA_VERSION}")
    # The trainer's pointer is checked before anything can show or fetch it (uris.py).
    store.resolve(data["checkpoint_uri"], f"{store.uri(key)}: field checkpoint_uri")
    return PolicyPointer(int(data["policy_version"]), str(data["checkpoint_uri"]), str(data["model_id"]))


def is_held_out(sample_id: str, fraction: float) -> bool:
    """Deterministic split by sample id, stable across reruns and processes."""
    return (zlib.crc32(sample_id.encode()) % 10_000) < fraction * 10_000
