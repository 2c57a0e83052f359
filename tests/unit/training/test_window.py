"""Windowing, packing and the block-causal mask (pipeline.training.window)."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.window import block_causal_mask, pack, window_bounds


def _mask(length: int, start: int | None = None, end: int | None = None) -> torch.Tensor:
    """A loss mask of `length` tokens, 1 on [start, end)."""
    mask = torch.zeros(length, dtype=torch.int64)
    if start is not None:
        mask[start:end] = 1
    return mask


def _sample(doc: int, length: int, mask: torch.Tensor, hidden_size: int = 3) -> tuple[torch.Tensor, ...]:
    """A sample whose token ids and hidden rows encode (document, position): 1000 * doc + t."""
    code = 1000 * doc + torch.arange(length)
    hidden = code[:, None].float().repeat(1, hidden_size)
    return code.clone(), hidden, mask


# -- window_bounds ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_mask", "window", "expected"),
    [
        # FastRL's worked example: response 1500..2047 does not fit from its start, so the window
        # slides so that the response END is inside.
        pytest.param(_mask(2048, 1500, 2048), 512, (1536, 2048), id="fastrl-example"),
        pytest.param(_mask(20, 5, 20), 512, (0, 20), id="short-sample-fits-entirely"),
        pytest.param(_mask(20), 512, (0, 20), id="short-sample-no-response"),
        pytest.param(_mask(100, 30, 50), 40, (30, 70), id="response-in-middle-starts-at-response-start"),
        pytest.param(_mask(100, 90, 95), 40, (60, 100), id="late-response-window-ends-at-sample-end"),
        pytest.param(_mask(100), 40, (60, 100), id="no-response-last-tokens"),
        pytest.param(_mask(100, 10, 90), 40, (50, 90), id="long-response-keeps-response-end"),
        pytest.param(_mask(8, 0, 8), 8, (0, 8), id="exactly-window-long"),
    ],
)
def test_window_bounds(loss_mask: torch.Tensor, window: int, expected: tuple[int, int]) -> None:
    assert window_bounds(loss_mask, window) == expected


@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"seed{s}")
def test_window_bounds_invariants(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    length = int(torch.randint(2, 60, (1,), generator=g))
    window = int(torch.randint(2, 30, (1,), generator=g))
    a, b = sorted(torch.randint(0, length + 1, (2,), generator=g).tolist())
    mask = _mask(length, a, b) if b > a else _mask(length)

    start, end = window_bounds(mask, window)

    assert 0 <= start < end <= length
    assert end - start == min(length, window)
    if b > a:  # the response end is always inside the window
        assert start < b <= end


# -- pack -------------------------------------------------------------------------------------------------------


def test_pack_shifts_inside_each_sample() -> None:
    a = _sample(0, 4, torch.tensor([0, 1, 1, 1]))
    b = _sample(1, 3, torch.tensor([0, 0, 1]))

    batch = pack([a, b], window_tokens=512)

    # input_ids = ids[1:], hidden_states = hidden[:-1], target = hidden[1:], mask = mask[1:], per sample
    assert batch.input_ids.tolist() == [[1, 2, 3, 1001, 1002]]
    assert batch.hidden_states[0, :, 0].tolist() == [0, 1, 2, 1000, 1001]
    assert batch.target[0, :, 0].tolist() == [1, 2, 3, 1001, 1002]
    assert batch.loss_mask.tolist() == [[1.0, 1.0, 1.0, 0.0, 1.0]]
    assert batch.loss_mask.dtype == torch.float32
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1]]
    assert batch.num_tokens == 5
    assert batch.hidden_states.shape == batch.target.shape == (1, 5, 3)


def test_pack_keeps_views_and_to_fills_float32_inputs_and_targets() -> None:
    a = _sample(0, 6, _mask(6, 2, 6))
    b = _sample(1, 3, torch.tensor([0, 0, 1]))
    a = (a[0], a[1].to(torch.bfloat16), a[2])

    batch = pack([a, b], window_tokens=4)  # a's window is [2, 6)

    assert batch.windows[0].untyped_storage().data_ptr() == a[1].untyped_storage().data_ptr()  # not copied
    on_device = batch.to("cpu")
    assert on_device.hidden_states.dtype == on_device.target.dtype == torch.float32
    assert on_device.hidden_states[0, :, 0].tolist() == [2, 3, 4, 1000, 1001]
    assert on_device.target[0, :, 0].tolist() == [3, 4, 5, 1001, 1002]
    for name in ("input_ids", "loss_mask", "position_ids", "document_ids"):
        assert torch.equal(getattr(on_device, name), getattr(batch, name))
    assert on_device.num_tokens == batch.num_tokens == 5


def test_pack_applies_the_window_before_the_shift() -> None:
    sample = _sample(0, 10, _mask(10, 6, 10))

    batch = pack([sample], window_tokens=4)  # window [6, 10)

    assert batch.input_ids.tolist() == [[7, 8, 9]]
    assert batch.hidden_states[0, :, 0].tolist() == [6, 7, 8]
    assert batch.target[0, :, 0].tolist() == [7, 8, 9]
    assert batch.loss_mask.tolist() == [[1.0, 1.0, 1.0]]
    assert batch.position_ids.tolist() == [[0, 1, 2]]


def test_pack_no_pair_crosses_a_sample_boundary() -> None:
    g = torch.Generator().manual_seed(0)
    samples = []
    for doc in range(6):
        length = int(torch.randint(2, 15, (1,), generator=g))
        samples.append(_sample(doc, length, _mask(length, 1, length)))

    batch = pack(samples, window_tokens=8)

    src = batch.hidden_states[0, :, 0].long()
    tgt = batch.target[0, :, 0].long()
    ids = batch.input_ids[0]
    # Every position pairs f_t with x_{t+1} and f_{t+1} of the SAME document.
    assert torch.equal(src // 1000, tgt // 1000)
    assert torch.equal(src // 1000, ids // 1000)
    assert torch.equal(src // 1000, batch.document_ids[0])
    assert torch.equal(tgt - src, torch.ones_like(src))
    assert torch.equal(ids, tgt)
    # Position ids restart at 0 at every document start and count up inside it.
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = batch.document_ids[0, 1:] != batch.document_ids[0, :-1]
    assert (batch.position_ids[0][starts] == 0).all()
    assert torch.equal(batch.position_ids[0][~starts], batch.position_ids[0][torch.nonzero(~starts).flatten() - 1] + 1)
    assert batch.num_tokens == sum(min(s[0].shape[0], 8) - 1 for s in samples)


def test_pack_skips_samples_under_two_tokens() -> None:
    a = _sample(0, 4, _mask(4, 1, 4))
    tiny = _sample(1, 1, _mask(1, 0, 1))
    empty = _sample(2, 0, _mask(0))
    b = _sample(3, 3, _mask(3, 1, 3))

    batch = pack([a, tiny, empty, b], window_tokens=512)

    assert batch.num_tokens == 3 + 2
    _, counts = torch.unique_consecutive(batch.document_ids[0], return_counts=True)
    assert counts.tolist() == [3, 2]
    assert batch.input_ids.tolist() == [[1, 2, 3, 3001, 3002]]


@pytest.mark.parametrize(
    "samples",
    [
        pytest.param([], id="no-samples"),
        pytest.param([_sample(0, 1, _mask(1, 0, 1)), _sample(1, 0, _mask(0))], id="all-under-two-tokens"),
    ],
)
def test_pack_errors_when_no_sample_is_usable(samples: list) -> None:
    with pytest.raises(ValueError, match="at least 2 tokens"):
        pack(samples, window_tokens=512)


# -- block_causal_mask ------------------------------------------------------------------------------------------

TWO_DOCS_3_AND_2 = """
    1 0 0 . .
    1 1 0 . .
    1 1 1 . .
    . . . 1 0
    . . . 1 1
"""


def _ascii_mask(art: str) -> torch.Tensor:
    rows = [line.split() for line in art.strip().splitlines()]
    return torch.tensor([[cell == "1" for cell in row] for row in rows], dtype=torch.bool)


def test_block_causal_mask_two_documents() -> None:
    mask = block_causal_mask(torch.tensor([[0, 0, 0, 1, 1]]))

    assert mask.shape == (1, 1, 5, 5)
    assert mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], _ascii_mask(TWO_DOCS_3_AND_2))


def test_block_causal_mask_batches_independently() -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])

    mask = block_causal_mask(docs)

    assert torch.equal(mask[0, 0], _ascii_mask(TWO_DOCS_3_AND_2))
    assert torch.equal(mask[1, 0], torch.ones(5, 5, dtype=torch.bool).tril())
