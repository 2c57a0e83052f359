"""Hidden states of the target as Arrow IPC shards plus a manifest (the commit point).

    <root>/hidden_states/<run>/step-000123/
    ├── part-00000-<write id>.arrow   Arrow IPC file, one record batch per sample
    ├── part-00001-<write id>.arrow
    └── _manifest.json                written last; readers trust nothing else

A record batch (one sample, T tokens, one column per stored layer):
    sample_id      string
    step           int64
    input_ids      list<int32>    T tokens
    loss_mask      list<int8>     T values, 1 on response tokens
                                  (T: the tokens stored, the sample's training window; the manifest
                                  records the window's offset in the rollout)
    layer_<id>     large_binary   the T * H bf16 words of vLLM layer <id>: raw with compression "none";
                                  with "split-zstd" (lossless, for object storage) a frame that stores
                                  high and low bytes apart and zstd-codes the high ones; with
                                  "fp8-e4m3" (lossy) e4m3 values with a scale per token (compression.py)

Why this layout (measured by `benchmarks/hidden_states_io.py`, docs/storage.md): an IPC body
is the tensors' own bytes, so writing is a write of the tensor memory, and a local read views
those bytes in the mapped file, with no decoding step.
The manifest indexes every sample's byte ranges (its metadata, and each layer) with an
xxh3 digest per range, so a reader fetches one sample, or only the layers it needs, with
ranged reads and verifies exactly what it read. The shard digest in the manifest covers
every byte of the file (each indexed range through its own digest). Shard names carry a
per-write id so that a rewrite never changes files an older manifest points at.
"""

from __future__ import annotations

import io
import itertools
import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import torch
import xxhash

from pipeline.data import lease, run_layout
from pipeline.data.compression import compress_bf16, decompress_bf16_into, dequantize_fp8_into, quantize_fp8
from pipeline.data.keys import (
    HIDDEN_STATES_MANIFEST,
    MAX_STEP,
    hidden_states_manifest_key,
    hidden_states_prefix,
    hidden_states_shard_key,
)
from pipeline.data.run_layout import TargetLayout
from pipeline.data.store import ObjectStore, RangeReader, fill_range
from pipeline.ranks import SINGLE, Ranks

# 4: split-zstd frames are zstd literals (compression.py); schema 3 stored Blosc frames there.
# Raw and fp8 shards did not change, so their schema-3 manifests are still read.
SCHEMA_VERSION = 4
_STILL_READ = {3: ("none", "fp8-e4m3")}
MANIFEST = HIDDEN_STATES_MANIFEST
COMPRESSIONS = ("none", "split-zstd", "fp8-e4m3")
LOSSLESS = ("none", "split-zstd")
# A shard is cut at this size: on object storage it is sent in one PUT from memory.
SHARD_TARGET_BYTES = 512 << 20


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


def shard_schema(layer_ids: list[int], compression: str) -> pa.Schema:
    return pa.schema(
        [("sample_id", pa.string()), ("step", pa.int64()), ("input_ids", pa.list_(pa.int32())),
         ("loss_mask", pa.list_(pa.int8()))] + [(f"layer_{i}", pa.large_binary()) for i in layer_ids],
        metadata={"layer_ids": ",".join(map(str, layer_ids)), "compression": compression, "dtype": "bfloat16"},
    )


# -- validation -------------------------------------------------------------------------------------------------


_CHUNK_BYTES = 1 << 18  # bf16 payloads are checked and digested 256 KiB at a time, while in cache
_CONCURRENT_SAMPLES = 8  # samples whose ranges are fetched at once from object storage
_READ_CHUNK_BYTES = 1 << 20  # copies out of memory: a MiB at a time, digested right after while still in cache


def _nonfinite_in(chunk: memoryview) -> bool:
    """Any NaN/Inf among the bf16 words of `chunk`: all exponent bits set, i.e. a word in
    0x7F80..0x7FFF (the top of the int16 range) or 0xFF80..0xFFFF (the top of the uint16 range).
    Two SIMD max reductions, no temporary."""
    words = np.frombuffer(chunk, np.uint16)
    return words.size > 0 and (int(words.max()) >= 0xFF80 or int(words.view(np.int16).max()) >= 0x7F80)


def all_finite_bf16(hidden: torch.Tensor) -> bool:
    """No NaN or Inf among bf16 values: no word with all exponent bits set.

    Chunk by chunk through the cache: 40x faster than torch.isfinite on bf16."""
    view = memoryview(hidden.contiguous().view(torch.uint8).numpy().reshape(-1)).cast("B")
    return not any(_nonfinite_in(view[i : i + _CHUNK_BYTES]) for i in range(0, view.nbytes, _CHUNK_BYTES))


def validate_sample(sample: HiddenSample, hidden_size: int, num_layers: int, check_finite: bool = True) -> None:
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
    if check_finite and not all_finite_bf16(hidden):
        raise ShardError(f"{where}: hidden states contain NaN or Inf")


# -- writing ----------------------------------------------------------------------------------------------------


def _digest(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class _IndexingSink(io.RawIOBase):
    """The file object the Arrow IPC writer writes to: passes every write on to `out`,
    notes where the buffers it watches (by address) land, and digests each layer plane,
    each sample's metadata region and the shard.

    Arrow hands body buffers over as `pa.Buffer` (zero copy). A bf16 plane is checked for
    NaN/Inf and digested on a second core while it is written."""

    def __init__(self, out: BinaryIO, pool: ThreadPoolExecutor) -> None:
        self.out = out
        self.pool = pool
        self.pos = 0
        self.shard_hash = xxhash.xxh3_128()
        self.watch: dict[int, str] = {}
        self.found: dict[str, int] = {}
        self.planes: dict[int, bool] = {}  # address -> holds bf16 words (checked for NaN/Inf)
        self.digests: dict[int, str] = {}
        self.where = ""
        self.meta_start = 0
        self.meta_end: int | None = None
        self.meta_hash = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def begin_sample(self, where: str, watch: dict[int, str], planes: dict[int, bool]) -> None:
        self.where, self.watch, self.found, self.planes, self.digests = where, watch, {}, planes, {}
        self.meta_start, self.meta_end, self.meta_hash = self.pos, None, xxhash.xxh3_64()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        address = data.address if isinstance(data, pa.Buffer) else None
        if address in self.watch:
            self.found[self.watch[address]] = self.pos
        if address in self.planes:
            if self.meta_end is None:  # the metadata region ends where the first layer starts
                self.meta_end = self.pos
            self.digests[address] = self._write_plane(view, check_finite=self.planes[address])
            self.shard_hash.update(bytes.fromhex(self.digests[address]))
        else:
            self.shard_hash.update(view)
            if self.meta_end is None:
                self.meta_hash.update(view)
            self.out.write(view)
        self.pos += view.nbytes
        return view.nbytes

    def _write_plane(self, view: memoryview, check_finite: bool) -> str:
        # The NaN/Inf check and the digest run on another core while this one writes.
        scan = self.pool.submit(_scan_plane, view, check_finite)
        self.out.write(view)
        finite, digest = scan.result()
        if not finite:
            raise ShardError(f"{self.where}: hidden states contain NaN or Inf")
        return digest


def _scan_plane(view: memoryview, check_finite: bool) -> tuple[bool, str]:
    """(no NaN/Inf among the bf16 words, if checked; xxh3 digest), chunk by chunk while in cache."""
    hasher = xxhash.xxh3_64()
    for start in range(0, view.nbytes, _CHUNK_BYTES):
        chunk = view[start : start + _CHUNK_BYTES]
        if check_finite and _nonfinite_in(chunk):
            return False, ""
        hasher.update(chunk)
    return True, hasher.hexdigest()


def _list_array(values: np.ndarray, arrow_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(np.array([0, values.size], np.int32)), pa.array(values, arrow_type))


def _binary_array(data: np.ndarray) -> pa.LargeBinaryArray:
    buffer = pa.py_buffer(data)
    offsets = pa.py_buffer(np.array([0, buffer.size], np.int64))
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, buffer])


def _planes(sample: HiddenSample, compression: str) -> list[np.ndarray]:
    """The bytes stored for each layer of a (T, L, H) sample: its bf16 words, raw or compressed.
    Raw words are checked for NaN/Inf as they are written; values to be compressed are checked here."""
    planes: list[np.ndarray] = []
    for layer in range(sample.hidden.shape[1]):
        values = sample.hidden[:, layer, :].contiguous()
        if compression == "none":
            planes.append(values.view(torch.uint8).numpy().reshape(-1))
            continue
        if not all_finite_bf16(values):
            raise ShardError(f"sample {sample.sample_id!r} of step {sample.step}: hidden states contain NaN or Inf")
        frame = compress_bf16(values) if compression == "split-zstd" else quantize_fp8(values)
        planes.append(np.frombuffer(frame, np.uint8))
    return planes


def _write_shard(out: BinaryIO, samples: Iterable[HiddenSample], schema: pa.Schema, compression: str,
                 name: str) -> tuple[int, str, list[SampleIndex]]:
    """Write one shard to `out`; its size, digest and its samples' index entries."""
    index = []
    with ThreadPoolExecutor(1, thread_name_prefix="shard-scan") as pool, \
            pa.ipc.new_file(sink := _IndexingSink(out, pool), schema) as writer:
        for row, sample in enumerate(samples):
            planes = _planes(sample, compression)  # kept alive until the batch is written
            ids = sample.input_ids.to(torch.int32).numpy()
            mask = sample.loss_mask.to(torch.int8).numpy()
            batch = pa.record_batch(
                [pa.array([sample.sample_id], pa.string()), pa.array([sample.step], pa.int64()),
                 _list_array(ids, pa.int32()), _list_array(mask, pa.int8()), *map(_binary_array, planes)],
                schema=schema,
            )
            stored = [batch.column(4 + i).buffers()[2] for i in range(len(planes))]
            watch = {batch.column(2).values.buffers()[1].address: "ids",
                     batch.column(3).values.buffers()[1].address: "mask"}
            watch |= {buf.address: f"plane{i}" for i, buf in enumerate(stored)}
            sink.begin_sample(f"sample {sample.sample_id!r} of step {sample.step}", watch,
                              {buf.address: compression == "none" for buf in stored})
            writer.write_batch(batch)
            ranges = [[sink.found[f"plane{i}"], buf.size, sink.digests[buf.address]] for i, buf in enumerate(stored)]
            meta_end = sink.meta_end if sink.meta_end is not None else sink.pos
            tokens = int(sample.input_ids.shape[0])
            index.append(SampleIndex(
                sample_id=sample.sample_id, shard=name, row=row, tokens=tokens,
                meta=ByteRange(sink.meta_start, meta_end - sink.meta_start, sink.meta_hash.hexdigest()),
                # Empty buffers are not written: point them at the region's start (0 bytes are read there).
                ids=sink.found.get("ids", sink.meta_start), mask=sink.found.get("mask", sink.meta_start),
                layers=[ByteRange(*r) for r in ranges], offset=sample.position_offset,
            ))
    return sink.pos, sink.shard_hash.hexdigest(), index


class _Checked:
    """The samples of a write, validated and counted as they arrive: a writer streams them into
    shards and holds one at a time, never the step."""

    def __init__(self, samples: Iterable[HiddenSample], step: int, hidden_size: int, num_layers: int) -> None:
        self._samples = iter(samples)
        self._step, self._hidden_size, self._num_layers = step, hidden_size, num_layers
        self._next: HiddenSample | None = None
        self.ids: set[str] = set()
        self.num_tokens = 0

    def peek(self) -> HiddenSample | None:
        """The next sample (validated), or None at the end."""
        if self._next is None:
            sample = next(self._samples, None)
            if sample is not None:
                # Values are checked while written.
                validate_sample(sample, self._hidden_size, self._num_layers, check_finite=False)
                if sample.sample_id in self.ids:
                    raise ShardError(f"step {self._step}: duplicate sample_id {sample.sample_id!r}")
                self.ids.add(sample.sample_id)
                self.num_tokens += sample.input_ids.shape[0]
            self._next = sample
        return self._next

    def take(self, max_rows: int, max_bytes: int) -> Iterator[HiddenSample]:
        """The next samples of one shard: at least one, then while within `max_rows` and `max_bytes`."""
        rows = size = 0
        while (sample := self.peek()) is not None:
            nbytes = sample.hidden.numel() * 2
            if rows and (rows >= max_rows or size + nbytes > max_bytes):
                return
            self._next = None
            rows, size = rows + 1, size + nbytes
            yield sample


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
    compression: str = "none",
    lease_s: float = 1800.0,
    lease_wait_s: float = 120.0,
    ingest: dict[str, int] | None = None,
    layout: TargetLayout | None = None,
) -> Manifest:
    """Validate every sample, write the shards, then commit them with the manifest; one writer of the
    step at a time (lease.py): a second waits up to `lease_wait_s`, then fails with StepBusyError.

    `samples` is consumed as it is written (a generator streams a step through one sample at a
    time); a sample refused mid-way leaves no shard of this write behind."""
    if compression not in COMPRESSIONS:
        raise ShardError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    if layout is not None:
        if (layout.hidden_size, list(layout.layer_ids)) != (hidden_size, list(layer_ids)):
            raise ShardError(f"step {step}: hidden size {hidden_size} and layers {list(layer_ids)} are not the "
                             f"target layout's {layout.hidden_size} and {list(layout.layer_ids)}")
        run_layout.check_step_layout(store, run, step, layout)  # before anything of the step is stored
    stream = _Checked(samples, step, hidden_size, len(layer_ids))
    if stream.peek() is None:
        raise ShardError(f"step {step}: no samples to write (empty step)")

    prefix = hidden_states_prefix(run, step)
    schema = shard_schema(list(layer_ids), compression)
    write_id = uuid.uuid4().hex[:8]
    with lease.hold(store, prefix, write_id, lease_s, lease_wait_s) as held:
        shards: list[ShardInfo] = []
        index: list[SampleIndex] = []
        try:
            for part in itertools.count():
                if stream.peek() is None:
                    break
                name = f"part-{part:05d}-{write_id}.arrow"
                with store.open_write(f"{prefix}/{name}") as f:
                    size, digest, entries = _write_shard(f, stream.take(samples_per_shard, SHARD_TARGET_BYTES),
                                                         schema, compression, name)
                shards.append(ShardInfo(name, len(entries), size, digest))
                index += entries
            held.confirm()  # a writer that lost its lease stops here: it never commits
        except BaseException:
            for written in shards:  # no manifest names them, so no reader could see them; leave nothing behind
                store.delete_prefix(f"{prefix}/{written.name}")
            raise
        manifest = _commit(store, prefix, step, stream.num_tokens, shards, index, hidden_size=hidden_size,
                           layer_ids=layer_ids, target=target, compression=compression, write_id=write_id,
                           ingest=dict(ingest or {}), layout=layout)
    return manifest


def shard_cuts(tokens: list[int], bytes_per_token: int, max_rows: int = 256,
               max_bytes: int = SHARD_TARGET_BYTES) -> list[range]:
    """The shards of samples in write order, as ranges of their positions: the cut `write_hidden_states`
    makes while streaming (at least one sample, then while within `max_rows` and `max_bytes` of bf16
    states), computed beforehand from each sample's stored tokens so that ranks can split the shards.

        tokens [4, 4, 4, 2], 10 bytes per token, max_bytes 100   ->   [range(0, 2), range(2, 4)]
    """
    cuts: list[range] = []
    start = rows = size = 0
    for i, n in enumerate(tokens):
        nbytes = n * bytes_per_token
        if rows and (rows >= max_rows or size + nbytes > max_bytes):
            cuts.append(range(start, i))
            start, rows, size = i, 0, 0
        rows, size = rows + 1, size + nbytes
    if rows:
        cuts.append(range(start, len(tokens)))
    return cuts


@dataclass(frozen=True)
class ShardUnit:
    """One shard of a ranked write: its position among the step's shards, and its samples (produced when
    the rank that owns it writes it)."""

    part: int
    samples: Callable[[], Iterable[HiddenSample]]


def write_hidden_states_ranked(
    store: ObjectStore,
    run: str,
    step: int,
    units: list[ShardUnit],
    ranks: Ranks = SINGLE,
    *,
    hidden_size: int,
    layer_ids: list[int],
    target: dict[str, str],
    compression: str = "none",
    lease_s: float = 1800.0,
    lease_wait_s: float = 120.0,
    layout: TargetLayout | None = None,
) -> Manifest | None:
    """The step's shards written by several ranks, committed by rank 0 with one manifest; `units` are this
    rank's shards (`Ranks.mine` of the step's `shard_cuts`). Rank 0 holds the step's lease throughout and
    hands its write id to the others; each rank writes its own shards, named by their position
    (`part-<position>-<write id>`); rank 0 gathers their index entries (which waits for every rank to
    finish), confirms the lease and commits. A shard's bytes depend only on its samples, so any number of
    ranks writes the same shards and a manifest of the same `content_digest`.

    A rank that fails deletes its own shards; a rank that is killed leaves shards no manifest names (the
    next commit sweeps them); either way nothing is committed. Returns the manifest on rank 0, None on the
    others."""
    if compression not in COMPRESSIONS:
        raise ShardError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    prefix = hidden_states_prefix(run, step)
    schema = shard_schema(list(layer_ids), compression)
    if not ranks.is_main:
        write_id = ranks.broadcast_text("", _WRITE_ID_CHARS)
        ranks.gather_json(_write_units(store, prefix, step, units, schema, compression, hidden_size,
                                       len(layer_ids), write_id))
        return None
    if layout is not None:
        run_layout.check_step_layout(store, run, step, layout)  # before anything of the step is stored
    write_id = uuid.uuid4().hex[:_WRITE_ID_CHARS]
    with lease.hold(store, prefix, write_id, lease_s, lease_wait_s) as held:
        ranks.broadcast_text(write_id, _WRITE_ID_CHARS)
        written = _write_units(store, prefix, step, units, schema, compression, hidden_size, len(layer_ids),
                               write_id)
        parts = sorted((p for rank_parts in ranks.gather_json(written) for p in rank_parts),
                       key=lambda p: p["part"])
        shards = [ShardInfo(**p["info"]) for p in parts]
        index = [SampleIndex.from_json(e) for p in parts for e in p["entries"]]
        ids = [e.sample_id for e in index]
        if not index or len(set(ids)) != len(ids) or [p["part"] for p in parts] != list(range(len(parts))):
            raise ShardError(f"step {step}: the ranks wrote {len(parts)} shards with {len(ids)} samples "
                             f"({len(set(ids))} distinct): not one shard per position, or no sample")
        held.confirm()  # a writer that lost its lease stops here: it never commits
        return _commit(store, prefix, step, sum(p["tokens"] for p in parts), shards, index,
                       hidden_size=hidden_size, layer_ids=layer_ids, target=target, compression=compression,
                       write_id=write_id, ingest={}, layout=layout)


_WRITE_ID_CHARS = 8


def _write_units(store: ObjectStore, prefix: str, step: int, units: list[ShardUnit], schema: pa.Schema,
                 compression: str, hidden_size: int, num_layers: int, write_id: str) -> list[dict]:
    """This rank's shards, written; their index entries as JSON. A sample refused mid-way deletes them."""
    written: list[dict] = []
    try:
        for unit in units:
            name = f"part-{unit.part:05d}-{write_id}.arrow"
            stream = _Checked(unit.samples(), step, hidden_size, num_layers)
            with store.open_write(f"{prefix}/{name}") as f:
                size, digest, entries = _write_shard(f, stream.take(1 << 62, 1 << 62), schema, compression, name)
            written.append({"part": unit.part, "info": asdict(ShardInfo(name, len(entries), size, digest)),
                            "entries": [e.to_json() for e in entries], "tokens": stream.num_tokens})
    except BaseException:
        for part in written:
            store.delete_prefix(f"{prefix}/{part['info']['name']}")
        raise
    return written


def _commit(store: ObjectStore, prefix: str, step: int, num_tokens: int, shards: list[ShardInfo],
            index: list[SampleIndex], *, hidden_size: int, layer_ids: list[int], target: dict[str, str],
            compression: str, write_id: str, ingest: dict[str, int], layout: TargetLayout | None) -> Manifest:
    """Write the manifest (the commit point), then sweep what no manifest names any more. Runs under the
    step's lease: other write ids under the step are writers that died or lost the lease (they never
    commit), and the shards of the manifest replaced here are unreachable."""
    manifest = Manifest(
        step=step,
        hidden_size=hidden_size,
        layer_ids=list(layer_ids),
        dtype="bfloat16",
        target=dict(target),
        shards=shards,
        num_samples=len(index),
        num_tokens=num_tokens,
        compression=compression,
        samples=index,
        write_id=write_id,
        ingest=ingest,
        layout=layout,
    )
    store.write_json(f"{prefix}/{MANIFEST}", manifest.to_json())
    keep = {MANIFEST, lease.LEASE_FILE, *(s.name for s in shards)}
    for key, _, _ in store.list_files(prefix):
        if key.rsplit("/", 1)[-1] not in keep:
            store.delete_prefix(key)
    return manifest


def read_manifest(store: ObjectStore, run: str, step: int) -> Manifest:
    """The step's manifest, every field checked; ShardError naming the file and the field when it is not one this
    code reads."""
    key = hidden_states_manifest_key(run, step)
    where = store.uri(key)
    try:
        data = store.read_json_object(key)
    except ValueError as exc:
        raise ShardError(str(exc)) from None
    try:
        return Manifest.from_json(data)
    except (ShardError, run_layout.LayoutError) as exc:
        raise ShardError(f"{where}: {exc}") from None


def has_manifest(store: ObjectStore, run: str, step: int) -> bool:
    return store.exists(hidden_states_manifest_key(run, step))


# -- reading ----------------------------------------------------------------------------------------------------


def layer_positions(manifest: Manifest, layers: list[int] | None) -> list[int]:
    """Positions in the stored layers of the vLLM layer ids `layers` (all when None)."""
    if layers is None:
        return list(range(len(manifest.layer_ids)))
    missing = [layer for layer in layers if layer not in manifest.layer_ids]
    if missing:
        raise ShardError(f"step {manifest.step}: layers {missing} are not stored (stored: {manifest.layer_ids})")
    return [manifest.layer_ids.index(layer) for layer in layers]


def _corrupt(manifest: Manifest, entry: SampleIndex, what: str) -> CorruptShardError:
    return CorruptShardError(
        f"step {manifest.step}: shard {entry.shard} does not match its manifest checksum "
        f"({what} of sample {entry.sample_id!r})"
    )


def _checked(data, digest: str, manifest: Manifest, entry: SampleIndex, what: str) -> None:
    if _digest(data) != digest:
        raise _corrupt(manifest, entry, what)


def _read_entry(reader: RangeReader, manifest: Manifest, entry: SampleIndex, positions: list[int]) -> HiddenSample:
    """One sample through its index entry: its metadata range and the ranges of the layers asked for,
    each verified against its digest. Raw layers of a mapped shard are viewed where they lie;
    otherwise layers are read or decoded straight into the output tensor's memory."""
    tokens, hidden_size = entry.tokens, manifest.hidden_size
    meta = reader.read(entry.meta.offset, entry.meta.length)
    _checked(meta, entry.meta.xxh3, manifest, entry, "metadata")
    try:
        ids = np.frombuffer(meta, np.int32, count=tokens, offset=entry.ids - entry.meta.offset)
        mask = np.frombuffer(meta, np.int8, count=tokens, offset=entry.mask - entry.meta.offset)
    except ValueError:
        raise _corrupt(manifest, entry, "token ids or loss mask outside the metadata range") from None
    raw = manifest.compression == "none"
    hidden = _mapped_layers(reader, entry, positions, hidden_size) if raw and reader.mapped else None
    viewed = hidden is not None
    if not viewed:
        hidden = torch.empty(len(positions), tokens, hidden_size, dtype=torch.bfloat16)  # (L, T, H): layer-major
    for out, position, layer in zip(hidden, positions, [manifest.layer_ids[p] for p in positions], strict=True):
        byte_range = entry.layers[position]
        offset, length, digest = byte_range.offset, byte_range.length, byte_range.xxh3
        if raw and length != out.numel() * 2:
            raise _corrupt(manifest, entry, f"length of layer {layer}")
        if viewed:  # the digest is the one pass over the bytes: it faults them in
            _checked(reader.read(offset, length), digest, manifest, entry, f"layer {layer}")
        elif raw:
            if _read_digest(reader, offset, memoryview(out.view(torch.uint8).numpy()).cast("B")) != digest:
                raise _corrupt(manifest, entry, f"layer {layer}")
        else:
            frame = reader.read(offset, length)
            _checked(frame, digest, manifest, entry, f"layer {layer}")
            if manifest.compression == "split-zstd":
                decompress_bf16_into(frame, out)
            else:
                dequantize_fp8_into(frame, out)
    return HiddenSample(
        sample_id=entry.sample_id, step=manifest.step,
        input_ids=torch.from_numpy(ids.astype(np.int64)), loss_mask=torch.from_numpy(mask.astype(np.int64)),
        hidden=hidden.permute(1, 0, 2),  # (T, L, H) view; each layer stays contiguous in memory
        position_offset=entry.offset,
    )


def _mapped_layers(reader: RangeReader, entry: SampleIndex, positions: list[int],
                   hidden_size: int) -> torch.Tensor | None:
    """(L, T, H) bf16 over the mapped shard itself, or None when the layers asked for do not lie
    evenly spaced in the file (then they are copied). Copy-on-write: a caller's writes stay its own."""
    layer_bytes = entry.tokens * hidden_size * 2
    offsets = [entry.layers[p].offset for p in positions]
    stride = offsets[1] - offsets[0] if len(offsets) > 1 else layer_bytes
    even = all(b - a == stride for a, b in itertools.pairwise(offsets))
    if not even or stride < layer_bytes or (offsets[0] | stride) % 2:  # bf16 words start at even offsets
        return None
    span = reader.read(offsets[0], stride * (len(offsets) - 1) + layer_bytes)
    words = torch.frombuffer(span, dtype=torch.bfloat16)
    return words.as_strided((len(offsets), entry.tokens, hidden_size), (stride // 2, hidden_size, 1))


def _read_digest(reader: RangeReader, offset: int, out: memoryview) -> str:
    """Read a range into `out` and digest it: out of memory chunk by chunk, each chunk digested right
    after its copy while still in cache; from object storage in one request."""
    hasher = xxhash.xxh3_64()
    step = _READ_CHUNK_BYTES if reader.in_memory else max(out.nbytes, 1)
    for start in range(0, out.nbytes, step):
        chunk = out[start : start + step]
        reader.read_into(offset + start, chunk)
        hasher.update(chunk)
    return hasher.hexdigest()


def _shard_entries(manifest: Manifest, shard: str) -> list[SampleIndex]:
    if not any(s.name == shard for s in manifest.shards):
        raise ShardError(f"step {manifest.step}: shard {shard} is not in the manifest")
    return [e for e in manifest.samples if e.shard == shard]


def read_rows(store: ObjectStore, run: str, manifest: Manifest, shard: str, rows: list[int],
              layers: list[int] | None = None) -> list[HiddenSample]:
    """The given rows of a shard (only the `layers` asked for; all when None), each range read
    verified against its digest; a mismatch raises CorruptShardError naming the shard.

    From a local store, raw layers view the shard's copy-on-write map: the map (and the file
    descriptor Python's mmap keeps) stays open until the last tensor of this call is freed, so
    read a shard's rows in one call rather than one call per row when many are held at once."""
    entries = {e.row: e for e in _shard_entries(manifest, shard)}
    positions = layer_positions(manifest, layers)
    missing = [r for r in rows if r not in entries]
    if missing:
        raise ShardError(f"step {manifest.step}: shard {shard} has no rows {missing}")
    key = hidden_states_shard_key(run, manifest.step, shard)
    try:
        with store.open_ranges(key) as reader:
            if reader.mapped:
                return [_read_entry(reader, manifest, entries[r], positions) for r in rows]
            info = next(i for i in manifest.shards if i.name == shard)
            wanted = sum(e.meta.length + sum(e.layers[p].length for p in positions)
                         for e in map(entries.get, rows))
            if wanted >= info.bytes // 2:  # most of the shard: one GET (s3fs splits it into concurrent parts)
                in_memory = RangeReader(data=memoryview(store.read_bytes(key)))
                return [_read_entry(in_memory, manifest, entries[r], positions) for r in rows]
            # A few samples: a request costs a round trip, so fetch a few samples' ranges concurrently.
            out: list[HiddenSample] = []
            for start in range(0, len(rows), _CONCURRENT_SAMPLES):
                group = [entries[r] for r in rows[start : start + _CONCURRENT_SAMPLES]]
                ranges = [(e.meta.offset, e.meta.length) for e in group]
                ranges += [(e.layers[p].offset, e.layers[p].length) for e in group for p in positions]
                prefetched = _prefetched(dict(zip(ranges, store.read_ranges(key, ranges), strict=True)))
                out += [_read_entry(prefetched, manifest, e, positions) for e in group]
            return out
    except EOFError as exc:
        raise CorruptShardError(f"step {manifest.step}: shard {shard} is shorter than its manifest says "
                                f"({exc})") from exc


def _prefetched(fetched: dict[tuple[int, int], bytes]) -> RangeReader:
    """A reader over ranges fetched beforehand, keyed by (offset, length)."""
    return RangeReader(lambda offset, out: fill_range(out, fetched[offset, len(out)]))


def read_sample(store: ObjectStore, run: str, manifest: Manifest, sample_id: str,
                layers: list[int] | None = None) -> HiddenSample:
    """One sample by id, reading only its own byte ranges (not its shard)."""
    entry = next((e for e in manifest.samples if e.sample_id == sample_id), None)
    if entry is None:
        raise KeyError(f"step {manifest.step} has no sample {sample_id!r}")
    return read_rows(store, run, manifest, entry.shard, [entry.row], layers)[0]


def shard_digest(data: memoryview, entries: list[SampleIndex]) -> str:
    """The digest the manifest records for a shard: every byte of the file, each indexed layer
    range counted through its own digest (so the writer hashes each byte once)."""
    ranges = sorted((r.offset, r.length, r.xxh3) for e in entries for r in e.layers)
    shard_hash, pos = xxhash.xxh3_128(), 0
    for offset, length, digest in ranges:
        shard_hash.update(data[pos:offset])
        shard_hash.update(bytes.fromhex(digest))
        pos = offset + length
    shard_hash.update(data[pos:])
    return shard_hash.hexdigest()


def iter_shard(store: ObjectStore, run: str, manifest: Manifest, shard: str,
               layers: list[int] | None = None) -> Iterator[HiddenSample]:
    """A whole shard, read once and verified byte for byte (the asset check's read)."""
    info = next((s for s in manifest.shards if s.name == shard), None)
    entries = _shard_entries(manifest, shard)
    data = store.read_bytes(hidden_states_shard_key(run, manifest.step, shard))
    view = memoryview(data)
    if len(data) != info.bytes or shard_digest(view, entries) != info.xxh3_128:
        raise CorruptShardError(f"step {manifest.step}: shard {shard} does not match its manifest checksum")
    positions = layer_positions(manifest, layers)
    in_memory = RangeReader(data=view)
    for entry in entries:
        yield _read_entry(in_memory, manifest, entry, positions)


def iter_samples(store: ObjectStore, run: str, manifest: Manifest,
                 layers: list[int] | None = None) -> Iterator[HiddenSample]:
    """A step's samples, shard by shard; a corrupt shard raises CorruptShardError."""
    for shard in manifest.shards:
        yield from iter_shard(store, run, manifest, shard.name, layers)
