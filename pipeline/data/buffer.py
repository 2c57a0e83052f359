"""The rolling cross-step buffer: which samples of which steps the drafter trains on now.

FastRL keeps a deque of at most `data_buffer_max_size` samples (oldest evicted first)
and trains on those of the last `buffer_steps` RL steps. We keep the same semantics but
store only a manifest that points into the steps' hidden-state shards, never a copy:

    <root>/buffer/<run>/step-000123/_manifest.json
        {"schema_version": 1, "step": 123, "entries": [{"step", "sample_id", "shard", "row", "tokens"}, ...],
         "composition": {"121": 40, "122": 84, "123": 84}, ...}   (a BufferRecord, buffer_record.py)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from pipeline.data import rollouts as rollouts_lib
from pipeline.data import run_layout, shards
from pipeline.data.buffer_record import BufferEntry, BufferRecord
from pipeline.data.keys import buffer_key, rollouts_prefix, step_key
from pipeline.data.records import read_record, write_record
from pipeline.data.shard_format import CorruptShardError, HiddenSample, Manifest, SampleIndex
from pipeline.data.store import ObjectStore

log = logging.getLogger(__name__)


def select_buffer(
    manifests: list[Manifest], current_step: int, buffer_steps: int, max_samples: int
) -> list[BufferEntry]:
    """Samples of steps (current_step - buffer_steps, current_step], newest `max_samples` kept."""
    if buffer_steps < 1 or max_samples < 1:
        raise ValueError("buffer_steps and data_buffer_max_size must be >= 1")
    oldest = current_step - buffer_steps + 1
    entries = [
        BufferEntry(m.step, s.sample_id, s.shard, s.row, s.tokens)
        for m in sorted(manifests, key=lambda m: m.step)
        if oldest <= m.step <= current_step
        for s in m.samples
        if s.tokens >= 2
    ]
    return entries[-max_samples:]


def write_buffer(store: ObjectStore, run: str, step: int, entries: list[BufferEntry]) -> BufferRecord:
    record = BufferRecord(step, tuple(entries))
    write_record(store, buffer_key(run, step), record)
    return record


def read_buffer(store: ObjectStore, run: str, step: int) -> BufferRecord:
    return read_record(store, buffer_key(run, step), BufferRecord)


Unreadable = Callable[[str, list[BufferEntry]], None]  # (why, the entries it cost)


def _warn(why: str, lost: list[BufferEntry]) -> None:
    log.warning("%s: skipping its %d buffer samples", why, len(lost))


def iter_buffer_samples(
    store: ObjectStore, run: str, entries: list[BufferEntry], manifests: dict[int, Manifest] | None = None,
    on_unreadable: Unreadable = _warn,
) -> Iterator[HiddenSample]:
    """Load the samples an entry list points at, in entry order, one shard at a time.

    A shard that fails its checksum is skipped, never used, and `on_unreadable` told which entries
    it cost (by default a warning): the caller decides how many lost samples a run can take.
    Entries address samples by (step, sample_id); their (shard, row) is followed while the step's
    manifest still lists that shard, and looked up again in the manifest when the step was rewritten
    since (its old shards are gone). `manifests` caches manifests across calls."""
    manifests = {} if manifests is None else manifests
    for step in sorted({e.step for e in entries} - manifests.keys()):
        manifests[step] = shards.read_manifest(store, run, step)
    entries = _current(entries, manifests, on_unreadable)
    i = 0
    while i < len(entries):
        step, shard = entries[i].step, entries[i].shard
        j = i
        while j < len(entries) and (entries[j].step, entries[j].shard) == (step, shard):
            j += 1
        try:
            yield from shards.read_rows(store, run, manifests[step], shard, [e.row for e in entries[i:j]])
        except (CorruptShardError, FileNotFoundError) as exc:
            on_unreadable(f"step {step}: shard {shard}: {exc}", entries[i:j])
        i = j


def _current(entries: list[BufferEntry], manifests: dict[int, Manifest],
             on_unreadable: Unreadable) -> list[BufferEntry]:
    """The entries, those whose shard their step's manifest no longer lists re-addressed by sample id."""
    # Runs for every batch the trainer loads: look at the entries' own steps only, and build a
    # step's sample index only when one of its entries points at a shard that is gone.
    listed = {step: {s.name for s in manifests[step].shards} for step in {e.step for e in entries}}
    index: dict[int, dict[str, SampleIndex]] = {}
    out = []
    for e in entries:
        if e.shard in listed[e.step]:
            out.append(e)
            continue
        if e.step not in index:
            index[e.step] = {s.sample_id: s for s in manifests[e.step].samples}
        if (found := index[e.step].get(e.sample_id)) is not None:
            out.append(BufferEntry(e.step, e.sample_id, found.shard, found.row, found.tokens))
        else:
            on_unreadable(f"step {e.step}: rewritten without sample {e.sample_id!r}", [e])
    return out


class StaleHiddenStates(ValueError):
    """A step's hidden states extracted from rollouts (or a policy) that its commit no longer holds."""


def check_extracted_from(store: ObjectStore, run: str, manifest: Manifest) -> None:
    """StaleHiddenStates when the step was republished after its hidden states were extracted: the digest their
    manifest recorded (`rollouts_digest`) is not the committed step's now. A manifest written before the digest
    was recorded is not checked."""
    recorded = manifest.target.get("rollouts_digest")
    if recorded is not None and recorded != rollouts_lib.committed_digest(store, run, manifest.step):
        raise StaleHiddenStates(
            f"{store.uri(rollouts_prefix(run, manifest.step))}: the step's rollouts.parquet or policy.json changed "
            f"after its hidden states were extracted: re-materialize hidden_states of {step_key(manifest.step)}")


def build_buffer(store: ObjectStore, run: str, step: int, buffer_steps: int, max_samples: int) -> BufferRecord:
    """Select from the committed hidden states of the last `buffer_steps` steps and write the manifest;
    LayoutError when one of them is not of the run's target layout, StaleHiddenStates when one was extracted from
    rollouts its step no longer holds."""
    if not shards.has_manifest(store, run, step):
        raise FileNotFoundError(f"hidden states of step {step} are not committed (no manifest)")
    manifests = [
        shards.read_manifest(store, run, s)
        for s in range(max(0, step - buffer_steps + 1), step + 1)
        if shards.has_manifest(store, run, s)
    ]
    for m in manifests:  # one drafter trains on all of them: one target layout (run_layout.py)
        run_layout.check_stored(store, run, m.step, m.hidden_size, m.layer_ids, m.layout)
        check_extracted_from(store, run, m)
    return write_buffer(store, run, step, select_buffer(manifests, step, buffer_steps, max_samples))
