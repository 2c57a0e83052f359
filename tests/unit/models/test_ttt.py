"""Training-time-test attention: the banded eager version (CPU) and FlexAttention's block-sparse
one (CUDA) against the dense eager one, and the bf16 training loss on a GPU against the float32 one
on the CPU."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.eagle import RMSNorm
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter
from pipeline.models.ttt import BandTTTCache, FlexTTTCache, TTTBand, TTTCache, ttt_cache
from pipeline.training import losses
from pipeline.training.losses import eagle3_loss
from pipeline.training.step import autocast
from pipeline.training.window import block_causal_mask, pack

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def _documents(*lengths: int) -> torch.Tensor:
    """(1, N) document ids of contiguous documents of these lengths."""
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


def _drafter(h: int, v: int, draft_vocab: int) -> tuple[Eagle3Drafter, RMSNorm, torch.Tensor, torch.Generator]:
    """A seeded EAGLE-3 drafter over three aux layers of hidden `h`, the target's final norm and its
    draft-vocab lm_head rows, and the generator the samples are drawn from."""
    torch.manual_seed(0)
    config = Eagle3Config(vocab_size=v, draft_vocab_size=draft_vocab, hidden_size=h, target_hidden_size=h,
                          intermediate_size=2 * h, num_attention_heads=4, num_key_value_heads=2,
                          aux_layer_ids=(0, 1, 2))
    model = Eagle3Drafter(config)
    norm = RMSNorm(h, 1e-5).requires_grad_(False)
    head = torch.randn(draft_vocab, h) * 0.1
    return model, norm, head, torch.Generator().manual_seed(1)


def test_a_cpu_unroll_of_short_documents_attends_in_a_band() -> None:
    """16 documents of 60 positions: the chunk starting at 896 is furthest into its document (at 840),
    so each chunk scores 56 + 64 keys, 15 x 64 x 120 scores, 12.5% of the dense block's."""
    cache = ttt_cache(_documents(*[60] * 16))
    assert isinstance(cache, BandTTTCache)
    assert (cache.band.lookback, cache.band.width) == (56, 120)


@pytest.mark.parametrize("lengths", [(5,), (1000,), (900, 100)], ids=["tiny", "one-long-document", "mostly-one"])
def test_a_cpu_unroll_whose_band_saves_little_attends_densely(lengths: tuple[int, ...]) -> None:
    assert isinstance(ttt_cache(_documents(*lengths)), TTTCache)


# Documents of 3, 2 and 3 positions in chunks of 3 (the last padded by one): each chunk's first query
# reaches back at most one position to its document's start, so each band is 1 + 3 keys wide.
BAND_3_2_3_IN_CHUNKS_OF_3 = """
    keys -1 0 1 2      keys 2 3 4 5      keys 5 6 7 8
      0   0 1 0 0        3  0 1 0 0        6  1 1 0 0
      1   0 1 1 0        4  0 1 1 0        7  1 1 1 0
      2   0 1 1 1        5  0 0 0 1        8  0 0 0 1
"""


def test_band_mask_of_three_documents_in_chunks_of_three() -> None:
    band = TTTBand.of(_documents(3, 2, 3), chunk=3)

    assert (band.chunks, band.lookback, band.width) == (3, 1, 4)
    rows = [line.split() for line in BAND_3_2_3_IN_CHUNKS_OF_3.strip().splitlines()[1:]]
    expected = torch.tensor([[[cell == "1" for cell in row[5 * c + 1 : 5 * c + 5]] for row in rows]
                             for c in range(3)])  # (chunks, C, W); position 8 pads the last chunk
    assert torch.equal(band.mask[0, 0], expected)


def test_band_mask_is_the_block_causal_mask_within_the_band() -> None:
    """Placed back at its keys' columns, the band's mask is `block_causal_mask`, rows of the batch apart."""
    docs = torch.cat([_documents(1, 20, 3, 1, 7), _documents(25, 7)])  # (2, 32)
    band = TTTBand.of(docs, chunk=8)
    dense = torch.zeros(2, band.chunks * 8, band.lookback + band.chunks * 8, dtype=torch.bool)
    for c in range(band.chunks):
        dense[:, 8 * c : 8 * c + 8, 8 * c : 8 * c + band.width] = band.mask[:, 0, c]
    assert torch.equal(dense[:, :32, band.lookback : band.lookback + 32], block_causal_mask(docs)[:, 0])


def _unroll(cache, queries, keys, values, mask) -> list[torch.Tensor]:
    return [cache.attend(q, k, v, mask) for q, k, v in zip(queries, keys, values, strict=True)]


@pytest.mark.parametrize(("lengths", "chunk"), [
    ((1, 30, 2, 50, 1, 9, 40, 7), 8),  # single-position documents; the 50 spans six chunks
    ((140,), 16),  # one long document: the band is the whole causal block
    ((37, 64, 27), 64),  # the shipped chunk, the last one padded
], ids=["mixed", "one-long-document", "chunk-64"])
def test_band_unroll_equals_the_dense_one_in_value_and_gradients(lengths: tuple[int, ...], chunk: int) -> None:
    """Three steps, float32 on the CPU: outputs and the gradients of every query, key and value.
    Not bit-equal: the band's softmax sums only the band's scores (the dense one also sums the
    masked ones, each exp(min) = 0), and its matmuls add in another order."""
    torch.manual_seed(0)
    heads, d, steps = 2, 16, 3
    docs = _documents(*lengths)  # (1, N)
    n = docs.shape[1]
    inputs = [torch.randn(steps, 1, heads, n, d) for _ in range(3)]  # queries, keys, values per step
    weights = torch.randn(steps, 1, heads, n, d)

    def run(cache):
        leaves = [x.clone().requires_grad_() for x in inputs]
        outs = torch.stack(_unroll(cache, *(list(x.unbind(0)) for x in leaves), block_causal_mask(docs)))
        (outs * weights).sum().backward()
        return outs, [x.grad for x in leaves]

    out, grads = run(BandTTTCache(TTTBand.of(docs, chunk)))
    ref, ref_grads = run(TTTCache())
    torch.testing.assert_close(out, ref)
    for name, grad, ref_grad in zip(("query", "key", "value"), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, msg=lambda m, name=name: f"{name}: {m}")


def test_eagle3_loss_with_the_band_equals_it_with_the_dense_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped loss on a packed batch (the band chosen by `ttt_cache`), against the same loss with
    the dense `TTTCache` put in its place: loss, accuracy and every parameter's gradient, float32."""
    h, v = 32, 64
    model, norm, head, g = _drafter(h, v, draft_vocab=40)
    samples = [(torch.randint(0, v, (n,), generator=g), torch.randn(n, 4 * h, generator=g),
                (torch.arange(n) >= 8).long()) for n in (64, 2, 30, 120, 45, 9, 70, 33)]
    batch = pack(samples, window_tokens=128).to("cpu")
    assert isinstance(ttt_cache(batch.document_ids), BandTTTCache)

    def run():
        m = Eagle3Drafter(model.config)
        m.load_state_dict(model.state_dict())
        parts = eagle3_loss(m, batch, norm, head, ttt_steps=3, decay=0.8)
        parts.loss.backward()
        return parts, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    band, grads = run()
    monkeypatch.setattr(losses, "ttt_cache", lambda document_ids: TTTCache())
    dense, ref_grads = run()
    torch.testing.assert_close(band.loss, dense.loss)
    torch.testing.assert_close(band.accuracy, dense.accuracy)
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name], ref_grad, msg=lambda m, name=name: f"{name}: {m}")


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
    h, v = 64, 96
    model, norm, head, g = _drafter(h, v, draft_vocab=48)
    samples = [(torch.randint(0, v, (n,), generator=g), torch.randn(n, 4 * h, generator=g),
                torch.ones(n, dtype=torch.int64)) for n in (150, 97, 60)]
    batch = pack(samples, window_tokens=256)

    def run(device: str, dtype: str):
        m = Eagle3Drafter(model.config).to(device)
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
