"""What a step's hidden states are stored as: its samples (HiddenSample), and the manifest that commits the step's
shards and indexes every sample's byte ranges with their digests, read back as untrusted input (its names and byte
ranges are what readers follow). shards.py writes and reads them; shard_file.py is one shard's bytes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import xxhash

from pipeline.data.keys import HIDDEN_STATES_MANIFEST, MAX_STEP
from pipeline.data.run_layout import TargetLayout

# 4: split-zstd frames are zstd literals (compression.py); schema 3 stored Blosc frames there.
# Raw and fp8 shards did not change, so their schema-3 manifests are still read.
SCHEMA_VERSION = 4
_STILL_READ = {3: ("none", "fp8-e4m3")}
MANIFEST = HIDDEN_STATES_MANIFEST
COMPRESSIONS = ("none", "split-zstd", "fp8-e4m3")
LOSSLESS = ("none", "split-zstd")


class ShardError(ValueError):
    """Hidden states that would break a reader; nothing has been written when raised."""


class CorruptShardError(ShardError):
    """Stored bytes that no longer match the digest their manifest recorded."""


@dataclass(frozen=True)
class HiddenSample:
    sample_id: str
    step: int
    input_ids: torch.Tensor  # (T,) int64
    loss_mask: torch.Tensor  # (T,) int64
    hidden: torch.Tensor  # (T, num_layers, H) bfloat16
    position_offset: int = 0  # position in its rollout of the first token stored (capture.py: a window)


@dataclass(frozen=True)
class ShardInfo:
    name: str
    rows: int
    bytes: int
    xxh3_128: str  # over the file, each indexed range counted through its own digest (see shard_digest)

    @classmethod
    def from_json(cls, data: object) -> ShardInfo:
        data = _field(data, dict, "shards[]")
        name = _field(data.get("name"), str, "shards[].name")
        if "/" in name or name in ("", ".", ".."):
            raise ShardError("field shards[].name must name a file in the step's directory")
        return cls(name, _count(data.get("rows"), "shards[].rows"), _count(data.get("bytes"), "shards[].bytes"),
                   _field(data.get("xxh3_128"), str, "shards[].xxh3_128"))


def _field(value: object, kind: type, name: str) -> Any:
    """`value` if it is a `kind` (a bool is no int); ShardError naming the manifest's field otherwise: a manifest is
    read back as untrusted input, as the trainer's files are (its names and byte ranges are what readers follow)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ShardError(f"field {name} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def _count(value: object, name: str) -> int:
    if not 0 <= _field(value, int, name) <= MAX_STEP:
        raise ShardError(f"field {name} must be an integer in [0, 2**63 - 1]")
    return value


@dataclass(frozen=True)
class ByteRange:
    """A range of a shard's bytes and the xxh3 digest a reader checks it against."""

    offset: int
    length: int
    xxh3: str

    def to_json(self) -> list:
        return [self.offset, self.length, self.xxh3]

    @classmethod
    def from_json(cls, value: object) -> ByteRange:
        if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, int) and v >= 0 for v in value[:2])
                and isinstance(value[2], str)):
            raise ShardError(f"manifest byte range {value!r} is not [offset, length, xxh3]")
        return cls(*value)


@dataclass(frozen=True)
class SampleIndex:
    """Where one sample lies in its shard: the buffer addresses it as (shard, row); a reader fetches its
    metadata range (token ids and loss mask inside it, at `ids` and `mask`) and the ranges of the
    layers it needs, each verified against its digest."""

    sample_id: str
    shard: str
    row: int
    tokens: int
    meta: ByteRange
    ids: int  # offset of the int32 token ids, inside `meta`
    mask: int  # offset of the int8 loss mask, inside `meta`
    layers: list[ByteRange]  # one per stored layer, in the manifest's layer order
    offset: int = 0  # position in its rollout of the first stored token (a window, capture.py)

    def to_json(self) -> dict:
        return {"sample_id": self.sample_id, "shard": self.shard, "row": self.row, "tokens": self.tokens,
                "meta": self.meta.to_json(), "ids": self.ids, "mask": self.mask,
                "layers": [r.to_json() for r in self.layers], "offset": self.offset}

    @classmethod
    def from_json(cls, data: dict) -> SampleIndex:
        try:
            return cls(_field(data["sample_id"], str, "samples[].sample_id"), _field(data["shard"], str,
                                                                                   "samples[].shard"),
                       _count(data["row"], "samples[].row"), _count(data["tokens"], "samples[].tokens"),
                       ByteRange.from_json(data["meta"]), _count(data["ids"], "samples[].ids"),
                       _count(data["mask"], "samples[].mask"),
                       [ByteRange.from_json(r) for r in _field(data["layers"], list, "samples[].layers")],
                       _count(data.get("offset", 0), "samples[].offset"))
        except (KeyError, TypeError) as exc:
            raise ShardError(f"manifest sample entry lacks or mistypes a field ({exc})") from None


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
    compression: str = "none"
    schema_version: int = SCHEMA_VERSION
    samples: list[SampleIndex] = field(default_factory=list)  # one per sample, in write order
    write_id: str = ""  # the write that committed the step; its shard names carry it
    ingest: dict[str, int] = field(default_factory=dict)  # the source's account of its input (connector files)
    layout: TargetLayout | None = None  # the target's layout (run_layout.py), when the writer gave it

    def to_json(self) -> dict:
        return {**asdict(self), "samples": [e.to_json() for e in self.samples]}

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION and data.get("compression", "none") not in _STILL_READ.get(version, ()):
            raise ShardError(
                f"manifest schema_version {version!r} with compression {data.get('compression')!r}, expected "
                f"{SCHEMA_VERSION}; re-materialize hidden_states for this step"
            )
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(set(data) - known):
            raise ShardError(f"manifest has unknown field(s) {', '.join(map(repr, unknown[:5]))}")
        data = dict(data)
        for name in ("step", "hidden_size", "num_samples", "num_tokens"):
            _count(data.get(name), name)
        for name, kind in (("dtype", str), ("compression", str), ("write_id", str), ("target", dict),
                           ("ingest", dict)):
            if name in data or name in ("dtype", "target"):
                _field(data.get(name), kind, name)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in _field(data.get("layer_ids"), list,
                                                                                   "layer_ids")):
            raise ShardError("field layer_ids must be a list of layer numbers")
        data["shards"] = [ShardInfo.from_json(s) for s in _field(data.get("shards"), list, "shards")]
        data["samples"] = [SampleIndex.from_json(_field(e, dict, "samples[]"))
                           for e in _field(data.get("samples", []), list, "samples")]
        listed = {s.name for s in data["shards"]}
        if stray := next((e.shard for e in data["samples"] if e.shard not in listed), None):
            raise ShardError(f"field samples[].shard names {stray!r}, a shard the manifest does not list")
        if data.get("layout") is not None:
            data["layout"] = TargetLayout.from_json(data["layout"])
        return cls(**data)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def content_digest(self) -> str:
        """xxh3-128 of what the manifest commits, without the write that committed it: every field, every
        shard's size and digest and every sample's byte ranges, with the write id taken out of the shard
        names. Two writes of the same samples have the same content digest (and byte-identical shards)."""
        doc = self.to_json()
        doc.pop("write_id")
        suffix = f"-{self.write_id}.arrow"
        doc["shards"] = [{**s, "name": s["name"].removesuffix(suffix)} for s in doc["shards"]]
        doc["samples"] = [{**e, "shard": e["shard"].removesuffix(suffix)} for e in doc["samples"]]
        return xxhash.xxh3_128_hexdigest(json.dumps(doc, sort_keys=True).encode())

    @property
    def hidden_bytes(self) -> int:
        """Bytes of the bf16 hidden states the shards hold, uncompressed."""
        return self.num_tokens * len(self.layer_ids) * self.hidden_size * 2
