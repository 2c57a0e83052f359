"""Training-time-test attention: FlexAttention's block-sparse version (CUDA) against the eager one,
and the bf16 training loss on a GPU against the float32 one on the CPU."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.eagle import RMSNorm
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter
from pipeline.models.ttt import FlexTTTCache, TTTCache, ttt_cache
from pipeline.training.losses import eagle3_loss
from pipeline.training.step import autocast
from pipeline.training.window import block_causal_mask, pack

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def test_a_cpu_unroll_attends_eagerly() -> None:
    assert isinstance(ttt_cache(torch.zeros(1, 5, dtype=torch.int64)), TTTCache)


def _unroll(cache, queries, keys, values, mask) -> list[torch.Tensor]:
    return [cache.attend(q, k, v, mask) for q, k, v in zip(queries, keys, values, strict=True)]


@cuda
def test_flex_unroll_equals_the_eager_one_in_value_and_gradients() -> None:
    """Three steps over three documents of a length that no 128-tile divides; bf16 on the GPU
    against float32 on the CPU, to bf16 accuracy."""
    torch.manual_seed(0)
    heads, n, d, steps = 4, 300, 64, 3
    docs = torch.tensor([0] * 120 + [1] * 100 + [2] * 80)[None]  # (1, N)
    inputs = [torch.randn(steps, 1, heads, n, d) for _ in range(3)]  # queries, keys, values per step
    weights = torch.randn(steps, 1, heads, n, d)

    def run(device: str, dtype: torch.dtype):
        leaves = [x.to(device, dtype, copy=True).requires_grad_() for x in inputs]
        cache = ttt_cache(docs.to(device))
        outs = _unroll(cache, *(list(x.unbind(0)) for x in leaves), block_causal_mask(docs.to(device)))
        (torch.stack(outs).float() * weights.to(device)).sum().backward()
        return cache, torch.stack(outs), [x.grad for x in leaves]

    flex, out, grads = run("cuda", torch.bfloat16)
    eager, ref, ref_grads = run("cpu", torch.float32)
    assert isinstance(flex, FlexTTTCache)
    assert isinstance(eager, TTTCache)
    assert _rel(out.cpu(), ref) < 1e-2
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert _rel(grad.cpu(), ref_grad) < 2e-2


@cuda
def test_bf16_eagle3_loss_on_cuda_matches_fp32_on_cpu() -> None:
    """The shipped loss under bf16 autocast (FlexAttention, bf16 matmuls in the chunked soft
    cross-entropy) against float32 eager on the CPU: loss and every gradient."""
    torch.manual_seed(0)
    h, v = 64, 96
    config = Eagle3Config(vocab_size=v, draft_vocab_size=48, hidden_size=h, target_hidden_size=h,
                          intermediate_size=2 * h, num_attention_heads=4, num_key_value_heads=2,
                          aux_layer_ids=(0, 1, 2))
    model = Eagle3Drafter(config)
    norm = RMSNorm(h, 1e-5).requires_grad_(False)
    head = torch.randn(48, h) * 0.1
    g = torch.Generator().manual_seed(1)
    samples = [(torch.randint(0, v, (n,), generator=g), torch.randn(n, 4 * h, generator=g),
                torch.ones(n, dtype=torch.int64)) for n in (150, 97, 60)]
    batch = pack(samples, window_tokens=256)

    def run(device: str, dtype: str):
        m = Eagle3Drafter(config).to(device)
        m.load_state_dict(model.state_dict())
        with autocast(device, dtype):
            parts = eagle3_loss(m, batch.to(device), norm.to(device), head.to(device), ttt_steps=3, decay=0.8)
        parts.loss.backward()
        return parts.loss.detach().cpu(), {n: p.grad.cpu() for n, p in m.named_parameters() if p.requires_grad}

    loss, grads = run("cuda", "bf16")
    ref_loss, ref_grads = run("cpu", "fp32")
    assert abs(float(loss) - float(ref_loss)) < 1e-2 * float(ref_loss)
    for name, ref_grad in ref_grads.items():
        assert _rel(grads[name], ref_grad) < 5e-2, name
