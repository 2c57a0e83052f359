"""Drafter training: learning-rate schedule and the training loop."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.config import OptimConfig, TrainConfig
from pipeline.models import target_forward
from pipeline.models.eagle import EagleConfig, EagleDrafter
from pipeline.training.dataset import InMemoryDataset, Sample, plan_epoch
from pipeline.training.loop import fitted_warmup, lr_at, train_drafter
from pipeline.training.losses import eagle3_loss
from pipeline.training.window import pack
from tests.support import eagle3
from tests.support.targets import tiny_target

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


# -- train_drafter ----------------------------------------------------------------------------------------------


class RecordingSink:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_dict(self, payload: dict[str, float], step: int) -> None:
        self.records.append((step, dict(payload)))


@pytest.fixture(scope="module")
def target():
    return tiny_target(V, H, 1, HEADS)


@pytest.fixture(scope="module")
def dataset(target) -> list[Sample]:
    """Token sequences from a repetitive little language, with the target's real features."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(12):
        n = int(torch.randint(12, 24, (1,), generator=g))
        start = int(torch.randint(0, V, (1,), generator=g))
        ids = (start + 3 * torch.arange(n)) % V
        hidden = target_forward.forward(target, ids[None]).features[0].float()
        mask = torch.ones(n, dtype=torch.int64)
        mask[:4] = 0
        out.append((ids, hidden, mask))
    return out


def drafter_for(target) -> EagleDrafter:
    torch.manual_seed(0)
    model = EagleDrafter(EagleConfig.from_target(target.config))
    model.attach(target)
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

    result = train_drafter(model, InMemoryDataset(dataset), cfg, sink=sink)

    expected_iterations = sum(len(plan_epoch([len(s[0]) for s in dataset], cfg, e)) for e in range(cfg.epochs))
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
        [lr_at(i, result.iterations, cfg.optim.lr, fitted_warmup(2, result.iterations))
         for i in range(result.iterations)]
    )
    assert set(sink.records[0][1]) >= {"loss", "vloss", "ploss", "accuracy", "lr", "tokens_per_s"}
    # the target's embeddings and lm_head stay frozen; the drafter's own weights move
    for key, value in frozen.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert not torch.equal(model.fc.weight, fc_before)
    assert not model.training


def test_warmup_is_at_most_a_tenth_of_the_run() -> None:
    assert fitted_warmup(10, 220) == 10
    assert fitted_warmup(10, 40) == 4
    assert fitted_warmup(10, 5) == 1
    assert fitted_warmup(0, 40) == 0


def test_token_budget_bounds_the_run_and_the_schedule_spans_it(target, dataset: list[Sample]) -> None:
    """train.max_tokens: batches epoch after epoch until the next would pass the budget; epochs stay an
    upper bound; the learning rate decays to 10% at the budget's last iteration."""
    per_epoch = sum(ids.shape[0] - 1 for ids, _, _ in dataset)
    cfg = TrainConfig(epochs=6, batch_size_per_gpu=4, max_seq_len=128, window_tokens=128, seed=1,
                      max_tokens=int(2.5 * per_epoch), optim=OptimConfig(lr=3e-3, lr_warmup_steps=2))
    sink = RecordingSink()
    result = train_drafter(drafter_for(target), InMemoryDataset(dataset), cfg, sink=sink)
    assert 2 * per_epoch < result.tokens <= cfg.max_tokens
    assert result.iterations < 3 * 3  # 3 batches an epoch: the third epoch is cut
    assert sink.records[-1][1]["lr"] == pytest.approx(lr_at(result.iterations - 1, result.iterations, 3e-3, 1))
    assert lr_at(result.iterations, result.iterations, 3e-3, 1) == pytest.approx(3e-4)
    bounded = train_drafter(drafter_for(target), InMemoryDataset(dataset),
                            cfg.model_copy(update={"max_tokens": 100 * per_epoch, "epochs": 2}))
    assert bounded.tokens == 2 * per_epoch  # epochs bound a budget larger than they allow
    one = train_drafter(drafter_for(target), InMemoryDataset(dataset), cfg.model_copy(update={"max_tokens": 1}))
    assert one.iterations == 1  # at least one batch


def test_train_drafter_is_reproducible(target, dataset: list[Sample]) -> None:
    cfg = TrainConfig(epochs=1, batch_size_per_gpu=6, seed=2)
    a = train_drafter(drafter_for(target), InMemoryDataset(dataset), cfg)
    b = train_drafter(drafter_for(target), InMemoryDataset(dataset), cfg)
    assert a.loss_history == b.loss_history


def test_train_drafter_needs_samples(target) -> None:
    with pytest.raises(ValueError, match="no samples"):
        train_drafter(drafter_for(target), InMemoryDataset([]), TrainConfig())


def test_metrics_logged_every_n_iterations_are_those_of_every_iteration(target, dataset: list[Sample]) -> None:
    """Copying the figures to the host every `log_every` iterations changes neither the training nor the
    log: each iteration is logged once, in order, with its own loss and gradient norm."""
    runs = {}
    for log_every in (1, 5):
        cfg = TrainConfig(epochs=2, batch_size_per_gpu=3, seed=3, log_every=log_every)
        sink = RecordingSink()
        result = train_drafter(drafter_for(target), InMemoryDataset(dataset), cfg, sink=sink)
        runs[log_every] = (result, sink.records)
    (every, every_records), (fifth, fifth_records) = runs[1], runs[5]
    assert fifth.iterations % 5 != 0  # the last, partial window is logged too
    assert fifth.loss_history == every.loss_history
    assert [step for step, _ in fifth_records] == list(range(fifth.iterations))
    for (_, a), (_, b) in zip(every_records, fifth_records, strict=True):
        assert {k: a[k] for k in ("loss", "vloss", "ploss", "accuracy", "grad_norm", "lr")} == {
            k: b[k] for k in ("loss", "vloss", "ploss", "accuracy", "grad_norm", "lr")}
    assert all(r["grad_norm"] > 0 for _, r in fifth_records)


def test_on_logged_sees_each_logged_window_and_the_positions_so_far(target, dataset: list[Sample]) -> None:
    """The hook runs after every `log_every` iterations with the last one's figures and the positions trained;
    what it does (an evaluation that switches the drafter to eval and back) leaves the training unchanged."""
    cfg = TrainConfig(epochs=2, batch_size_per_gpu=3, seed=3, log_every=4)
    plain = train_drafter(drafter_for(target), InMemoryDataset(dataset), cfg)
    model = drafter_for(target)
    calls = []

    def evaluate(metrics, tokens: int) -> None:
        assert model.training
        model.eval()
        calls.append((metrics.iteration, metrics.loss, tokens))
        model.train()

    result = train_drafter(model, InMemoryDataset(dataset), cfg, on_logged=evaluate)
    assert result.loss_history == plain.loss_history
    expected = [*range(3, result.iterations, 4)]
    if expected[-1] != result.iterations - 1:
        expected.append(result.iterations - 1)  # the last, partial window
    assert [i for i, _, _ in calls] == expected
    assert [loss for _, loss, _ in calls] == [result.loss_history[i] for i in expected]
    assert [t for _, _, t in calls] == sorted({t for _, _, t in calls})
    assert calls[-1][2] == result.tokens


# -- EAGLE-3 ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peaked_target() -> LlamaForCausalLM:
    """A random target's next-token distribution is almost uniform (the soft cross-entropy would sit at its
    entropy floor from the start); a larger lm_head gives the drafter something to learn."""
    model = eagle3.eagle3_target()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


def test_train_drafter_lowers_the_eagle3_loss(peaked_target: LlamaForCausalLM) -> None:
    target = peaked_target
    model = eagle3.drafter_for(target, seed=0)
    samples = eagle3.target_samples(target, model.config.aux_layer_ids, 8, seed=1)
    teacher = model.teacher(target)
    cfg = TrainConfig(
        epochs=8, batch_size_per_gpu=4, max_seq_len=128, window_tokens=128, seed=1, ttt_steps=2, ttt_decay=0.8,
        optim=OptimConfig(lr=3e-3, lr_warmup_steps=2),
    )
    fixed = pack(samples, window_tokens=128).to("cpu")
    embed_before = model.embed_tokens.weight.detach().clone()
    vocab_before = (model.d2t.clone(), model.t2d.clone())
    with torch.no_grad():
        before = eagle3_loss(model.eval(), fixed, teacher.norm, teacher.head, 2, 0.8)

    result = train_drafter(model, InMemoryDataset(samples), cfg, teacher=teacher)

    with torch.no_grad():
        after = eagle3_loss(model, fixed, teacher.norm, teacher.head, 2, 0.8)
    assert after.loss.item() < 0.85 * before.loss.item()
    assert after.accuracy.item() > before.accuracy.item() + 0.2
    assert sum(result.loss_history[-3:]) < sum(result.loss_history[:3])
    assert result.vloss == 0.0
    assert torch.equal(model.embed_tokens.weight, embed_before)
    assert torch.equal(model.d2t, vocab_before[0])
    assert torch.equal(model.t2d, vocab_before[1])
    assert all(p.grad is None for p in target.parameters())


def test_train_drafter_needs_a_teacher_for_eagle3() -> None:
    target = eagle3.eagle3_target()
    model = eagle3.drafter_for(target)
    samples = eagle3.target_samples(target, model.config.aux_layer_ids, 2)
    with pytest.raises(ValueError, match="teacher"):
        train_drafter(model, InMemoryDataset(samples), TrainConfig(epochs=1, max_seq_len=128, window_tokens=128))


# The first iterations of an EAGLE-3 training on the fixed-seed drafter, samples and peaked target
# above, as this loop ran them once (one thread, CPU, float32): a change in the model, the loss, the
# data order or the optimizer moves them.
PINNED_EAGLE3_LOSSES = (3.9040470123291016, 3.715601682662964, 3.336498975753784, 3.116666316986084,
                        3.047180652618408, 3.090092658996582)


def test_eagle3_loss_trajectory_is_pinned(peaked_target: LlamaForCausalLM) -> None:
    model = eagle3.drafter_for(peaked_target, seed=0)
    samples = eagle3.target_samples(peaked_target, model.config.aux_layer_ids, 4, seed=1)
    cfg = TrainConfig(epochs=3, batch_size_per_gpu=2, max_seq_len=64, window_tokens=64, seed=1, ttt_steps=2,
                      ttt_decay=0.8, optim=OptimConfig(lr=3e-3, lr_warmup_steps=1))

    result = train_drafter(model, InMemoryDataset(samples), cfg, teacher=model.teacher(peaked_target))

    torch.testing.assert_close(torch.tensor(result.loss_history), torch.tensor(PINNED_EAGLE3_LOSSES),
                               rtol=1e-4, atol=1e-5)
