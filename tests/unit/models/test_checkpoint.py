"""EAGLE-3 drafter checkpoints: the published layout vLLM and SGLang load, its key variants, what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from pipeline.models.checkpoint import CheckpointError, check_drafter, load_drafter, save_drafter
from pipeline.models.eagle3 import (
    Eagle3Drafter,
    default_aux_layer_ids,
    draft_vocab,
)
from tests.support.eagle3 import (
    AUX,
    DV,
    HEADS,
    VARIANTS,
    H,
    V,
    causal,
    make_drafter,
    random_counts,
    random_inputs,
    unroll,
)

# -- checkpoints ------------------------------------------------------------------------------------------------

PUBLISHED_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
}


def vocab_drafter(seed: int = 3, **overrides) -> Eagle3Drafter:
    model = make_drafter(seed=seed, **overrides)
    model.set_vocab(*draft_vocab(random_counts(seed), model.config.draft_vocab_size))
    return model


def assert_same_drafter(loaded: Eagle3Drafter, model: Eagle3Drafter) -> None:
    assert loaded.config == model.config
    saved = model.trainable_state_dict()
    got = loaded.trainable_state_dict()
    assert set(got) == set(saved)
    for key, value in saved.items():
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key


def step_outputs(model: Eagle3Drafter) -> list[torch.Tensor]:
    ids, aux = random_inputs(model, 6, seed=12)
    with torch.no_grad():
        states = unroll(model.eval(), [ids, ids.roll(1, 1)], model.project_aux(aux), torch.arange(6)[None], causal(6))
        return [*states, model.lm_head(model.logits_input(states[-1]))]


@pytest.mark.parametrize("variant", ["plain", "fc-norm", "norm-before-residual", "norm-output"],
                         ids=["plain", "fc-norm", "norm-before-residual", "norm-output"])
def test_export_import_is_bit_exact(tmp_path: Path, variant: str) -> None:
    model = vocab_drafter(**VARIANTS[variant])

    loaded = load_drafter(save_drafter(model, tmp_path / "ckpt"))

    assert isinstance(loaded, Eagle3Drafter)
    assert not loaded.own_embeddings
    assert_same_drafter(loaded, model)
    loaded.embed_tokens.weight.data.copy_(model.embed_tokens.weight)  # the target's, attached by the caller
    for a, b in zip(step_outputs(loaded), step_outputs(model), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["plain", "fc-norm", "norm-before-residual"],
                         ids=["plain", "fc-norm", "norm-before-residual"])
def test_exported_keys_and_config_are_the_published_ones(tmp_path: Path, variant: str) -> None:
    model = vocab_drafter(**VARIANTS[variant])
    directory = save_drafter(model, tmp_path / "ckpt")

    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())

    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    fc_norm = {f"fc_norm.{i}.weight" for i in range(len(AUX))} if model.config.fc_norm else set()
    assert set(tensors) == PUBLISHED_KEYS | fc_norm
    assert tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["d2t"], model.d2t)
    assert torch.equal(tensors["t2d"], model.t2d)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (HEADS * (H // HEADS), 2 * H)
    assert tensors["fc.weight"].shape == (H, len(AUX) * H)
    assert tensors["lm_head.weight"].shape == (DV, H)

    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == DV
    assert config["vocab_size"] == V
    assert config["target_hidden_size"] == H
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert "norm_before_residual" in config
    assert config["norm_before_residual"] is model.config.norm_before_residual
    assert config["max_position_embeddings"] == model.config.max_position_embeddings
    assert config["num_hidden_layers"] == 1
    assert config["head_dim"] == H // HEADS


@pytest.mark.parametrize("variant", ["plain", "fc-norm", "norm-output", "norm-before-residual"],
                         ids=["plain", "fc-norm", "norm-output", "norm-before-residual"])
def test_eagle31_flags_are_written_only_when_set(tmp_path: Path, variant: str) -> None:
    """SpecForge 0.2 reads `norm_output: false` as "no final norm" where vLLM always applies it: an unset
    EAGLE-3.1 flag is left out, so every engine reads its absence alike. norm_before_residual is always
    written (the engines' defaults differ)."""
    model = vocab_drafter(**VARIANTS[variant])
    directory = save_drafter(model, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())

    for flag in ("fc_norm", "norm_output"):
        if getattr(model.config, flag):
            assert config[flag] is True
        else:
            assert flag not in config
    assert config["norm_before_residual"] is model.config.norm_before_residual
    loaded = load_drafter(directory)
    assert loaded.config == model.config


def _rewrite(directory: Path, rename=None, drop=(), extra=None) -> None:
    tensors = load_file(directory / "model.safetensors")
    tensors = {(rename(k) if rename else k): v for k, v in tensors.items() if k not in drop}
    tensors.update(extra or {})
    (directory / "model.safetensors").unlink()
    save_file(tensors, directory / "model.safetensors")


def _edit_config(directory: Path, edit) -> None:
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


def _layers0(k: str) -> str:
    return k.replace("midlayer.", "layers.0.")


RENAMES = {
    "layers.0": _layers0,
    "model-prefix": lambda k: k if k in ("d2t", "t2d") else "model." + _layers0(k),
    "model-prefix-everywhere": lambda k: "model." + _layers0(k),
    "model-midlayer": lambda k: "model." + k,
}


@pytest.mark.parametrize("fc_norm", [False, True], ids=["eagle3", "fc-norm"])
@pytest.mark.parametrize("rename", list(RENAMES), ids=list(RENAMES))
def test_import_accepts_published_key_variants(tmp_path: Path, rename: str, fc_norm: bool) -> None:
    model = vocab_drafter(fc_norm=fc_norm)
    directory = save_drafter(model, tmp_path / "ckpt")
    _rewrite(directory, rename=RENAMES[rename])
    assert not any(k.startswith("midlayer.") for k in load_file(directory / "model.safetensors"))

    assert_same_drafter(load_drafter(directory), model)


def test_import_without_vocab_maps_when_the_vocab_is_full(tmp_path: Path) -> None:
    model = make_drafter(draft_vocab_size=V)
    directory = save_drafter(model, tmp_path / "ckpt")
    _rewrite(directory, drop=("d2t", "t2d"))
    _edit_config(directory, lambda c: c.pop("draft_vocab_size"))

    loaded = load_drafter(directory)

    assert loaded.config.draft_vocab_size == V
    assert torch.equal(loaded.draft_to_target, torch.arange(V))
    assert loaded.t2d.all()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_a_full_vocab_is_exported_in_target_order_without_maps(tmp_path: Path) -> None:
    """vLLM allocates d2t only for a draft vocabulary smaller than the target's, refuses a checkpoint that brings it
    otherwise, and reads head row i as target token i: a full vocabulary, even under a permuted map (one a
    checkpoint from elsewhere may bring), is written in target-id order, without maps, and drafts the same target
    tokens once loaded."""
    model = make_drafter(seed=3, draft_vocab_size=V)
    permutation = torch.randperm(V, generator=torch.Generator().manual_seed(1))
    model.set_vocab(permutation - torch.arange(V), torch.ones(V, dtype=torch.bool))
    directory = save_drafter(model, tmp_path / "ckpt")
    assert not {"d2t", "t2d"} & set(load_file(directory / "model.safetensors"))

    loaded = load_drafter(directory)

    assert torch.equal(loaded.draft_to_target, torch.arange(V))
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drafted = model.draft_to_target[model.lm_head(hidden).argmax(-1)]
        assert torch.equal(loaded.draft_to_target[loaded.lm_head(hidden).argmax(-1)], drafted)


@pytest.mark.parametrize("read", [load_drafter, check_drafter], ids=["load", "headers-only"])
@pytest.mark.parametrize("missing", ["d2t", "t2d"])
def test_import_refuses_a_reduced_vocab_without_its_maps(read, tmp_path: Path, missing: str) -> None:
    directory = save_drafter(vocab_drafter(), tmp_path / "ckpt")
    _rewrite(directory, drop=(missing,))
    with pytest.raises(CheckpointError, match=f"missing keys.*{missing}"):
        read(directory)


def test_import_keeps_bundled_embeddings(tmp_path: Path, target: LlamaForCausalLM) -> None:
    model = vocab_drafter()
    own = torch.randn(V, H, generator=torch.Generator().manual_seed(21))
    directory = save_drafter(model, tmp_path / "ckpt")
    _rewrite(directory, extra={"embed_tokens.weight": own})

    loaded = load_drafter(directory)

    assert loaded.own_embeddings
    assert torch.equal(loaded.embed_tokens.weight, own)
    loaded.attach(target)
    assert torch.equal(loaded.embed_tokens.weight, own)  # not the target's
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    # and they travel on: a re-export writes them back
    again = load_file(save_drafter(loaded, tmp_path / "again") / "model.safetensors")
    assert torch.equal(again["embed_tokens.weight"], own)


def test_attach_replaces_the_embeddings_of_a_drafter_without_its_own(target: LlamaForCausalLM) -> None:
    model = vocab_drafter()
    head = model.lm_head.weight.detach().clone()
    model.attach(target)
    assert torch.equal(model.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(model.lm_head.weight, head)


@pytest.mark.parametrize("where", ["eagle_config", "top-level"], ids=["eagle_config", "top-level"])
def test_import_defaults_the_aux_layers_from_the_target(tmp_path: Path, where: str) -> None:
    model = vocab_drafter(aux_layer_ids=default_aux_layer_ids(4))
    directory = save_drafter(model, tmp_path / "ckpt")

    def drop(config: dict) -> None:
        config.pop("eagle_config")
        if where == "top-level":  # a top-level id list still counts, without any target
            config["eagle_aux_hidden_state_layer_ids"] = list(model.config.aux_layer_ids)

    _edit_config(directory, drop)

    if where == "top-level":
        assert_same_drafter(load_drafter(directory), model)
        return
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        load_drafter(directory)
    loaded = load_drafter(directory, target_num_layers=4)
    assert loaded.config.aux_layer_ids == default_aux_layer_ids(4)
    assert_same_drafter(loaded, model)


@pytest.mark.parametrize("read", [load_drafter, check_drafter], ids=["load", "headers-only"])
@pytest.mark.reliability("bad_input", "drafter checkpoint that is a pickle")
def test_import_refuses_a_pickle_named_safetensors(read, tmp_path: Path) -> None:
    model = vocab_drafter()
    directory = save_drafter(model, tmp_path / "ckpt")
    (directory / "model.safetensors").unlink()
    torch.save(model.trainable_state_dict(), directory / "model.safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read(directory)


@pytest.mark.parametrize("read", [load_drafter, check_drafter], ids=["load", "headers-only"])
@pytest.mark.reliability("bad_input", "drafter checkpoint that is a pickle (pytorch_model.bin)")
def test_import_refuses_pytorch_model_bin(read, tmp_path: Path) -> None:
    model = vocab_drafter()
    directory = save_drafter(model, tmp_path / "ckpt")
    (directory / "model.safetensors").unlink()
    torch.save(model.trainable_state_dict(), directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin"):
        read(directory)
    # with no config.json either, it is still refused
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError):
        read(directory)


@pytest.mark.parametrize("read", [load_drafter, check_drafter], ids=["load", "headers-only"])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(lambda c: c.update({"draft_vocab_size": V + 1}), "draft_vocab_size", id="vocab-too-large"),
        pytest.param(lambda c: c.pop("hidden_size"), "missing key 'hidden_size'", id="missing-key"),
        pytest.param(lambda c: c.update({"target_hidden_size": 2 * H}), "fc.weight has shape", id="wrong-shape"),
    ],
)
@pytest.mark.reliability("bad_input", "drafter checkpoint whose safetensors keys or shapes do not match its config")
def test_import_refuses_a_config_that_does_not_fit(read, tmp_path: Path, edit, message: str) -> None:
    directory = save_drafter(vocab_drafter(), tmp_path / "ckpt")
    _edit_config(directory, edit)
    with pytest.raises(CheckpointError, match=message):
        read(directory)


@pytest.mark.parametrize("fc_norm", [False, True], ids=["eagle3", "fc-norm"])
@pytest.mark.parametrize("rename", ["none", *RENAMES], ids=["ours", *RENAMES])
def test_headers_alone_accept_what_loads(tmp_path: Path, rename: str, fc_norm: bool) -> None:
    """The deploy step's check reads config.json and the safetensors header only: every layout that loads passes."""
    directory = save_drafter(vocab_drafter(fc_norm=fc_norm), tmp_path / "ckpt")
    if rename != "none":
        _rewrite(directory, rename=RENAMES[rename])
    check_drafter(directory)
    load_drafter(directory)
