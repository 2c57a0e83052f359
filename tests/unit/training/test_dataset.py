"""Training data: the batch plan, the streamed buffer dataset and the prefetching batch iterator."""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.data import buffer, shard_format, shards
from pipeline.data.store import ObjectStore
from pipeline.training.dataset import (
    BufferDataset,
    InMemoryDataset,
    Sample,
    UnreadableDataError,
    iter_batches,
    plan_epoch,
)
from pipeline.training.window import PackedBatch

V = 32
LENGTHS = [5, 12, 3, 9, 20, 7, 2, 15, 11, 6, 4, 18]


def numbered_samples(lengths: list[int]) -> list[Sample]:
    """Sample i has hidden[:, 0] == i so that packed batches reveal which samples they hold."""
    out = []
    for i, n in enumerate(lengths):
        hidden = torch.zeros(n, 4)
        hidden[:, 0] = i
        mask = torch.ones(n, dtype=torch.int64)
        mask[0] = 0
        out.append((torch.arange(n) % V, hidden, mask))
    return out


def samples_in(batch: PackedBatch) -> list[int]:
    docs = batch.document_ids[0]
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[1:] = docs[1:] != docs[:-1]
    return batch.hidden_states[0, starts, 0].long().tolist()


def batches(samples: list[Sample], cfg: TrainConfig, epoch: int, prefetch: int = 2) -> list[PackedBatch]:
    data = InMemoryDataset(samples)
    return list(iter_batches(data, plan_epoch(data.lengths, cfg, epoch), cfg.window_tokens, prefetch))


# -- plan_epoch + iter_batches ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch_size", "max_seq_len", "window"),
    [
        pytest.param(3, 4096, 512, id="batch-size-bound"),
        pytest.param(16, 30, 20, id="seq-len-bound"),
        pytest.param(4, 25, 20, id="both-bounds"),
        pytest.param(5, 20, 8, id="windowed"),
        pytest.param(1, 4096, 512, id="one-per-batch"),
    ],
)
def test_batches_respect_the_limits(batch_size: int, max_seq_len: int, window: int) -> None:
    samples = numbered_samples(LENGTHS)
    cfg = TrainConfig(batch_size_per_gpu=batch_size, max_seq_len=max_seq_len, window_tokens=window)

    for epoch in range(3):
        packed = batches(samples, cfg, epoch)
        seen = [i for b in packed for i in samples_in(b)]

        assert sorted(seen) == list(range(len(samples)))  # every sample exactly once per epoch
        for batch in packed:
            assert len(samples_in(batch)) <= batch_size
            assert batch.num_tokens <= max_seq_len
        assert sum(b.num_tokens for b in packed) == sum(min(n, window) - 1 for n in LENGTHS)


def test_batches_are_filled_greedily() -> None:
    cfg = TrainConfig(batch_size_per_gpu=4, max_seq_len=4096)
    assert [len(b) for b in plan_epoch(LENGTHS, cfg, 0)] == [4, 4, 4]


def test_shuffle_is_seeded_per_epoch() -> None:
    cfg = TrainConfig(batch_size_per_gpu=4, seed=3)

    def order(c: TrainConfig, epoch: int) -> list[int]:
        return [i for b in plan_epoch(LENGTHS, c, epoch) for i in b]

    assert order(cfg, 0) == order(cfg, 0)
    assert order(cfg, 0) != order(cfg, 1)
    assert order(cfg, 0) != order(TrainConfig(batch_size_per_gpu=4, seed=4), 0)


def test_a_single_long_sample_is_capped() -> None:
    cfg = TrainConfig(batch_size_per_gpu=4, max_seq_len=8, window_tokens=8)
    assert all(b.num_tokens <= cfg.max_seq_len for b in batches(numbered_samples([20]), cfg, 0))


def test_prefetch_yields_what_loading_in_line_yields() -> None:
    samples = numbered_samples(LENGTHS)
    cfg = TrainConfig(batch_size_per_gpu=3)
    inline = [samples_in(b) for b in batches(samples, cfg, 0, prefetch=0)]
    assert [samples_in(b) for b in batches(samples, cfg, 0, prefetch=2)] == inline


class CountingDataset(InMemoryDataset):
    """Records how many batches were loaded, to see how far ahead the prefetch thread runs."""

    def __init__(self, samples: list[Sample], fail_at: int | None = None) -> None:
        super().__init__(samples)
        self.loads, self.fail_at = 0, fail_at

    def load(self, indices: list[int]) -> list[Sample]:
        if self.loads == self.fail_at:
            raise OSError(f"shard read failed at batch {self.loads}")
        self.loads += 1
        return super().load(indices)


def test_prefetch_runs_a_bounded_distance_ahead_and_stops_with_the_consumer() -> None:
    data = CountingDataset(numbered_samples(LENGTHS))
    plan = [[i] for i in range(len(LENGTHS))]
    stream = iter_batches(data, plan, window_tokens=512, prefetch=2)
    next(stream)
    deadline = threading.Event()
    deadline.wait(0.3)  # give the producer time to run ahead as far as it may
    assert data.loads <= 1 + 2 + 1  # consumed + queued + one loaded and waiting to be queued
    stream.close()  # the consumer leaves early: the thread must stop, not block forever
    assert not any(t.name == "batch-prefetch" for t in threading.enumerate())


def test_a_load_error_reaches_the_consumer() -> None:
    data = CountingDataset(numbered_samples(LENGTHS), fail_at=2)
    with pytest.raises(OSError, match="shard read failed at batch 2"):
        list(iter_batches(data, [[i] for i in range(5)], window_tokens=512))


# -- BufferDataset ----------------------------------------------------------------------------------------------


@pytest.fixture
def stored(store: ObjectStore) -> tuple[ObjectStore, list[buffer.BufferEntry], dict[str, shard_format.HiddenSample]]:
    """Two steps, two samples per shard, and the buffer over both."""
    g = torch.Generator().manual_seed(0)
    written, manifests = {}, []
    for step in (1, 2):
        samples = [
            shard_format.HiddenSample(f"s{step}-{i}", step, torch.arange(n) % V, (torch.arange(n) > 1).long(),
                                torch.randn(n, 2, 8, generator=g).to(torch.bfloat16))
            for i, n in enumerate([5, 7, 6])
        ]
        manifests.append(shards.write_hidden_states(store, "run", step, samples, hidden_size=8, layer_ids=[1, 2],
                                                    target={"model_id": "m"}, samples_per_shard=2))
        written |= {s.sample_id: s for s in samples}
    return store, buffer.select_buffer(manifests, 2, buffer_steps=2, max_samples=10), written


def last_layer(sample: shard_format.HiddenSample) -> Sample:
    return sample.input_ids, sample.hidden[:, -1, :], sample.loss_mask


def test_buffer_dataset_loads_rows_in_the_order_asked(stored) -> None:
    store, entries, written = stored
    data = BufferDataset(store, "run", entries, last_layer)
    assert data.lengths == [5, 7, 6, 5, 7, 6]

    order = [4, 0, 5, 2]  # across steps and shards, out of storage order
    loaded = data.load(order)

    for index, (ids, features, mask) in zip(order, loaded, strict=True):
        want = written[entries[index].sample_id]
        assert torch.equal(ids, want.input_ids)
        assert torch.equal(mask, want.loss_mask)
        assert torch.equal(features.view(torch.int16), want.hidden[:, -1, :].view(torch.int16))


def _corrupt_first_shard(store: ObjectStore) -> str:
    manifest = shards.read_manifest(store, "run", 1)
    key = f"hidden_states/run/step-000001/{manifest.shards[0].name}"  # rows s1-0, s1-1
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(key, bytes(data))
    return manifest.shards[0].name


def test_buffer_dataset_leaves_out_a_corrupt_shard(stored, caplog: pytest.LogCaptureFixture) -> None:
    store, entries, _ = stored
    _corrupt_first_shard(store)
    dataset = BufferDataset(store, "run", entries, last_layer)

    with caplog.at_level("WARNING", logger="pipeline.training.dataset"):
        loaded = dataset.load([0, 1, 2, 3])
        nothing = list(iter_batches(dataset, [[0, 1], [2, 3]], window_tokens=512))

    assert len(loaded) == 2  # s1-2 and s2-0
    assert "does not match its manifest checksum" in caplog.text
    assert nothing[0] is None  # the whole batch was unreadable: a gap, not a crash
    assert isinstance(nothing[1], PackedBatch)
    assert (dataset.samples_read, dataset.unreadable_samples) == (4, 2)  # counted once, though read twice


@pytest.mark.reliability("fault", "corrupt shard during training, past train.max_unreadable_share: the run fails "
                                  "naming the shard")
def test_past_the_unreadable_share_loading_fails_naming_the_shards(stored) -> None:
    store, entries, _ = stored
    name = _corrupt_first_shard(store)
    dataset = BufferDataset(store, "run", entries, last_layer, max_unreadable_share=0.25)  # 2 of 6 lost
    with pytest.raises(UnreadableDataError, match=f"2 of 6 buffer samples are unreadable.*0.25.*shard {name}"):
        list(iter_batches(dataset, [[0, 1], [2, 3], [4, 5]], window_tokens=512))
    within = BufferDataset(store, "run", entries, last_layer, max_unreadable_share=0.34)
    assert sum(b is not None for b in iter_batches(within, [[0, 1], [2, 3], [4, 5]], window_tokens=512)) == 2
    assert within.samples_read == 4
