"""Drafter losses: the chunked soft cross-entropy, eagle_loss, and eagle3_loss's TTT weighting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipeline.models.eagle import RMSNorm
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter, TTTCache
from pipeline.training.losses import eagle3_loss, eagle_loss, soft_cross_entropy, soft_cross_entropy_reference
from pipeline.training.window import DeviceBatch, block_causal_mask, pack

# -- soft_cross_entropy -----------------------------------------------------------------------------------------


def _sce_inputs(n: int = 10, v: int = 24, h: int = 8, ht: int = 6, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    target_hidden = torch.randn(n, ht, generator=g, dtype=dtype)
    target_weight = torch.randn(v, ht, generator=g, dtype=dtype)
    mask = (torch.rand(n, generator=g) > 0.3).to(dtype)
    mask[0], mask[-1] = 0.0, 1.0  # at least one zero and one one
    return hidden, weight, target_hidden, target_weight, mask


@pytest.mark.parametrize("chunk", [3, 10, 64], ids=["chunk<N", "chunk=N", "chunk>N"])
def test_chunked_equals_reference_in_value_and_gradients(chunk: int) -> None:
    hidden, weight, target_hidden, target_weight, mask = _sce_inputs()
    assert (mask == 0).any()
    assert (mask == 1).any()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    loss, _ = soft_cross_entropy(h1, w1, target_hidden, target_weight, mask, chunk_tokens=chunk)
    expected = soft_cross_entropy_reference(h2, w2, target_hidden, target_weight, mask)

    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    # a non-unit upstream gradient checks that backward scales by it
    (2.5 * loss).backward()
    (2.5 * expected).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)
    # masked tokens get exactly zero gradient
    assert torch.equal(h1.grad[mask == 0], torch.zeros_like(h1.grad[mask == 0]))
    assert h1.grad[mask == 1].abs().sum() > 0


def test_chunked_loss_is_the_masked_sum_of_per_token_cross_entropies() -> None:
    hidden, weight, target_hidden, target_weight, mask = _sce_inputs(seed=3)
    loss, _ = soft_cross_entropy(hidden, weight, target_hidden, target_weight, mask, chunk_tokens=4)
    expected = 0.0
    for t in range(hidden.shape[0]):
        p = (target_hidden[t] @ target_weight.T).softmax(-1)
        log_q = (hidden[t] @ weight.T).log_softmax(-1)
        expected += float(mask[t]) * float(-(p * log_q).sum())
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_weight_without_requires_grad_gets_no_gradient() -> None:
    hidden, weight, target_hidden, target_weight, mask = _sce_inputs(seed=1)
    h1 = hidden.clone().requires_grad_()
    h2 = hidden.clone().requires_grad_()

    loss, _ = soft_cross_entropy(h1, weight, target_hidden, target_weight, mask, chunk_tokens=4)
    loss.backward()
    soft_cross_entropy_reference(h2, weight, target_hidden, target_weight, mask).backward()

    assert weight.grad is None
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)


def test_target_side_gets_no_gradient() -> None:
    hidden, weight, target_hidden, target_weight, mask = _sce_inputs(seed=2)
    target_hidden.requires_grad_()
    target_weight.requires_grad_()
    h = hidden.clone().requires_grad_()
    loss, _ = soft_cross_entropy(h, weight, target_hidden, target_weight, mask, chunk_tokens=4)
    loss.backward()
    assert target_hidden.grad is None
    assert target_weight.grad is None
    assert h.grad is not None


@pytest.mark.parametrize("chunk", [1, 4, 100], ids=["chunk1", "chunk4", "chunk100"])
def test_agreement_is_the_argmax_agreement_per_row(chunk: int) -> None:
    n = 40
    _, _, target_hidden, target_weight, mask = _sce_inputs(n=n, v=5, seed=4)
    # the drafter reads the target's logits exactly on odd tokens and noisy ones on even tokens
    hidden, weight = target_hidden.clone(), target_weight.clone()
    noise = torch.randn(n, target_hidden.shape[1], generator=torch.Generator().manual_seed(9), dtype=hidden.dtype)
    hidden[::2] += 3.0 * noise[::2]

    _, agreement = soft_cross_entropy(hidden, weight, target_hidden, target_weight, mask, chunk_tokens=chunk)

    agree = (hidden @ weight.T).argmax(-1) == (target_hidden @ target_weight.T).argmax(-1)
    assert 0 < int((agree & (mask == 1)).sum()) < int(mask.sum())  # a mix of hits and misses among valid tokens
    assert torch.equal(agreement, agree)
    assert not agreement.requires_grad


def _record_saved_shapes(fn) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        fn()
    return shapes


class _RecordShapes(TorchFunctionMode):
    """Every tensor any torch function returns while active (forward and the custom backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


N_BIG, V_BIG, CHUNK_BIG = 64, 512, 16


def _big_inputs():
    hidden, weight, target_hidden, target_weight, mask = _sce_inputs(
        n=N_BIG, v=V_BIG, h=16, ht=16, seed=5, dtype=torch.float32
    )
    return hidden.requires_grad_(), weight.requires_grad_(), target_hidden, target_weight, mask


def test_chunked_graph_saves_nothing_of_the_size_of_the_logits() -> None:
    hidden, weight, target_hidden, target_weight, mask = _big_inputs()
    out: list[torch.Tensor] = []

    chunked = _record_saved_shapes(
        lambda: out.append(soft_cross_entropy(hidden, weight, target_hidden, target_weight, mask, CHUNK_BIG)[0])
    )
    reference = _record_saved_shapes(
        lambda: soft_cross_entropy_reference(hidden, weight, target_hidden, target_weight, mask)
    )

    assert (N_BIG, V_BIG) in reference  # the hook does see the reference's full (N, V) tensors
    assert chunked, "the hook recorded nothing"
    assert (N_BIG, V_BIG) not in chunked
    # nothing saved is larger than the largest input (here the (V, H) weight)
    largest_input = max(t.numel() for t in (hidden, weight, target_hidden, target_weight, mask))
    assert max(torch.Size(s).numel() for s in chunked) <= largest_input < N_BIG * V_BIG
    out[0].backward()  # the saved inputs are enough for backward
    assert hidden.grad is not None
    assert weight.grad is not None


def test_chunked_never_creates_a_full_logits_tensor_forward_or_backward() -> None:
    hidden, weight, target_hidden, target_weight, mask = _big_inputs()
    chunked, reference = _RecordShapes(), _RecordShapes()

    with chunked:
        loss, _ = soft_cross_entropy(hidden, weight, target_hidden, target_weight, mask, CHUNK_BIG)
        loss.backward()
    with reference:
        soft_cross_entropy_reference(hidden, weight, target_hidden, target_weight, mask)

    assert (N_BIG, V_BIG) in reference.shapes
    assert (CHUNK_BIG, V_BIG) in chunked.shapes  # the recorder sees the chunk-sized logits ...
    assert all(torch.Size(s).numel() < N_BIG * V_BIG for s in chunked.shapes)  # ... and nothing full-sized


# -- eagle_loss -------------------------------------------------------------------------------------------------

# eagle_loss on the fixed-seed example below, computed once with the inline formulas of
# test_eagle_loss_pinned_value (smooth L1 and soft cross-entropy written out by hand).
PINNED_VLOSS = 0.3488847524
PINNED_PLOSS = 1.3150193919
PINNED_ACCURACY = 0.8


def _pinned_example():
    g = torch.Generator().manual_seed(1234)
    predicted = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    target = predicted + 0.8 * torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    lm_head = torch.randn(6, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]])
    return predicted, target, lm_head, mask


def _inline_eagle_loss(predicted, target, lm_head, mask) -> tuple[float, float, float]:
    vl, pl, hits, count = 0.0, 0.0, 0, 0
    for b in range(predicted.shape[0]):
        for t in range(predicted.shape[1]):
            if not mask[b, t]:
                continue
            d = (predicted[b, t] - target[b, t]).abs()
            vl += float(torch.where(d < 1, 0.5 * d**2, d - 0.5).mean())
            q_logits, p_logits = lm_head @ predicted[b, t], lm_head @ target[b, t]
            log_q = q_logits - torch.logsumexp(q_logits, 0)
            p = torch.exp(p_logits - torch.logsumexp(p_logits, 0))
            pl += float(-(p * log_q).sum())
            hits += int(q_logits.argmax() == p_logits.argmax())
            count += 1
    return vl / count, pl / count, hits / count


def test_eagle_loss_pinned_value() -> None:
    predicted, target, lm_head, mask = _pinned_example()
    vloss, ploss, accuracy = _inline_eagle_loss(predicted, target, lm_head, mask)
    # the inline formulas still give the pinned numbers
    assert (vloss, ploss, accuracy) == pytest.approx((PINNED_VLOSS, PINNED_PLOSS, PINNED_ACCURACY), abs=1e-9)

    parts = eagle_loss(predicted, target, lm_head, mask, vloss_weight=0.3, ploss_weight=0.7)

    f64 = torch.float64
    torch.testing.assert_close(parts.vloss, torch.tensor(PINNED_VLOSS, dtype=f64), rtol=0, atol=1e-9)
    torch.testing.assert_close(parts.ploss, torch.tensor(PINNED_PLOSS, dtype=f64), rtol=0, atol=1e-9)
    torch.testing.assert_close(parts.accuracy, torch.tensor(PINNED_ACCURACY, dtype=f64), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        parts.loss, torch.tensor(0.3 * PINNED_VLOSS + 0.7 * PINNED_PLOSS, dtype=f64), rtol=0, atol=1e-9
    )


# -- eagle3_loss ------------------------------------------------------------------------------------------------

V, DV, H, HEADS = 32, 24, 32, 2
AUX = (0, 1, 2)


@pytest.fixture(scope="module")
def eagle3_setup() -> tuple[Eagle3Drafter, DeviceBatch, RMSNorm, torch.Tensor]:
    torch.manual_seed(0)
    model = Eagle3Drafter(Eagle3Config(
        vocab_size=V, draft_vocab_size=DV, hidden_size=H, target_hidden_size=H, intermediate_size=2 * H,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, aux_layer_ids=AUX,
    ))
    norm = RMSNorm(H, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(H))
    head = torch.randn(DV, H)
    g = torch.Generator().manual_seed(3)
    samples = []
    for n, masked in ((7, 2), (9, 3)):
        ids = torch.randint(0, V, (n,), generator=g)
        hidden = torch.randn(n, (len(AUX) + 1) * H, generator=g)
        mask = torch.ones(n, dtype=torch.int64)
        mask[:masked] = 0
        samples.append((ids, hidden, mask))
    batch = pack(samples, window_tokens=64).to("cpu")
    assert batch.document_ids.unique().numel() == 2
    return model, batch, norm, head


def _shift_by_hand(x: torch.Tensor, docs: torch.Tensor, k: int) -> torch.Tensor:
    """x (N, ...) -> x[t + k] when t + k is in t's document, else zeros."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        if t + k < x.shape[0] and docs[t + k] == docs[t]:
            out[t] = x[t + k]
    return out


def _step_losses(model, batch, norm, head, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-step masked-mean soft CE, from the drafter's step outputs and the teacher written out here."""
    aux_dim = len(AUX) * H
    docs, positions = batch.document_ids[0], batch.position_ids
    ids, aux, last = batch.input_ids[0], batch.hidden_states[..., :aux_dim], batch.target[0, :, aux_dim:]
    mask = block_causal_mask(batch.document_ids)
    cache, state, losses, accuracy = TTTCache(), model.project_aux(aux), [], None
    for k in range(steps):
        step_ids = _shift_by_hand(ids, docs, k)
        valid = _shift_by_hand(batch.loss_mask[0], docs, k)
        teacher_hidden = _shift_by_hand(last, docs, k)
        state = model.step(step_ids[None], state, positions, mask, cache)
        logits = model.lm_head(model.logits_input(state))[0]  # (N, DV)
        p = F.softmax(norm(teacher_hidden) @ head.T, dim=-1)
        per_token = -(p * F.log_softmax(logits, dim=-1)).sum(-1)
        losses.append((per_token * valid).sum() / valid.sum())
        if k == 0:
            accuracy = ((logits.argmax(-1) == p.argmax(-1)).float() * valid).sum() / valid.sum()
    return losses, accuracy


@torch.no_grad()
def test_eagle3_loss_one_step_is_the_step0_soft_cross_entropy(eagle3_setup) -> None:
    model, batch, norm, head = eagle3_setup
    (l0,), accuracy = _step_losses(model, batch, norm, head, 1)

    parts = eagle3_loss(model, batch, norm, head, ttt_steps=1, decay=0.8)

    torch.testing.assert_close(parts.loss, l0)
    torch.testing.assert_close(parts.ploss, l0)
    assert parts.vloss.item() == 0.0
    torch.testing.assert_close(parts.accuracy, accuracy)


@pytest.mark.parametrize("decay", [0.8, 0.5, 1.0], ids=["decay0.8", "decay0.5", "decay1"])
@torch.no_grad()
def test_eagle3_loss_weights_steps_by_decay(eagle3_setup, decay: float) -> None:
    model, batch, norm, head = eagle3_setup
    (l0, l1, l2), accuracy = _step_losses(model, batch, norm, head, 3)
    assert abs(l0.item() - l1.item()) > 1e-3  # the weighting is observable

    two = eagle3_loss(model, batch, norm, head, ttt_steps=2, decay=decay)
    three = eagle3_loss(model, batch, norm, head, ttt_steps=3, decay=decay)

    torch.testing.assert_close(two.loss, (l0 + decay * l1) / (1 + decay))
    torch.testing.assert_close(three.loss, (l0 + decay * l1 + decay**2 * l2) / (1 + decay + decay**2))
    torch.testing.assert_close(two.accuracy, accuracy)  # accuracy is step 0's



# eagle3_loss of eagle3_setup's fixed-seed drafter and batch over three TTT steps with decay 0.8, computed
# once and checked then against the per-step losses _step_losses writes out (their decay-weighted mean).
PINNED_EAGLE3_STEP_LOSSES = (3.3190598487854004, 3.357123374938965, 3.579554796218872)
PINNED_EAGLE3_LOSS = 3.3998661041259766


@torch.no_grad()
def test_eagle3_loss_pinned_value(eagle3_setup) -> None:
    model, batch, norm, head = eagle3_setup
    steps, _ = _step_losses(model, batch, norm, head, 3)
    torch.testing.assert_close(torch.stack(steps), torch.tensor(PINNED_EAGLE3_STEP_LOSSES), rtol=1e-5, atol=1e-6)

    parts = eagle3_loss(model, batch, norm, head, ttt_steps=3, decay=0.8)

    torch.testing.assert_close(parts.loss, torch.tensor(PINNED_EAGLE3_LOSS), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts.ploss, parts.loss)  # EAGLE-3 has no feature regression
    assert parts.vloss.item() == 0.0
