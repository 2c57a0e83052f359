"""The P-EAGLE export in speculators' format loads in speculators' own `peagle` model with our logits.

speculators is a test dependency installed without its dependencies (it pins a CUDA torch and an
older transformers; see requirements-speculators.txt); without it these tests skip.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.models import target_forward
from pipeline.models.checkpoint import load_drafter, save_speculators
from pipeline.models.eagle3 import default_aux_layer_ids, draft_vocab
from pipeline.models.peagle import CodSample, PEagleConfig, PEagleDrafter, context_mask
from tests.support.targets import tiny_target

peagle = pytest.importorskip("speculators.models.peagle", reason="speculators (test dependency) is not installed")
losses = pytest.importorskip("speculators.losses", reason="speculators (test dependency) is not installed")

V, DV, H, HEADS, LAYERS, N = 32, 24, 32, 2, 4, 12
AUX = default_aux_layer_ids(LAYERS)


@pytest.fixture(scope="module")
def target():
    return tiny_target(V, H, LAYERS, HEADS)


@pytest.fixture(scope="module")
def verifier(target, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The target as a local directory: speculators loads its verifier's config and head by name or path."""
    directory = tmp_path_factory.mktemp("verifier")
    target.save_pretrained(directory)
    return str(directory)


def ours(target, **overrides) -> PEagleDrafter:
    torch.manual_seed(0)
    config = PEagleConfig(**{
        "vocab_size": V, "draft_vocab_size": DV, "hidden_size": H, "target_hidden_size": H,
        "intermediate_size": 2 * H, "num_attention_heads": HEADS, "num_key_value_heads": HEADS // 2,
        "aux_layer_ids": AUX, "num_hidden_layers": 2, "mask_token_id": V - 1, "num_depths": 4,
        "rms_norm_eps": 1e-6, **overrides,
    })
    model = PEagleDrafter(config)
    model.set_vocab(*draft_vocab(torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(1)), DV))
    model.attach(target)
    with torch.no_grad():  # nothing left at its initial value, so a tensor read from the wrong key shows
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def theirs(directory: Path):
    config = peagle.PEagleSpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"  # speculators' default needs flex on a GPU
    return peagle.PEagleDraftModel.from_pretrained(directory, config=config).eval()


@pytest.mark.parametrize("overrides", [{}, {"fc_norm": True}, {"norm_before_residual": True}],
                         ids=["plain", "fc-norm", "norm-before-residual"])
def test_speculators_loads_the_export_with_equal_logits(tmp_path: Path, target, verifier: str, overrides: dict) -> None:
    """Their training forward (a COD sample of every depth, their cross-depth mask) and ours, on the same
    sample: the logits speculators' lm_head computes equal ours."""
    model = ours(target, **overrides)
    directory = save_speculators(model, tmp_path / "spec", target_forward.TargetMetadata.of(target.config), verifier)
    spec = theirs(directory)
    assert torch.equal(spec.mask_hidden, model.mask_hidden)

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (1, N), generator=g)
    aux = torch.randn(1, N, len(AUX) * H, generator=g)
    loss_mask = torch.ones(1, N)
    loss_mask[0, :2] = 0
    verifier_states = torch.randn(1, N, H, generator=g)  # their loss reads it; the logits do not
    captured = []
    handle = spec.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    torch.manual_seed(3)  # their COD sample: drawn first thing in their forward
    anchor, depth = peagle.data.generate_cod_sample_indices(N, loss_mask, num_depths=4, down_sample_ratio=0.7,
                                                              down_sample_ratio_min=0.2)
    torch.manual_seed(3)
    with torch.no_grad():
        spec(aux, ids, torch.zeros(1, N, dtype=torch.int64), loss_mask=loss_mask,
             verifier_last_hidden_states=verifier_states, num_depths=4,
             loss_config=losses.resolve_loss_config("kl_div", "eager"))  # their fused loss needs Triton
    handle.remove()
    assert depth.max() >= 2  # masked depths are compared, not only the real pairs

    sample = CodSample(anchor, depth)
    with torch.no_grad():
        hidden = model.forward_parallel(aux, ids, torch.arange(N)[None], sample,
                                        context_mask(sample, torch.zeros(N, dtype=torch.int64)))
        logits = model.lm_head(model.norm(hidden))
    torch.testing.assert_close(captured[0], logits, rtol=1e-5, atol=1e-5)


def test_speculators_export_round_trips(tmp_path: Path, target) -> None:
    model = ours(target)
    directory = save_speculators(model, tmp_path / "spec", target_forward.TargetMetadata.of(target.config))
    config = json.loads((directory / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["transformer_layer_config"]["head_dim"] == H // HEADS  # their rotary reads it (2H wide inputs)

    loaded = load_drafter(directory)

    assert isinstance(loaded, PEagleDrafter)
    assert loaded.config == model.config
    for key, value in model.trainable_state_dict().items():
        assert torch.equal(loaded.trainable_state_dict()[key], value), key
