"""A step's hidden states as Arrow IPC shards plus a manifest (the commit point): written by one writer or by
several ranks, committed, and read back verified.

    <root>/hidden_states/<run>/step-000123/
    ├── part-00000-<write id>.arrow   Arrow IPC file, one record batch per sample (shard_file.py)
    ├── part-00001-<write id>.arrow
    └── _manifest.json                written last; readers trust nothing else (shard_format.py)

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

import itertools
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

import pyarrow as pa

from pipeline.data import lease, run_layout, shard_file
from pipeline.data.keys import hidden_states_manifest_key, hidden_states_prefix, hidden_states_shard_key
from pipeline.data.run_layout import TargetLayout
from pipeline.data.shard_format import (
    COMPRESSIONS,
    MANIFEST,
    CorruptShardError,
    HiddenSample,
    Manifest,
    SampleIndex,
    ShardError,
    ShardInfo,
)
from pipeline.data.store import ObjectStore, RangeReader, fill_range
from pipeline.ranks import SINGLE, Ranks

# A shard is cut at this size: on object storage it is sent in one PUT from memory.
SHARD_TARGET_BYTES = 512 << 20
_CONCURRENT_SAMPLES = 8  # samples whose ranges are fetched at once from object storage


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
                shard_file.validate_sample(sample, self._hidden_size, self._num_layers, check_finite=False)
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
    schema = shard_file.shard_schema(list(layer_ids), compression)
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
                    size, digest, entries = shard_file.write_shard(
                        f, stream.take(samples_per_shard, SHARD_TARGET_BYTES), schema, compression, name)
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
    schema = shard_file.shard_schema(list(layer_ids), compression)
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
                size, digest, entries = shard_file.write_shard(f, stream.take(1 << 62, 1 << 62), schema, compression,
                                                               name)
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
                return [shard_file.read_entry(reader, manifest, entries[r], positions) for r in rows]
            info = next(i for i in manifest.shards if i.name == shard)
            wanted = sum(e.meta.length + sum(e.layers[p].length for p in positions)
                         for e in map(entries.get, rows))
            if wanted >= info.bytes // 2:  # most of the shard: one GET (s3fs splits it into concurrent parts)
                in_memory = RangeReader(data=memoryview(store.read_bytes(key)))
                return [shard_file.read_entry(in_memory, manifest, entries[r], positions) for r in rows]
            # A few samples: a request costs a round trip, so fetch a few samples' ranges concurrently.
            out: list[HiddenSample] = []
            for start in range(0, len(rows), _CONCURRENT_SAMPLES):
                group = [entries[r] for r in rows[start : start + _CONCURRENT_SAMPLES]]
                ranges = [(e.meta.offset, e.meta.length) for e in group]
                ranges += [(e.layers[p].offset, e.layers[p].length) for e in group for p in positions]
                prefetched = _prefetched(dict(zip(ranges, store.read_ranges(key, ranges), strict=True)))
                out += [shard_file.read_entry(prefetched, manifest, e, positions) for e in group]
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


def iter_shard(store: ObjectStore, run: str, manifest: Manifest, shard: str,
               layers: list[int] | None = None) -> Iterator[HiddenSample]:
    """A whole shard, read once and verified byte for byte (the asset check's read)."""
    info = next((s for s in manifest.shards if s.name == shard), None)
    entries = _shard_entries(manifest, shard)
    data = store.read_bytes(hidden_states_shard_key(run, manifest.step, shard))
    view = memoryview(data)
    if len(data) != info.bytes or shard_file.shard_digest(view, entries) != info.xxh3_128:
        raise CorruptShardError(f"step {manifest.step}: shard {shard} does not match its manifest checksum")
    positions = layer_positions(manifest, layers)
    in_memory = RangeReader(data=view)
    for entry in entries:
        yield shard_file.read_entry(in_memory, manifest, entry, positions)


def iter_samples(store: ObjectStore, run: str, manifest: Manifest,
                 layers: list[int] | None = None) -> Iterator[HiddenSample]:
    """A step's samples, shard by shard; a corrupt shard raises CorruptShardError."""
    for shard in manifest.shards:
        yield from iter_shard(store, run, manifest, shard.name, layers)
