"""The training step (pipeline.training.step): optimizer parameter groups, precision, and the GPU
benchmark's use of it, at tiny shapes on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.training import DrafterShapes, main, model_flops_per_token, shipped_step
from pipeline.models.eagle import EagleConfig, EagleDrafter
from pipeline.training.step import apply_gradients, autocast, clip_to, make_optimizer, param_groups, squared_norm
from tests.support.targets import tiny_target

TINY = DrafterShapes(hidden=64, heads=4, kv_heads=2, mlp=128, vocab=256, draft_vocab=64, tokens=32, docs=2)


def _drafter() -> EagleDrafter:
    target = tiny_target(32, 32, 1, 2)
    model = EagleDrafter(EagleConfig.from_target(target.config))
    model.attach(target)
    return model


def test_norms_and_biases_are_not_decayed() -> None:
    model = _drafter()
    decay, no_decay = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} == {
        n for n, p in model.named_parameters() if p.requires_grad and (n.endswith("bias") or "norm" in n)}
    assert no_decay["params"]  # the drafter has norms
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decay["params"]) + len(no_decay["params"]) == len(trainable)  # frozen heads in neither
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.1, device="cpu")
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("grad_clip", [0.05, 100.0])  # clipped, and left as it is
def test_a_given_norm_clips_as_clip_grad_norm_does(grad_clip: float) -> None:
    """A sharded drafter's ranks sum the squares of their gradient's shards with the step's figures;
    the step then clips with that norm, as `clip_grad_norm_` would over the whole gradient."""
    model = _drafter()
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    expected = [x.clone() for x in grads]
    for p, x in zip(params, grads, strict=True):
        p.grad = x
    norm = squared_norm([p.grad for p in params]).sqrt()[0]
    clip_to(params, grad_clip, norm)
    reference = [torch.nn.Parameter(torch.zeros_like(x)) for x in expected]
    for p, x in zip(reference, expected, strict=True):
        p.grad = x
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, grad_clip)
    torch.testing.assert_close(norm, expected_norm)
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p.grad, r.grad)
    # apply_gradients takes the norm as given, and returns it
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.0, device="cpu")
    assert apply_gradients(optimizer, params, 1e-2, grad_clip, norm) is norm
    assert all(p.grad is None for p in params)


def test_a_cpu_trains_in_fp32_whatever_the_setting() -> None:
    with autocast("cpu", "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_the_gpu_benchmark_builds_its_batch_and_steps_on_cpu() -> None:
    step = shipped_step(TINY, "cpu")
    first, second = step(), step()
    assert torch.isfinite(first.loss)
    assert first.loss.device.type == "cpu"
    assert not torch.equal(first.loss, second.loss)  # the step updated the weights
    assert model_flops_per_token(TINY, 3) > 0


def test_the_gpu_benchmark_reports_no_mfu_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine measures MFU")
    main(["--gpu"])
    assert json.loads(capsys.readouterr().out) == {"gpu_mfu": None, "gpu": None}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_autocast_keeps_fp32_weights_on_cuda() -> None:
    """bf16 matmuls under autocast; the parameters, their gradients and AdamW's state stay fp32."""
    step = shipped_step(TINY, "cuda", "bf16")
    stats = step()
    assert stats.loss.device.type == "cuda"
    assert torch.isfinite(stats.loss)
    with autocast("cuda", "bf16"):
        assert (torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")).dtype == torch.bfloat16
    with autocast("cuda", "fp32"):
        assert (torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")).dtype == torch.float32
