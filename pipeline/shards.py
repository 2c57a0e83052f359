"""Hidden states of the target as Parquet shards plus a manifest (the commit point).

    <root>/hidden_states/<run>/step-000123/
    ├── part-00000-<write id>.parquet   one row (and one row group) per sample
    ├── part-00001-<write id>.parquet
    └── _manifest.json                   written last; readers trust nothing else

A shard row:
    sample_id   string
    step        int64
    input_ids   list<int32>     T tokens
    loss_mask   list<int8>      T values, 1 on response tokens
    hidden      large_binary    T * num_layers * H raw bfloat16 words, row-major (T, num_layers, H)

bf16 has no Arrow type, so values are stored bit-exactly as raw 2-byte words. One row
group per sample keeps random access cheap and decoding memory bounded. Shard names
carry a per-write id so that a rewrite never changes files an older manifest points at.
"""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.steps import hidden_states_prefix
from pipeline.store import ObjectStore

SCHEMA_VERSION = 1
MANIFEST = "_manifest.json"

SHARD_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("step", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("hidden", pa.large_binary()),
    ]
)


class ShardError(ValueError):
    """Hidden states that would break a reader; nothing has been written when raised."""


@dataclass(frozen=True)
class HiddenSample:
    sample_id: str
    step: int
    input_ids: torch.Tensor  # (T,) int64
    loss_mask: torch.Tensor  # (T,) int64
    hidden: torch.Tensor  # (T, num_layers, H) bfloat16


@dataclass(frozen=True)
class ShardInfo:
    name: str
    rows: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    hidden_size: int
    layer_ids: list[int]
    dtype: str
    target: dict[str, str]
    shards: list[ShardInfo]
    num_samples: int
    num_tokens: int
    schema_version: int = SCHEMA_VERSION
    # Row index per sample id: the buffer addresses samples as (shard, row).
    samples: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ShardError(f"manifest schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        data = dict(data)
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        return cls(**data)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


def validate_sample(sample: HiddenSample, hidden_size: int, num_layers: int) -> None:
    where = f"sample {sample.sample_id!r} of step {sample.step}"
    hidden = sample.hidden
    if hidden.dtype != torch.bfloat16:
        raise ShardError(f"{where}: hidden states are {hidden.dtype}, expected torch.bfloat16")
    if hidden.dim() != 3 or hidden.shape[1] != num_layers:
        raise ShardError(f"{where}: hidden states have shape {tuple(hidden.shape)}, expected (T, {num_layers}, H)")
    if hidden.shape[2] != hidden_size:
        raise ShardError(f"{where}: hidden size {hidden.shape[2]} differs from the target's {hidden_size}")
    tokens = sample.input_ids.shape[0]
    if hidden.shape[0] != tokens or sample.loss_mask.shape[0] != tokens:
        raise ShardError(
            f"{where}: {tokens} token ids, {sample.loss_mask.shape[0]} loss mask values and "
            f"{hidden.shape[0]} hidden-state rows must all agree"
        )
    if not bool(sample.loss_mask.any()):
        raise ShardError(f"{where}: loss mask is all zero (no response token to train on)")
    if not torch.isfinite(hidden).all():
        raise ShardError(f"{where}: hidden states contain NaN or Inf")


def _encode_shard(samples: list[HiddenSample]) -> bytes:
    sink = io.BytesIO()
    with pq.ParquetWriter(sink, SHARD_SCHEMA, compression="none") as writer:
        for s in samples:
            row = {
                "sample_id": [s.sample_id],
                "step": [s.step],
                "input_ids": [s.input_ids.to(torch.int32).tolist()],
                "loss_mask": [s.loss_mask.to(torch.int8).tolist()],
                "hidden": [s.hidden.contiguous().view(torch.int16).numpy().tobytes()],
            }
            writer.write_table(pa.table(row, schema=SHARD_SCHEMA))
    return sink.getvalue()


def write_hidden_states(
    store: ObjectStore,
    run: str,
    step: int,
    samples: Iterable[HiddenSample],
    *,
    hidden_size: int,
    layer_ids: list[int],
    target: dict[str, str],
    samples_per_shard: int = 256,
) -> Manifest:
    """Validate every sample, write the shards, then commit them with the manifest."""
    samples = list(samples)
    if not samples:
        raise ShardError(f"step {step}: no samples to write (empty step)")
    for s in samples:
        validate_sample(s, hidden_size, len(layer_ids))
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ShardError(f"step {step}: duplicate sample_id {dup!r}")

    prefix = hidden_states_prefix(run, step)
    write_id = uuid.uuid4().hex[:8]
    shards: list[ShardInfo] = []
    index: list[dict] = []
    for part, start in enumerate(range(0, len(samples), samples_per_shard)):
        chunk = samples[start : start + samples_per_shard]
        data = _encode_shard(chunk)
        name = f"part-{part:05d}-{write_id}.parquet"
        store.write_bytes(f"{prefix}/{name}", data)
        shards.append(ShardInfo(name, len(chunk), len(data), hashlib.sha256(data).hexdigest()))
        index += [{"sample_id": s.sample_id, "shard": name, "row": r, "tokens": s.input_ids.shape[0]}
                  for r, s in enumerate(chunk)]

    manifest = Manifest(
        step=step,
        hidden_size=hidden_size,
        layer_ids=list(layer_ids),
        dtype="bfloat16",
        target=dict(target),
        shards=shards,
        num_samples=len(samples),
        num_tokens=sum(s.input_ids.shape[0] for s in samples),
        samples=index,
    )
    store.write_json(f"{prefix}/{MANIFEST}", manifest.to_json())
    # Now unreachable: the shards of a replaced write, and what a killed write left behind
    # (its shards, temporary files). Readers only ever follow the manifest.
    keep = {MANIFEST, *(s.name for s in shards)}
    for name in store.list_files(prefix):
        if name not in keep:
            store.delete_prefix(f"{prefix}/{name}")
    return manifest


def read_manifest(store: ObjectStore, run: str, step: int) -> Manifest:
    return Manifest.from_json(store.read_json(f"{hidden_states_prefix(run, step)}/{MANIFEST}"))


def has_manifest(store: ObjectStore, run: str, step: int) -> bool:
    return store.exists(f"{hidden_states_prefix(run, step)}/{MANIFEST}")


def _bf16_from_bytes(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    # Arrow buffers are read-only; torch wants a writable buffer, so copy once here.
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(shape)


def _decode_rows(table: pa.Table, manifest: Manifest) -> Iterator[HiddenSample]:
    layers, hidden_size = len(manifest.layer_ids), manifest.hidden_size
    for row in table.to_pylist():
        tokens = len(row["input_ids"])
        yield HiddenSample(
            sample_id=row["sample_id"],
            step=row["step"],
            input_ids=torch.tensor(row["input_ids"], dtype=torch.int64),
            loss_mask=torch.tensor(row["loss_mask"], dtype=torch.int64),
            hidden=_bf16_from_bytes(row["hidden"], (tokens, layers, hidden_size)),
        )


class CorruptShardError(ShardError):
    """A shard whose bytes no longer match the checksum its manifest recorded."""


def _verified_shard(store: ObjectStore, run: str, manifest: Manifest, shard: str) -> pq.ParquetFile:
    """A shard's bytes, read once and checked against the manifest's size and sha256."""
    info = next((s for s in manifest.shards if s.name == shard), None)
    if info is None:
        raise ShardError(f"step {manifest.step}: shard {shard} is not in the manifest")
    data = store.read_bytes(f"{hidden_states_prefix(run, manifest.step)}/{shard}")
    if len(data) != info.bytes or hashlib.sha256(data).hexdigest() != info.sha256:
        raise CorruptShardError(f"step {manifest.step}: shard {shard} does not match its manifest checksum")
    return pq.ParquetFile(io.BytesIO(data))


def iter_shard(store: ObjectStore, run: str, manifest: Manifest, shard: str) -> Iterator[HiddenSample]:
    """One shard's samples, after its checksum is verified; memory is bounded by the shard's size."""
    parquet = _verified_shard(store, run, manifest, shard)
    for group in range(parquet.num_row_groups):
        yield from _decode_rows(parquet.read_row_group(group), manifest)


def iter_samples(store: ObjectStore, run: str, manifest: Manifest) -> Iterator[HiddenSample]:
    """A step's samples, shard by shard; a corrupt shard raises CorruptShardError."""
    for shard in manifest.shards:
        yield from iter_shard(store, run, manifest, shard.name)


def read_rows(store: ObjectStore, run: str, manifest: Manifest, shard: str, rows: list[int]) -> list[HiddenSample]:
    """The given rows (one row group each) of a shard, after checking the shard's checksum."""
    parquet = _verified_shard(store, run, manifest, shard)
    return [next(_decode_rows(parquet.read_row_group(r), manifest)) for r in rows]
