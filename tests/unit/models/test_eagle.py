"""The EAGLE drafter, its vLLM-shaped checkpoint, and the EAGLE training loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.models.checkpoint import CheckpointError, load_drafter, save_drafter
from pipeline.models.eagle import EagleConfig, EagleDrafter
from pipeline.training.losses import eagle_loss
from pipeline.training.window import block_causal_mask
from tests.support.targets import tiny_target

V, H, HEADS = 32, 32, 2


def tiny_config(kv_heads: int = HEADS) -> EagleConfig:
    return EagleConfig(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_attention_heads=HEADS, num_key_value_heads=kv_heads
    )


def tiny_drafter(seed: int = 0, kv_heads: int = HEADS) -> EagleDrafter:
    torch.manual_seed(seed)
    return EagleDrafter(tiny_config(kv_heads)).eval()


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def inputs(n: int, seed: int = 1, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, H, generator=g), torch.randint(0, V, (batch, n), generator=g)


# -- forward ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize(("batch", "n"), [(1, 1), (2, 7), (3, 16)], ids=["1x1", "2x7", "3x16"])
def test_forward_shapes(kv_heads: int, batch: int, n: int) -> None:
    model = tiny_drafter(kv_heads=kv_heads)
    hidden, ids = inputs(n, batch=batch)
    positions = torch.arange(n).expand(batch, n)

    out = model(hidden, ids, positions, causal(n).expand(batch, 1, n, n))

    assert out.shape == (batch, n, H)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_forward_rejects_mismatched_inputs() -> None:
    model = tiny_drafter()
    hidden, ids = inputs(5)
    with pytest.raises(ValueError, match="input_ids shape"):
        model(hidden, ids[:, :4], torch.arange(5)[None], causal(5))
    with pytest.raises(ValueError, match="hidden size 16"):
        model(hidden[..., :16], ids, torch.arange(5)[None], causal(5))


def test_config_rejects_indivisible_heads() -> None:
    with pytest.raises(ValueError, match="divisible"):
        EagleConfig(vocab_size=V, hidden_size=30, intermediate_size=8, num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="divisible"):
        EagleConfig(vocab_size=V, hidden_size=32, intermediate_size=8, num_attention_heads=4, num_key_value_heads=3)


def test_embeddings_and_lm_head_are_frozen() -> None:
    model = tiny_drafter()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable
    assert "lm_head.weight" not in trainable
    assert "fc.weight" in trainable
    assert set(model.trainable_state_dict()) == {k for k in model.state_dict() if k.startswith(("fc.", "layers.0."))}


def test_packed_documents_do_not_see_each_other() -> None:
    model = tiny_drafter()
    n0, n1 = 4, 5
    hidden, ids = inputs(n0 + n1)
    docs = torch.tensor([[0] * n0 + [1] * n1])
    positions = torch.cat([torch.arange(n0), torch.arange(n1)])[None]
    mask = block_causal_mask(docs)

    out = model(hidden, ids, positions, mask)
    hidden2, ids2 = hidden.clone(), ids.clone()
    hidden2[:, :n0] += 3.0 * torch.randn(1, n0, H, generator=torch.Generator().manual_seed(7))
    ids2[:, :n0] = (ids2[:, :n0] + 5) % V
    out2 = model(hidden2, ids2, positions, mask)

    torch.testing.assert_close(out2[:, n0:], out[:, n0:])
    assert not torch.allclose(out2[:, :n0], out[:, :n0])  # the perturbation did reach document 0
    # Document 1 packed behind document 0 gives what it gives alone.
    alone = model(hidden[:, n0:], ids[:, n0:], torch.arange(n1)[None], causal(n1))
    torch.testing.assert_close(out[:, n0:], alone)


def test_a_later_token_does_not_change_earlier_outputs() -> None:
    model = tiny_drafter()
    n, t = 8, 5
    hidden, ids = inputs(n)
    positions = torch.arange(n)[None]

    out = model(hidden, ids, positions, causal(n))
    ids2, hidden2 = ids.clone(), hidden.clone()
    ids2[0, t] = (ids2[0, t] + 1) % V
    hidden2[0, t:] += 1.0
    out2 = model(hidden2, ids2, positions, causal(n))

    torch.testing.assert_close(out2[:, :t], out[:, :t])
    assert not torch.allclose(out2[:, t], out[:, t])


def test_positions_matter() -> None:
    model = tiny_drafter()
    hidden, ids = inputs(6)
    out = model(hidden, ids, torch.arange(6)[None], causal(6))
    shifted = model(hidden, ids, torch.arange(6)[None] + 3, causal(6))
    # Rotary attention depends on relative positions only: a uniform shift changes nothing ...
    torch.testing.assert_close(shifted, out, atol=1e-4, rtol=1e-4)
    # ... but changing relative positions does.
    spread = model(hidden, ids, (2 * torch.arange(6))[None], causal(6))
    assert not torch.allclose(spread[:, 1:], out[:, 1:], atol=1e-4)


def test_attach_copies_the_heads_and_checks_shapes() -> None:
    target = tiny_target(V, H, 1, HEADS)
    model = tiny_drafter()

    model.attach(target)

    assert torch.equal(model.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(model.lm_head.weight, target.get_output_embeddings().weight)
    wrong = tiny_target(V + 1, H, 1, HEADS)
    with pytest.raises(ValueError, match="do not fit the drafter"):
        model.attach(wrong)


# -- checkpoint -------------------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[EagleDrafter, Path]:
    model = tiny_drafter(seed=3)
    return model, save_drafter(model, tmp_path / "ckpt")


def test_checkpoint_round_trip(checkpoint: tuple[EagleDrafter, Path]) -> None:
    model, directory = checkpoint
    target = tiny_target(V, H, 1, HEADS)
    model.attach(target)

    loaded = load_drafter(directory).eval()
    loaded.attach(target)

    assert loaded.config == model.config
    hidden, ids = inputs(9)
    torch.testing.assert_close(
        loaded(hidden, ids, torch.arange(9)[None], causal(9)), model(hidden, ids, torch.arange(9)[None], causal(9)),
        rtol=0, atol=0,
    )
    for key, value in model.trainable_state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_checkpoint_layout_is_what_vllm_loads(checkpoint: tuple[EagleDrafter, Path]) -> None:
    model, directory = checkpoint

    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")

    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    assert config["architectures"] == ["EagleLlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert (config["vocab_size"], config["hidden_size"], config["num_attention_heads"]) == (V, H, HEADS)
    assert config["head_dim"] == H // HEADS
    assert "fc.weight" in tensors
    assert all(k == "fc.weight" or k.startswith("layers.0.") for k in tensors)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)
    assert set(tensors) == set(model.trainable_state_dict())
    assert tensors["fc.weight"].shape == (H, 2 * H)
    assert "layers.0.self_attn.q_proj.weight" in tensors
    assert "layers.0.post_attention_layernorm.weight" in tensors
    assert not any("input_layernorm" in k for k in tensors)


def _rewrite_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(lambda t: t.update({"fc.weight": torch.zeros(H, 2 * H + 1)}), "fc.weight has shape",
                     id="wrong-shape"),
        pytest.param(lambda t: t.pop("layers.0.mlp.up_proj.weight"), "missing keys.*layers.0.mlp.up_proj.weight",
                     id="missing-key"),
        pytest.param(lambda t: t.update({"layers.1.fc.weight": torch.zeros(2)}), "unexpected keys.*layers.1.fc",
                     id="unexpected-key"),
    ],
)
@pytest.mark.reliability("bad_input", "drafter checkpoint whose safetensors keys or shapes do not match its config")
def test_load_rejects_weights_that_do_not_match(checkpoint: tuple[EagleDrafter, Path], edit, message: str) -> None:
    _, directory = checkpoint
    _rewrite_weights(directory, edit)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(directory)


def test_load_accepts_bundled_target_heads(checkpoint: tuple[EagleDrafter, Path]) -> None:
    model, directory = checkpoint
    _rewrite_weights(directory, lambda t: t.update({"embed_tokens.weight": torch.zeros(V, H)}))
    loaded = load_drafter(directory)
    assert torch.equal(loaded.state_dict()["fc.weight"], model.state_dict()["fc.weight"])


@pytest.mark.reliability("bad_input", "drafter checkpoint that is a pickle")
def test_load_rejects_a_pickle_named_safetensors(checkpoint: tuple[EagleDrafter, Path]) -> None:
    model, directory = checkpoint
    torch.save(model.trainable_state_dict(), directory / "model.safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_drafter(directory)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(lambda c: c.update({"architectures": ["LlamaForCausalLM"]}), "architectures", id="architecture"),
        pytest.param(lambda c: c.pop("intermediate_size"), "missing key 'intermediate_size'", id="missing-key"),
    ],
)
def test_load_rejects_a_bad_config(checkpoint: tuple[EagleDrafter, Path], edit, message: str) -> None:
    _, directory = checkpoint
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_drafter(directory)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_load_requires_both_files(checkpoint: tuple[EagleDrafter, Path], name: str) -> None:
    _, directory = checkpoint
    (directory / name).unlink()
    with pytest.raises(CheckpointError, match=f"a drafter checkpoint needs {name}"):
        load_drafter(directory)


# -- eagle_loss -------------------------------------------------------------------------------------------------


def _features(seed: int = 0, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)


def test_vloss_is_zero_when_prediction_equals_target() -> None:
    target, lm_head = _features()
    parts = eagle_loss(target.clone(), target, lm_head, torch.ones(2, 6), 0.5, 0.5)
    assert parts.vloss.item() == 0.0
    assert parts.accuracy.item() == 1.0


def test_ploss_equals_target_entropy_when_prediction_equals_target() -> None:
    target, lm_head = _features()
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 0, 1]])

    parts = eagle_loss(target.clone(), target, lm_head, mask, 0.0, 1.0)

    entropies = []  # H(p) = -sum p log p with p = softmax(target @ W^T), computed with plain Python math
    for b in range(2):
        for t in range(6):
            if mask[b, t]:
                logits = [sum(target[b, t, h].item() * lm_head[v, h].item() for h in range(H)) for v in range(V)]
                top = max(logits)
                z = sum(math.exp(x - top) for x in logits)
                p = [math.exp(x - top) / z for x in logits]
                entropies.append(-sum(pi * math.log(pi) for pi in p if pi > 0))
    expected = sum(entropies) / len(entropies)
    assert parts.ploss.item() == pytest.approx(expected, rel=1e-9)
    assert parts.loss.item() == pytest.approx(expected, rel=1e-9)


def test_masked_positions_do_not_count() -> None:
    target, lm_head = _features(seed=1)
    predicted = target + 0.3 * torch.randn(target.shape, generator=torch.Generator().manual_seed(2), dtype=target.dtype)
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 1, 1, 0, 1, 0]])
    base = eagle_loss(predicted, target, lm_head, mask, 0.4, 0.6)

    changed = predicted.clone()
    changed[mask == 0] = 100.0 * torch.randn(int((mask == 0).sum()), H, dtype=target.dtype)
    after = eagle_loss(changed, target, lm_head, mask, 0.4, 0.6)

    for name in ("loss", "vloss", "ploss", "accuracy"):
        torch.testing.assert_close(getattr(after, name), getattr(base, name), msg=name)
    # ... and a valid position does count.
    changed[0, 0] += 1.0
    assert eagle_loss(changed, target, lm_head, mask, 0.4, 0.6).loss.item() != pytest.approx(base.loss.item())


def test_all_masked_gives_zero_not_nan() -> None:
    target, lm_head = _features()
    parts = eagle_loss(target + 1, target, lm_head, torch.zeros(2, 6), 0.5, 0.5)
    assert parts.loss.item() == 0.0


def _soft_ce(pred_logits: list[float], target_logits: list[float]) -> float:
    """-sum_i softmax(target)_i * log softmax(pred)_i, by hand."""
    log_z = math.log(sum(math.exp(x) for x in pred_logits))
    zt = sum(math.exp(x) for x in target_logits)
    return -sum(math.exp(t) / zt * (p - log_z) for p, t in zip(pred_logits, target_logits, strict=True))


def test_pinned_small_example() -> None:
    # H = 2, V = 3, lm_head rows e1, e2, e1 + e2; three positions, the last one masked out.
    lm_head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    predicted = torch.tensor([[[0.5, 0.25], [1.0, 2.0], [100.0, -100.0]]], dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[[0.5, -0.25], [1.0, 1.0], [0.0, 0.0]]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])

    parts = eagle_loss(predicted, target, lm_head, mask, vloss_weight=0.3, ploss_weight=0.7)

    # SmoothL1 (beta 1), mean over H:  pos0 d = (0, .5) -> (0 + .5 * .25) / 2 = .0625
    #                                  pos1 d = (0, 1)  -> (0 + (1 - .5)) / 2  = .25
    vloss = (0.0625 + 0.25) / 2
    # logits = W f:  pos0 predicted (.5, .25, .75), target (.5, -.25, .25)
    #                pos1 predicted (1, 2, 3),      target (1, 1, 2)
    ploss = (_soft_ce([0.5, 0.25, 0.75], [0.5, -0.25, 0.25]) + _soft_ce([1, 2, 3], [1, 1, 2])) / 2
    # argmax: pos0 predicted 2 vs target 0 (miss), pos1 2 vs 2 (hit)
    accuracy = 0.5
    expected = torch.tensor(0.3 * vloss + 0.7 * ploss, dtype=torch.float64)
    torch.testing.assert_close(parts.vloss, torch.tensor(vloss, dtype=torch.float64))
    torch.testing.assert_close(parts.ploss, torch.tensor(ploss, dtype=torch.float64))
    torch.testing.assert_close(parts.accuracy, torch.tensor(accuracy, dtype=torch.float64))
    torch.testing.assert_close(parts.loss, expected)
    # Guard the formula with the arithmetic done on paper: pos0 1.6194 - 0.5341 = 1.0853,
    # pos1 3.4076 - 2.3642 = 1.0434 (log-sum-exp of predicted logits minus E_p[predicted logit]).
    assert ploss == pytest.approx((1.0853 + 1.0434) / 2, abs=2e-4)

    parts.loss.backward()
    assert predicted.grad is not None
    assert torch.equal(predicted.grad[0, 2], torch.zeros(2, dtype=torch.float64))  # masked position gets no gradient
