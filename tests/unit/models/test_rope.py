"""The draft layer's rotary phases against the target's own (transformers' rotary embedding), for
plain RoPE and each scaling the drafter follows; scalings that change with the sequence length refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pipeline.config import DrafterConfig
from pipeline.models.checkpoint import load_drafter, save_drafter
from pipeline.models.drafter import fresh_drafter
from pipeline.models.rope import RotaryEmbedding, UnsupportedRopeError, rope_of
from pipeline.models.target import build_target
from pipeline.models.target_checks import TargetConfigError, check_config
from pipeline.models.target_forward import TargetMetadata

HEAD_DIM, MAX_POSITIONS = 128, 131072
SCALINGS = {
    "plain": {"rope_type": "default"},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},  # Llama 3.1's
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen's long context
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def _config(name: str, **extra) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                       max_position_embeddings=MAX_POSITIONS,
                       rope_parameters={**SCALINGS[name], "rope_theta": 500000.0}, **extra)


@pytest.mark.parametrize("name", SCALINGS)
def test_draft_layer_phases_equal_the_targets(name: str) -> None:
    config = _config(name)
    theirs = LlamaRotaryEmbedding(config)
    theta, scaling = rope_of(config)
    ours = RotaryEmbedding(HEAD_DIM, theta, scaling, MAX_POSITIONS)
    positions = torch.arange(0, 100_000, 97)[None]  # (1, N) past the original context too
    cos, sin = theirs(torch.zeros(1), positions)  # (1, N, D)
    our_cos, our_sin = ours(positions)  # (1, 1, N, D)
    torch.testing.assert_close(our_cos[:, 0], cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(our_sin[:, 0], sin, rtol=0, atol=1e-6)
    plain = RotaryEmbedding(HEAD_DIM, theta)
    assert (name == "plain") == torch.equal(ours.inv_freq, plain.inv_freq)  # a scaling changes the phases


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_llama31_drafter_trains_exports_and_reloads_with_the_targets_scaling(tmp_path, kind: str) -> None:
    target = build_target(_config("llama3", vocab_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_key_value_heads=2), seed=0)
    drafter = fresh_drafter(DrafterConfig(kind=kind, draft_vocab_size=32), target, torch.arange(64), seed=0)
    expected = TargetMetadata.of(target.config).rope_scaling
    assert expected["rope_type"] == "llama3"
    assert drafter.config.rope_scaling == expected
    exported = json.loads((save_drafter(drafter, tmp_path, TargetMetadata.of(target.config)) / "config.json")
                          .read_text())
    assert exported["rope_scaling"] == expected
    reloaded = load_drafter(tmp_path, target.config.num_hidden_layers)
    assert reloaded.config.rope_scaling == expected
    [rotary] = [m for m in reloaded.modules() if isinstance(m, RotaryEmbedding)]
    assert torch.equal(rotary.inv_freq, RotaryEmbedding(HEAD_DIM, 500000.0, expected, MAX_POSITIONS).inv_freq)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
@pytest.mark.reliability("bad_input", "policy whose RoPE scaling changes with the sequence length: refused by name")
def test_length_dependent_scalings_are_refused_by_name(rope_type: str) -> None:
    raw = _config("plain", vocab_size=64, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2).to_dict()
    params = {"rope_type": rope_type, "rope_theta": 500000.0, "factor": 2.0}
    if rope_type == "longrope":
        params |= {"short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [2.0] * (HEAD_DIM // 2),
                   "original_max_position_embeddings": 4096}
    raw["rope_parameters"] = params
    with pytest.raises(TargetConfigError, match=f"rope_scaling of type '{rope_type}'"):
        check_config(json.dumps(raw).encode(), "s3://bucket/policies/step-000001")
    with pytest.raises(UnsupportedRopeError):
        RotaryEmbedding(HEAD_DIM, 500000.0, params)
