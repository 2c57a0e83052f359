"""Training data as a batch plan plus a loader: the buffer is streamed, never held in memory.

The plan is computed from sample lengths alone (buffer entries carry them), so the number
of iterations is known before any hidden state is read, every rank of a distributed run
derives the same plan, and a resumed run can skip to its iteration without reading what
it skips. A background thread loads and packs the next batches while the current one
trains; at most `prefetch` + 1 batches are in memory, whatever the buffer's size.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from pipeline.config import TrainConfig
from pipeline.data.buffer import iter_buffer_samples
from pipeline.data.buffer_record import BufferEntry
from pipeline.data.shard_format import HiddenSample, Manifest
from pipeline.data.store import ObjectStore
from pipeline.training.window import PackedBatch, pack

log = logging.getLogger(__name__)

# One training sample: input_ids (T,), features (T, D), loss_mask (T,)
Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Dataset(Protocol):
    lengths: list[int]  # tokens per sample, before windowing
    samples_read: int  # samples not found unreadable: what a run trained on

    def load(self, indices: list[int]) -> list[Sample]:
        """The samples at `indices`, in that order; unreadable ones are left out (with a warning)."""
        ...


class InMemoryDataset:
    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.lengths = [int(s[0].shape[0]) for s in samples]
        self.samples_read = len(samples)

    def load(self, indices: list[int]) -> list[Sample]:
        return [self.samples[i] for i in indices]


class UnreadableDataError(RuntimeError):
    """More of the buffer is unreadable than train.max_unreadable_share allows; the message names the shards."""


class BufferDataset:
    """The buffer's rows, read from their shards batch by batch and turned into training samples.

    It keeps count of what it could not read (a corrupt shard, a sample a rewrite dropped), so that
    what a run reports is what it read: `samples_read` is the buffer less the samples found
    unreadable. Past `max_unreadable_share` of the buffer, `load` raises UnreadableDataError."""

    def __init__(
        self, store: ObjectStore, run: str, entries: list[BufferEntry], transform: Callable[[HiddenSample], Sample],
        max_unreadable_share: float = 1.0,
    ) -> None:
        self.store, self.run, self.entries, self.transform = store, run, entries, transform
        self.lengths = [e.tokens for e in entries]
        self.max_unreadable_share = max_unreadable_share
        self.unreadable: dict[str, set[tuple[int, str]]] = {}  # why (names the shard) -> (step, sample_id) lost
        self._manifests: dict[int, Manifest] = {}

    @property
    def unreadable_samples(self) -> int:
        return len(set().union(*self.unreadable.values()))

    @property
    def samples_read(self) -> int:
        return len(self.entries) - self.unreadable_samples

    def _lost(self, why: str, entries: list[BufferEntry]) -> None:
        log.warning("%s: %d buffer samples unreadable", why, len(entries))
        self.unreadable.setdefault(why, set()).update((e.step, e.sample_id) for e in entries)
        if self.unreadable_samples > self.max_unreadable_share * len(self.entries):
            raise UnreadableDataError(
                f"{self.unreadable_samples} of {len(self.entries)} buffer samples are unreadable, more than "
                f"train.max_unreadable_share {self.max_unreadable_share:g} allows: {'; '.join(sorted(self.unreadable))}"
            )

    def load(self, indices: list[int]) -> list[Sample]:
        # Read in shard order (one pass per shard), hand back in plan order.
        wanted = sorted({*indices}, key=lambda i: (self.entries[i].step, self.entries[i].shard, self.entries[i].row))
        loaded = {
            (s.step, s.sample_id): s
            for s in iter_buffer_samples(self.store, self.run, [self.entries[i] for i in wanted], self._manifests,
                                         on_unreadable=self._lost)
        }
        keys = [(self.entries[i].step, self.entries[i].sample_id) for i in indices]
        return [self.transform(loaded[k]) for k in keys if k in loaded]


def plan_epoch(lengths: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """Shuffle (seeded per epoch) and group sample indices greedily into batches of at most
    `batch_size_per_gpu` samples and `max_seq_len` windowed tokens."""
    order = list(range(len(lengths)))
    random.Random(cfg.seed * 10_007 + epoch).shuffle(order)
    batches: list[list[int]] = []
    group: list[int] = []
    tokens = 0
    for i in order:
        length = min(lengths[i], cfg.window_tokens)
        if group and (len(group) == cfg.batch_size_per_gpu or tokens + length > cfg.max_seq_len):
            batches.append(group)
            group, tokens = [], 0
        group.append(i)
        tokens += length
    if group:
        batches.append(group)
    return batches


def iter_batches(
    dataset: Dataset, plan: list[list[int]], window_tokens: int, prefetch: int = 2
) -> Iterator[PackedBatch | None]:
    """Packed batches in plan order, loaded `prefetch` ahead on a background thread.

    Yields None for a planned batch none of whose samples could be read, so that the
    caller's iteration count (and the learning-rate schedule) stays aligned with the plan.
    """
    if prefetch < 1:
        yield from (_load_and_pack(dataset, indices, window_tokens) for indices in plan)
        return
    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()
    done = object()

    def put(item: object) -> bool:
        # Give up once the consumer has gone, or the join below would wait forever.
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for indices in plan:
                if not put(_load_and_pack(dataset, indices, window_tokens)):
                    return
            put(done)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            put(exc)

    worker = threading.Thread(target=produce, name="batch-prefetch", daemon=True)
    worker.start()
    try:
        while (item := ready.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join()


def _load_and_pack(dataset: Dataset, indices: list[int], window_tokens: int) -> PackedBatch | None:
    samples = [s for s in dataset.load(indices) if s[0].shape[0] >= 2]
    return pack(samples, window_tokens) if samples else None
