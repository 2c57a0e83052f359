"""Speculative decoding on a GPU in bf16: device and dtype follow the target. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import DrafterConfig
from pipeline.evaluation.speculative import follow_target, generate_batch
from pipeline.evaluation.teacher_forced import estimate_acceptance
from pipeline.models.drafter import fresh_drafter
from tests.support.targets import tiny_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V, H, LAYERS, HEADS = 64, 64, 4, 4
MAX_NEW = 12


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    """bf16 rounds differently in a (k+1)-token verification than in a one-token step; a peaked lm_head keeps
    the greedy choices far apart, so that both pick the same token and the comparison tests our code."""
    model = tiny_target(V, H, LAYERS, HEADS)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.to("cuda", torch.bfloat16)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_bf16_batched_speculative_decoding_on_cuda_is_greedy(target: torch.nn.Module, kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (1, 5, 11)]
    drafter = fresh_drafter(DrafterConfig(kind=kind), target, torch.ones(V, dtype=torch.int64), 0)  # CPU, fp32
    drafter.attach(target)

    traces = generate_batch(target, follow_target(drafter, target), prompts, MAX_NEW, 3)

    assert next(drafter.parameters()).device.type == "cuda"
    assert next(drafter.parameters()).dtype == torch.bfloat16
    for trace, prompt in zip(traces, prompts, strict=True):
        ids = prompt[None].cuda()
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                   min_new_tokens=MAX_NEW, do_sample=False)
        assert trace.tokens == expected[0, prompt.shape[0] :].tolist()
    sequences = [torch.cat([p, torch.tensor(t.tokens)]) for p, t in zip(prompts, traces, strict=True)]
    estimate = estimate_acceptance(target, drafter, sequences, [p.shape[0] for p in prompts], 3)
    assert estimate is not None
    assert 1.0 <= estimate.tau <= 4.0
