"""Drafter training: learning-rate schedule, batching, and the training loop."""

from __future__ import annotations

import pytest
import torch

from pipeline import target as target_lib
from pipeline.config import OptimConfig, TrainConfig
from pipeline.eagle import EagleConfig, EagleDrafter
from pipeline.train import Sample, lr_at, make_batches, train_drafter
from pipeline.window import PackedBatch

V, H, HEADS = 32, 32, 2


# -- lr_at ------------------------------------------------------------------------------------------------------


def test_lr_warms_up_linearly_to_the_peak() -> None:
    peak, warmup, total = 2.0, 10, 100
    lrs = [lr_at(i, total, peak, warmup) for i in range(warmup)]

    assert lrs == pytest.approx([peak * (i + 1) / warmup for i in range(warmup)])
    assert lrs[0] == pytest.approx(0.2)
    assert lrs[-1] == pytest.approx(peak)  # the last warmup iteration reaches the peak
    assert lr_at(warmup, total, peak, warmup) == pytest.approx(peak)  # decay starts from the peak


def test_lr_decays_to_ten_percent_at_the_end() -> None:
    peak, warmup, total = 2.0, 10, 100
    decay = [lr_at(i, total, peak, warmup) for i in range(warmup, total + 1)]

    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))  # monotone non-increasing
    assert decay[-1] == pytest.approx(0.1 * peak)
    assert lr_at(55, total, peak, warmup) == pytest.approx(peak * 0.55)  # cosine midpoint: (1 + 0.1) / 2
    assert lr_at(total + 50, total, peak, warmup) == pytest.approx(0.1 * peak)  # clamped past the end
    assert min(lr_at(i, total, peak, warmup) for i in range(total + 1)) >= 0.1 * peak - 1e-12


def test_lr_without_warmup_starts_at_the_peak() -> None:
    assert lr_at(0, 50, 1.0, 0) == pytest.approx(1.0)
    assert lr_at(50, 50, 1.0, 0) == pytest.approx(0.1)


# -- make_batches -----------------------------------------------------------------------------------------------


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


LENGTHS = [5, 12, 3, 9, 20, 7, 2, 15, 11, 6, 4, 18]


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
def test_make_batches_respects_the_limits(batch_size: int, max_seq_len: int, window: int) -> None:
    samples = numbered_samples(LENGTHS)
    cfg = TrainConfig(batch_size_per_gpu=batch_size, max_seq_len=max_seq_len, window_tokens=window)

    for epoch in range(3):
        batches = make_batches(samples, cfg, epoch)
        seen = [i for b in batches for i in samples_in(b)]

        assert sorted(seen) == list(range(len(samples)))  # every sample exactly once per epoch
        for batch in batches:
            assert len(samples_in(batch)) <= batch_size
            assert batch.num_tokens <= max_seq_len
        assert sum(b.num_tokens for b in batches) == sum(min(n, window) - 1 for n in LENGTHS)


def test_make_batches_fills_batches_greedily() -> None:
    cfg = TrainConfig(batch_size_per_gpu=4, max_seq_len=4096)
    batches = make_batches(numbered_samples(LENGTHS), cfg, 0)
    assert [len(samples_in(b)) for b in batches] == [4, 4, 4]


def test_make_batches_shuffle_is_seeded_per_epoch() -> None:
    samples = numbered_samples(LENGTHS)
    cfg = TrainConfig(batch_size_per_gpu=4, seed=3)

    def order(c: TrainConfig, epoch: int) -> list[int]:
        return [i for b in make_batches(samples, c, epoch) for i in samples_in(b)]

    assert order(cfg, 0) == order(cfg, 0)
    assert order(cfg, 0) != order(cfg, 1)
    assert order(cfg, 0) != order(TrainConfig(batch_size_per_gpu=4, seed=4), 0)


def test_window_longer_than_a_packed_sequence_is_rejected() -> None:
    """A window over max_seq_len would give a packed sequence over the cap: the config refuses it."""
    with pytest.raises(ValueError, match=r"train\.window_tokens \(512\) exceeds train\.max_seq_len \(8\)"):
        TrainConfig(batch_size_per_gpu=4, max_seq_len=8, window_tokens=512)


def test_make_batches_caps_a_single_long_sample() -> None:
    cfg = TrainConfig(batch_size_per_gpu=4, max_seq_len=8, window_tokens=8)
    batches = make_batches(numbered_samples([20]), cfg, 0)
    assert all(b.num_tokens <= cfg.max_seq_len for b in batches)


# -- train_drafter ----------------------------------------------------------------------------------------------


class RecordingSink:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_dict(self, payload: dict[str, float], step: int) -> None:
        self.records.append((step, dict(payload)))


@pytest.fixture(scope="module")
def target():
    return target_lib.build_target(target_lib.tiny_llama_config(V, H, 1, HEADS), seed=0)


@pytest.fixture(scope="module")
def dataset(target) -> list[Sample]:
    """Token sequences from a repetitive little language, with the target's real features."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(12):
        n = int(torch.randint(12, 24, (1,), generator=g))
        start = int(torch.randint(0, V, (1,), generator=g))
        ids = (start + 3 * torch.arange(n)) % V
        hidden = target_lib.forward(target, ids[None]).features[0].float()
        mask = torch.ones(n, dtype=torch.int64)
        mask[:4] = 0
        out.append((ids, hidden, mask))
    return out


def drafter_for(target) -> EagleDrafter:
    torch.manual_seed(0)
    model = EagleDrafter(EagleConfig.from_target(target.config))
    model.use_target_heads(target)
    return model


def test_train_drafter_reduces_the_loss(target, dataset: list[Sample]) -> None:
    cfg = TrainConfig(
        epochs=6, batch_size_per_gpu=4, max_seq_len=128, window_tokens=128, seed=1,
        optim=OptimConfig(lr=3e-3, lr_warmup_steps=2),
    )
    model = drafter_for(target)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(("embed_tokens", "lm_head"))}
    fc_before = model.fc.weight.detach().clone()
    sink = RecordingSink()

    result = train_drafter(model, dataset, cfg, sink=sink)

    expected_iterations = sum(len(make_batches(dataset, cfg, e)) for e in range(cfg.epochs))
    assert result.iterations == expected_iterations
    assert result.samples == len(dataset)
    assert result.tokens == cfg.epochs * sum(ids.shape[0] - 1 for ids, _, _ in dataset)
    assert len(result.loss_history) == result.iterations
    assert result.loss == result.loss_history[-1]
    assert result.loss_history[-1] < result.loss_history[0]
    assert sum(result.loss_history[-3:]) < sum(result.loss_history[:3])
    assert result.wall_s > 0
    assert result.tokens_per_s > 0
    assert 0.0 <= result.accuracy <= 1.0
    # metrics: one record per iteration, in order, with the scheduled learning rate
    assert [step for step, _ in sink.records] == list(range(result.iterations))
    assert [r["loss"] for _, r in sink.records] == result.loss_history
    assert [r["lr"] for _, r in sink.records] == pytest.approx(
        [lr_at(i, result.iterations, cfg.optim.lr, cfg.optim.lr_warmup_steps) for i in range(result.iterations)]
    )
    assert set(sink.records[0][1]) >= {"loss", "vloss", "ploss", "accuracy", "lr", "tokens_per_s"}
    # the target's embeddings and lm_head stay frozen; the drafter's own weights move
    for key, value in frozen.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert not torch.equal(model.fc.weight, fc_before)
    assert not model.training


def test_train_drafter_is_reproducible(target, dataset: list[Sample]) -> None:
    cfg = TrainConfig(epochs=1, batch_size_per_gpu=6, seed=2)
    a = train_drafter(drafter_for(target), dataset, cfg)
    b = train_drafter(drafter_for(target), dataset, cfg)
    assert a.loss_history == b.loss_history


def test_train_drafter_needs_samples(target) -> None:
    with pytest.raises(ValueError, match="no samples"):
        train_drafter(drafter_for(target), [], TrainConfig())
