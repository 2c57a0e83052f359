"""Policy loading and the target forward, for every supported family, against plain transformers.

Each family is a tiny random model of tests/support/families.py, saved in shards with an index.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from pipeline.config import DrafterConfig
from pipeline.data.store import ObjectStore, storage_options_for
from pipeline.models import target as target_lib
from pipeline.models import target_checks, target_forward
from pipeline.models.checkpoint import load_drafter, save_drafter
from pipeline.models.checkpoint_cache import CacheLimitError
from pipeline.models.drafter import fresh_drafter
from pipeline.models.memory import available_memory
from pipeline.models.target import LoadSettings
from pipeline.models.target_checks import (
    MissingTensorError,
    RemoteCodeError,
    TargetConfigError,
    TensorDtypeError,
    TensorShapeError,
    TiedWeightsError,
    UnexpectedTensorError,
    UnsupportedFamilyError,
)
from pipeline.models.target_forward import TargetMetadata
from pipeline.models.weights import (
    INDEX_FILE,
    SINGLE_FILE,
    MissingWeightsError,
    PickledWeightsError,
    TensorEntry,
    WeightsLayout,
    WeightsLayoutError,
)
from tests.support.families import FAMILIES, LAYERS, LLAMA3_ROPE, SHARD, H, V, random_model
from tests.support.targets import tiny_target

SEQ = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    for family in FAMILIES:
        model = random_model(family)
        directory = tmp_path_factory.mktemp(family)
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=SHARD)
        out[family] = (model, directory)
    return out


@pytest.fixture
def checkpoint(saved: dict, tmp_path: Path) -> Path:
    """A writable copy of the llama checkpoint, for tests that damage it."""
    shutil.copytree(saved["llama"][1], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(1))


# -- loading

@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_loads_bit_exact_in_float32(saved: dict, family: str) -> None:
    model, directory = saved[family]
    assert len(list(directory.glob("*.safetensors"))) > 2
    assert (directory / INDEX_FILE).exists()
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in dict(model.named_parameters())
    loaded = target_lib.load_checkpoint(directory.as_uri(), settings=LoadSettings(dtype="float32"))
    assert type(loaded) is type(model)
    assert loaded.dtype == torch.float32
    ours, theirs = loaded.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == (family == "qwen3")


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_load_and_layers_equal_transformers_exactly(saved: dict, family: str) -> None:
    """Weights, and every layer id of the forward, bit-equal to transformers' own bf16 load."""
    _, directory = saved[family]
    ours = target_lib.load_checkpoint(str(directory), settings=LoadSettings(dtype="bfloat16"))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, local_files_only=True).eval()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    ids = _ids()
    out = target_forward.forward(ours, ids, list(range(LAYERS + 1)))
    with torch.no_grad():
        ref = reference(ids, output_hidden_states=True)
    for k in range(LAYERS):
        assert torch.equal(out.layers[:, :, k], ref.hidden_states[k]), f"layer id {k}"
    assert torch.equal(out.features, ref.hidden_states[LAYERS])
    assert torch.equal(out.logits, ref.logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_ids_follow_vllm_and_id_l_is_before_the_final_norm(saved: dict, family: str) -> None:
    """Id k < L is transformers' hidden_states[k]; transformers' LAST entry is after the final norm
    for these families, so id L is checked against a reference whose norm is the identity."""
    model, _ = saved[family]
    ids = _ids()
    out = target_forward.forward(model, ids, list(range(LAYERS + 1)))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        assert torch.equal(ref.hidden_states[LAYERS], model.model.norm(out.layers[:, :, LAYERS]))
        assert not torch.allclose(ref.hidden_states[LAYERS], out.layers[:, :, LAYERS])
        norm, model.model.norm = model.model.norm, torch.nn.Identity()
        try:
            pre_norm = model(ids, output_hidden_states=True).hidden_states[LAYERS]
        finally:
            model.model.norm = norm
    for k in range(LAYERS):
        assert torch.equal(out.layers[:, :, k], ref.hidden_states[k])
    assert torch.equal(out.layers[:, :, LAYERS], pre_norm)
    assert torch.equal(out.logits, ref.logits)


def test_logits_at_one_column_per_row_equal_the_full_logits_there(saved: dict) -> None:
    model, _ = saved["llama"]
    ids = _ids()  # (B, T)
    at = torch.arange(ids.shape[0]) % ids.shape[1]  # a different column per row
    full = target_forward.forward(model, ids, [1]).logits  # (B, T, V)
    picked = target_forward.forward(model, ids, [1], logits_at=at).logits  # (B, 1, V)
    assert picked.shape == (ids.shape[0], 1, full.shape[-1])
    torch.testing.assert_close(picked[:, 0], full[torch.arange(ids.shape[0]), at])  # one row's matmul, not T


def test_single_file_checkpoint_loads(saved: dict, tmp_path: Path) -> None:
    model, _ = saved["qwen2"]
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / SINGLE_FILE).exists()
    assert not (tmp_path / INDEX_FILE).exists()
    loaded = target_lib.load_checkpoint(tmp_path.as_uri())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_store_round_trip_and_the_policy_is_loaded_once_per_checkpoint(store: ObjectStore) -> None:
    first = tiny_target(32, 16, 1, 2)
    target_lib.save_checkpoint(first, store, "policies/r/step-1")
    a = target_lib.load_policy(store, "policies/r/step-1")
    assert target_lib.load_policy(store, "policies/r/step-1") is a
    assert not any(p.requires_grad for p in a.parameters())  # shared: nobody may train it
    fresh = target_lib.load_checkpoint(store.uri("policies/r/step-1"))
    assert fresh is not a
    assert all(p.requires_grad for p in fresh.parameters())
    # The trainer rewrites the checkpoint in place: new content, new policy.
    target_lib.save_checkpoint(tiny_target(32, 16, 1, 2, seed=1), store, "policies/r/step-1")
    b = target_lib.load_policy(store, "policies/r/step-1")
    assert b is not a
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


# -- symlinks on a file:// store: the policy's lexical check is not where a path leads

SECRET = "Hunter2-symlinked"


@pytest.fixture
def linked_store(store: ObjectStore, tmp_path: Path) -> ObjectStore:
    """A file:// store, and outside it a checkpoint of the trainer's choosing and a JSON file with a secret."""
    outside = ObjectStore((tmp_path / "outside").as_uri())
    target_lib.save_checkpoint(tiny_target(32, 16, 1, 2), outside, "ckpt")
    (tmp_path / "secrets.json").write_text(json.dumps({"model_type": SECRET, "hidden_size": SECRET}))
    return store


@pytest.mark.reliability("security", "a directory symlink in a file:// store to a checkpoint outside it: not loaded")
def test_a_checkpoint_directory_symlinked_out_of_the_store_is_refused(linked_store: ObjectStore,
                                                                      tmp_path: Path) -> None:
    (tmp_path / "store" / "policies" / "r").mkdir(parents=True)
    (tmp_path / "store" / "policies" / "r" / "step-000001").symlink_to(tmp_path / "outside" / "ckpt")
    with pytest.raises(ValueError, match=r"checkpoint_uri .*policies/r/step-000001.* leads out of .*store through "
                                         "a symlink"):
        target_lib.load_policy(linked_store, "policies/r/step-000001")
    (tmp_path / "store" / "policies" / "link").symlink_to(tmp_path / "outside")  # a link higher up the path
    with pytest.raises(ValueError, match="leads out of"):
        target_lib.load_policy(linked_store, "policies/link/ckpt")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
@pytest.mark.reliability("security", "a checkpoint file symlinked to a file outside the store: not read, no value "
                                     "of it echoed")
def test_a_checkpoint_file_symlinked_out_of_the_store_is_refused(linked_store: ObjectStore, tmp_path: Path,
                                                                 name: str) -> None:
    shutil.copytree(tmp_path / "outside" / "ckpt", tmp_path / "store" / "policies" / "step-000001")
    linked = tmp_path / "store" / "policies" / "step-000001" / name
    linked.unlink()
    linked.symlink_to(tmp_path / "secrets.json" if name == "config.json" else tmp_path / "outside" / "ckpt" / name)
    with pytest.raises(TargetConfigError, match=f"step-000001/{name}: a symlink") as failure:
        target_lib.load_policy(linked_store, "policies/step-000001")
    assert SECRET not in str(failure.value)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_checkpoint_file_swapped_for_a_symlink_after_listing_is_not_followed(saved: dict, tmp_path: Path,
                                                                               name: str) -> None:
    """Listed as a regular file, replaced by a symlink before it is opened: O_NOFOLLOW refuses it."""
    (tmp_path / "secrets.json").write_text(json.dumps({"model_type": SECRET}))
    shutil.copytree(saved["llama"][1], tmp_path / "ckpt")
    listing = target_checks.list_checkpoint((tmp_path / "ckpt").as_uri())
    for path in (tmp_path / "ckpt").iterdir():
        if path.name == name or (name == "model.safetensors" and path.name.endswith(".safetensors")):
            path.unlink()
            path.symlink_to(tmp_path / "secrets.json")
    with pytest.raises(TargetConfigError, match="a symlink") as failure:
        target_lib._load(listing, "cpu", LoadSettings(cached_policies=0))
    assert SECRET not in str(failure.value)


@pytest.mark.reliability("security", "a target-cache entry that is a symlink (a planted copy): never used, "
                                     "replaced by a fetched copy")
def test_a_symlinked_cache_entry_is_never_used(saved: dict, tmp_path: Path) -> None:
    import fsspec

    from pipeline.models.checkpoint_cache import COMPLETE, CheckpointCache, RemoteFile

    source = saved["llama"][1]
    files = [RemoteFile(p.name, p.stat().st_size) for p in sorted(source.iterdir())]
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "config.json").write_text(json.dumps({"model_type": SECRET}))
    (planted / COMPLETE).write_text("{}")
    cache = CheckpointCache(tmp_path / "cache", 2**30)
    cache.root.mkdir()
    (cache.root / "identity").symlink_to(planted)
    entry = cache.fetch(fsspec.filesystem("file"), str(source), files, "identity", "s3://bucket/ckpt")
    assert not entry.is_symlink()
    assert (entry / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert (planted / "config.json").exists()  # the link is removed, never what it pointed at
    assert cache.entries() == [entry]


# Configs as published on the hub (transformers-4 JSON: rope_theta / rope_scaling at the top level).
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": ({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "transformers_version": "4.43.0.dev0"}, 8_030_261_248),
    "Qwen/Qwen2.5-7B": ({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 28, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151643},
        7_615_616_512),
    "Qwen/Qwen3-8B": ({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
        "attention_bias": False, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, 8_190_735_360),
    "mistralai/Mistral-7B-v0.3": ({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, 7_248_023_552),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_pass_and_their_headers_are_checked_without_weights(name: str) -> None:
    """The real 7-8B configs pass the bounds, imply their published parameter counts, and a header
    layout of that size is checked on the meta device (nothing allocated); one wrong shape is refused."""
    raw, published = PUBLISHED[name]
    config = target_checks.check_config(json.dumps(raw).encode(), name)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in meta.parameters()) == published
    entries, offset = {}, 0
    for key, t in meta.state_dict().items():
        entries[key] = TensorEntry(key, "model-00001-of-00004.safetensors", "BF16", tuple(t.shape), offset)
        offset += entries[key].nbytes
    layout = WeightsLayout(("model-00001-of-00004.safetensors",), entries)
    assert layout.data_bytes == 2 * published
    target_checks.check_layout(config, layout, name)
    entries["model.layers.7.self_attn.k_proj.weight"] = TensorEntry(
        "model.layers.7.self_attn.k_proj.weight", "model-00001-of-00004.safetensors", "BF16", (1024, 1024), 0)
    with pytest.raises(TensorShapeError, match=f"{name}/model-00001-of-00004.safetensors: tensor "
                                               r"model.layers.7.self_attn.k_proj.weight has shape \(1024, 1024\)"):
        target_checks.check_layout(config, WeightsLayout(layout.files, entries), name)
    meta_fields = TargetMetadata.of(config)
    assert meta_fields.rope_theta == raw["rope_theta"]
    assert meta_fields.rope_scaling == raw.get("rope_scaling")
    assert meta_fields.max_position_embeddings == raw["max_position_embeddings"]


# -- object storage through the local cache

@pytest.fixture(scope="module")
def s3_store() -> Iterator[ObjectStore]:
    env = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    from moto.server import ThreadedMotoServer  # imported here: the GPU machine runs this file without moto

    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        root = "s3://policies-test/root"
        store = ObjectStore(root, storage_options_for(root, f"http://127.0.0.1:{port}"))
        store.fs.mkdir("policies-test")
        yield store
    finally:
        server.stop()
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _upload(store: ObjectStore, directory: Path, prefix: str) -> None:
    for path in sorted(directory.iterdir()):
        store.write_bytes(f"{prefix}/{path.name}", path.read_bytes())


def test_s3_checkpoint_loads_through_a_bounded_lru_cache(s3_store: ObjectStore, saved: dict, tmp_path: Path) -> None:
    (model_a, dir_a), (model_b, dir_b) = saved["qwen3"], saved["mistral"]
    _upload(s3_store, dir_a, "a")
    _upload(s3_store, dir_b, "b")
    size = max(sum(p.stat().st_size for p in d.iterdir()) for d in (dir_a, dir_b))
    settings = LoadSettings(cache_dir=tmp_path / "cache", cache_max_bytes=int(size * 1.5))
    cache = settings.cache()

    loaded = target_lib.load_checkpoint(s3_store.uri("a"), store=s3_store, settings=settings)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model_a.state_dict().items())
    (entry_a,) = cache.entries()
    assert "generation_config.json" not in {p.name for p in entry_a.iterdir()}  # only config + weights
    stamp = (entry_a / "config.json").stat().st_mtime_ns
    target_lib.load_checkpoint(s3_store.uri("a"), store=s3_store, settings=settings)
    assert (entry_a / "config.json").stat().st_mtime_ns == stamp  # a hit: not copied again

    (settings.cache_dir / ".tmp-of-a-crashed-process").mkdir()
    loaded_b = target_lib.load_checkpoint(s3_store.uri("b"), store=s3_store, settings=settings)
    assert not (settings.cache_dir / ".tmp-of-a-crashed-process").exists()
    assert all(torch.equal(loaded_b.state_dict()[k], v) for k, v in model_b.state_dict().items())
    (entry_b,) = cache.entries()  # a evicted: both do not fit
    assert entry_b != entry_a
    assert cache.used_bytes() <= settings.cache_max_bytes

    small = LoadSettings(cache_dir=tmp_path / "small", cache_max_bytes=1000)
    with pytest.raises(CacheLimitError, match=r"s3://policies-test/root/a: checkpoint of \d+ bytes"):
        target_lib.load_checkpoint(s3_store.uri("a"), store=s3_store, settings=small)


@pytest.mark.reliability("bad_input", "policy on S3 with remote code: refused before any weight is copied")
def test_s3_checkpoint_refused_before_copying(s3_store: ObjectStore, saved: dict, tmp_path: Path) -> None:
    _, directory = saved["llama"]
    _upload(s3_store, directory, "evil")
    config = json.loads((directory / "config.json").read_text())
    s3_store.write_bytes("evil/config.json", json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}).encode())
    settings = LoadSettings(cache_dir=tmp_path / "cache")
    with pytest.raises(RemoteCodeError, match="auto_map"):
        target_lib.load_checkpoint(s3_store.uri("evil"), store=s3_store, settings=settings)
    assert settings.cache().entries() == []


def test_redact_drops_credentials_and_signatures() -> None:
    assert target_checks.redact("s3://AKIA:secret@bucket/p/step-1?X-Amz-Signature=abc") == "s3://bucket/p/step-1"
    assert target_checks.redact("file:///data/p") == "file:///data/p"


@pytest.mark.reliability("bad_input", "policy URI with credentials: not echoed in the refusal")
def test_refusal_never_echoes_credentials(tmp_path: Path) -> None:
    with pytest.raises(TargetConfigError) as info:
        target_lib.load_checkpoint("memory://user:hunter2@host/nothing-here")
    assert "hunter2" not in str(info.value)
    assert "nothing-here" in str(info.value)


# -- refusals

def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _shard_of(directory: Path, tensor: str) -> Path:
    return directory / json.loads((directory / INDEX_FILE).read_text())["weight_map"][tensor]


def _rewrite_shard(directory: Path, tensor: str, edit) -> None:
    """Apply `edit` to the tensors of the shard holding `tensor` and keep the index in step."""
    path = _shard_of(directory, tensor)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    index = json.loads((directory / INDEX_FILE).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != path.name}
    index["weight_map"].update({k: path.name for k in tensors})
    (directory / INDEX_FILE).write_text(json.dumps(index))


def _load(directory: Path):
    return target_lib.load_checkpoint(directory.as_uri())


@pytest.mark.reliability("bad_input", "policy checkpoint with only pickled weights (pytorch_model.bin)")
def test_pickled_weights_are_refused(checkpoint: Path) -> None:
    for p in checkpoint.glob("model*"):
        p.unlink()
    (checkpoint / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(PickledWeightsError, match=r"ckpt: weights only as pytorch_model.bin \(pickle"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy checkpoint without any weights")
def test_no_weights_is_refused(checkpoint: Path) -> None:
    for p in checkpoint.glob("model*"):
        p.unlink()
    with pytest.raises(MissingWeightsError, match="no model.safetensors and no model.safetensors.index.json"):
        _load(checkpoint)


@pytest.mark.parametrize("key", ["auto_map", "trust_remote_code"])
@pytest.mark.reliability("bad_input", "policy config asking transformers to run remote code")
def test_remote_code_configs_are_refused(checkpoint: Path, key: str) -> None:
    _edit_config(checkpoint, **{key: {"AutoModelForCausalLM": "modeling_evil.Evil"} if key == "auto_map" else True})
    with pytest.raises(RemoteCodeError, match=f"config.json: refused: `{key}`"):
        _load(checkpoint)


@pytest.mark.parametrize("model_type", ["gemma2", "cohere", "mixtral", "bert", None])
@pytest.mark.reliability("bad_input", "policy of a family the forward cannot capture: refused by name")
def test_unsupported_families_are_refused_by_name(checkpoint: Path, model_type: str | None) -> None:
    _edit_config(checkpoint, model_type=model_type)
    with pytest.raises(UnsupportedFamilyError, match=f"model_type {model_type!r} is not a supported target family"
                                                     ".*supported: llama, mistral, qwen2, qwen3"):
        _load(checkpoint)


def test_architecture_must_match_the_family(checkpoint: Path) -> None:
    _edit_config(checkpoint, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(TargetConfigError, match=r"architectures \['Qwen2ForCausalLM'\], model_type 'llama'"):
        _load(checkpoint)


@pytest.mark.parametrize(("key", "value"), [
    ("hidden_size", 2**40), ("vocab_size", 0), ("num_hidden_layers", -2), ("intermediate_size", "64"),
    ("num_attention_heads", True), ("max_position_embeddings", 10**12), ("num_key_value_heads", 3),
    ("head_dim", 10**6),
])
@pytest.mark.reliability("bad_input", "policy config sizes not positive, not integers or out of bounds")
def test_config_sizes_are_bounded(checkpoint: Path, key: str, value: object) -> None:
    _edit_config(checkpoint, **{key: value})
    with pytest.raises(TargetConfigError, match=f"ckpt/config.json: .*{key}"):
        _load(checkpoint)


@pytest.mark.parametrize(("key", "value"), [("hidden_act", "os.system"), ("rope_scaling", {"rope_type": "evil"}),
                                            ("rms_norm_eps", "tiny")])
@pytest.mark.reliability("bad_input", "policy config with values transformers cannot build a model from")
def test_unbuildable_config_values_are_refused(checkpoint: Path, key: str, value: object) -> None:
    _edit_config(checkpoint, **{key: value})
    with pytest.raises(TargetConfigError, match="ckpt/config.json: "):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy config whose sizes disagree with the tensors in the headers")
def test_config_inconsistent_with_weights_is_refused(checkpoint: Path) -> None:
    _edit_config(checkpoint, intermediate_size=128)
    with pytest.raises(TensorShapeError, match=r"tensor model.layers.0.mlp.down_proj.weight has shape \(32, 64\), "
                                               r"config.json implies \(32, 128\) \(the headers hold \d+ parameters"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy checkpoint without lm_head")
def test_missing_lm_head_is_refused(checkpoint: Path) -> None:
    _rewrite_shard(checkpoint, "lm_head.weight", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(MissingTensorError, match=r"tensor lm_head.weight \(96, 32\) is in no weights file"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy checkpoint missing a decoder layer")
def test_missing_layer_is_refused(checkpoint: Path) -> None:
    index = json.loads((checkpoint / INDEX_FILE).read_text())
    for shard in {v for k, v in index["weight_map"].items() if k.startswith("model.layers.1.")}:
        _rewrite_shard(checkpoint, next(k for k, v in index["weight_map"].items() if v == shard),
                       lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.")])
    with pytest.raises(MissingTensorError, match=r"tensor model.layers.1.\S+ .* is in no weights file"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy checkpoint with a tensor the config does not imply")
def test_unexpected_tensor_is_refused(checkpoint: Path) -> None:
    _rewrite_shard(checkpoint, "lm_head.weight", lambda t: t.update({"model.layers.2.mlp.up_proj.weight":
                                                                      torch.zeros(4, 4)}))
    with pytest.raises(UnexpectedTensorError, match=r"model-\d+-of-\d+.safetensors: tensor "
                                                    r"model.layers.2.mlp.up_proj.weight is not a parameter"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy tensor of the wrong shape")
def test_wrong_shape_is_refused(checkpoint: Path) -> None:
    _rewrite_shard(checkpoint, "model.norm.weight", lambda t: t.update({"model.norm.weight": torch.ones(H + 1)}))
    with pytest.raises(TensorShapeError, match=r"tensor model.norm.weight has shape \(33,\), config.json implies "
                                               r"\(32,\)"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy tensor that is not floating point")
def test_integer_tensor_is_refused(checkpoint: Path) -> None:
    _rewrite_shard(checkpoint, "model.norm.weight",
                   lambda t: t.update({"model.norm.weight": torch.ones(H, dtype=torch.int32)}))
    with pytest.raises(TensorDtypeError, match="tensor model.norm.weight is I32"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy weights shard that is empty")
def test_empty_shard_is_refused(checkpoint: Path) -> None:
    shard = _shard_of(checkpoint, "model.norm.weight")
    shard.write_bytes(b"")
    with pytest.raises(WeightsLayoutError, match=f"{shard.name}: 0 bytes, not a safetensors file"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy weights shard truncated")
def test_truncated_shard_is_refused(checkpoint: Path) -> None:
    shard = _shard_of(checkpoint, "model.norm.weight")
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(WeightsLayoutError, match=f"{shard.name}: tensors end at byte"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy weights header claiming more bytes than the file holds")
def test_oversized_header_length_is_refused(checkpoint: Path) -> None:
    shard = _shard_of(checkpoint, "model.norm.weight")
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    with pytest.raises(WeightsLayoutError, match=f"{shard.name}: header of {2**62} bytes"):
        _load(checkpoint)


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "model.bin"])
@pytest.mark.reliability("bad_input", "policy index naming a file outside the checkpoint")
def test_index_paths_stay_in_the_directory(checkpoint: Path, target: str) -> None:
    index = json.loads((checkpoint / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = target
    (checkpoint / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(WeightsLayoutError, match="tensor 'model.norm.weight' maps to"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy index disagreeing with the shards' headers")
def test_index_must_match_the_shards(checkpoint: Path) -> None:
    index = json.loads((checkpoint / INDEX_FILE).read_text())
    names = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(n for n in names if n != index["weight_map"]["model.norm.weight"])
    (checkpoint / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(WeightsLayoutError, match="holds tensor model.norm.weight, which model.safetensors.index.json"):
        _load(checkpoint)


@pytest.mark.reliability("bad_input", "policy with tied embeddings whose stored lm_head differs")
def test_tied_lm_head_must_equal_the_embeddings(saved: dict, tmp_path: Path) -> None:
    model, directory = saved["qwen3"]
    shutil.copytree(directory, tmp_path / "ckpt")
    head = torch.randn(V, H)
    _rewrite_shard(tmp_path / "ckpt", "model.norm.weight", lambda t: t.update({"lm_head.weight": head}))
    with pytest.raises(TiedWeightsError, match="ties lm_head to embed_tokens"):
        _load(tmp_path / "ckpt")
    same = model.model.embed_tokens.weight.detach().clone()
    _rewrite_shard(tmp_path / "ckpt", "model.norm.weight", lambda t: t.update({"lm_head.weight": same}))
    assert torch.equal(_load(tmp_path / "ckpt").lm_head.weight, same)  # a redundant copy is fine


# -- what the drafter export says of the target

@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_export_carries_the_targets_serving_fields(saved: dict, tmp_path: Path, family: str,
                                                           kind: str) -> None:
    model, _ = saved[family]
    meta = TargetMetadata.of(model.config)
    drafter = fresh_drafter(DrafterConfig(kind=kind, draft_vocab_size=V // 2), model, torch.arange(V), seed=0)
    config = json.loads((save_drafter(drafter, tmp_path / "d", meta) / "config.json").read_text())
    rope = FAMILIES[family]().rope_parameters
    assert config["vocab_size"] == V
    assert config["hidden_size"] == H
    assert config["rope_theta"] == rope["rope_theta"]
    assert config["rope_scaling"] == ({k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
                                      if family == "llama" else None)
    assert config["max_position_embeddings"] == 256
    if kind == "eagle3":
        assert config["target_hidden_size"] == H
        assert config["draft_vocab_size"] == V // 2
    else:
        assert "target_hidden_size" not in config
    assert load_drafter(tmp_path / "d", LAYERS).config.rope_theta == rope["rope_theta"]


def test_drafter_export_refuses_a_drafter_of_another_target(saved: dict, tmp_path: Path) -> None:
    drafter = fresh_drafter(DrafterConfig(kind="eagle3"), saved["llama"][0], torch.arange(V), seed=0)
    with pytest.raises(ValueError, match="rope_theta 500000.0 != target's 1000000.0"):
        save_drafter(drafter, tmp_path / "d", TargetMetadata.of(saved["qwen2"][0].config))


# -- a checkpoint larger than the memory the process may use

def _sparse_checkpoint(directory: Path, config: LlamaConfig) -> int:
    """config.json and a model.safetensors whose header is complete and whose data is a hole: every header
    check passes, and the file takes no disk space. Returns the weights' bytes as stored (BF16)."""
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    header, offset = {}, 0
    for name, tensor in meta.state_dict().items():
        size = tensor.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    directory.mkdir()
    config.save_pretrained(directory)
    with open(directory / SINGLE_FILE, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


@pytest.mark.reliability("bad_input", "policy checkpoint needing more memory than the process may use (a sparse "
                                      "weights file): refused naming it and both figures, before allocating")
def test_a_checkpoint_larger_than_the_memory_available_is_refused_before_allocating(tmp_path: Path) -> None:
    config = LlamaConfig(vocab_size=4_194_304, hidden_size=32_768, intermediate_size=1, num_hidden_layers=1,
                         num_attention_heads=256, num_key_value_heads=256, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    stored = _sparse_checkpoint(tmp_path / "huge", config)
    needed = stored * 2 + 4_194_304 * 32_768 * 2  # float32 on the CPU, and the largest tensor staged from BF16
    assert needed > 2**40  # beyond any machine this runs on
    with pytest.raises(target_checks.TargetMemoryError) as failure:
        target_lib.load_checkpoint((tmp_path / "huge").as_uri())
    message = str(failure.value)
    assert message.startswith(f"{(tmp_path / 'huge').as_uri()}: loading needs {needed} bytes")
    assert re.search(r"more than the \d+ bytes \(.* GiB\) this process may use \((MemAvailable|cgroup|RLIMIT)",
                     message), message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_checkpoint_larger_than_the_gpu_is_refused_before_allocating(tmp_path: Path) -> None:
    config = LlamaConfig(vocab_size=4_194_304, hidden_size=32_768, intermediate_size=1, num_hidden_layers=1,
                         num_attention_heads=256, num_key_value_heads=256, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    _sparse_checkpoint(tmp_path / "huge", config)
    with pytest.raises(target_checks.TargetMemoryError, match=r"this process may use \(free memory of cuda"):
        target_lib.load_checkpoint((tmp_path / "huge").as_uri(), device="cuda")


def test_memory_bound_of_this_process_is_read() -> None:
    bound = available_memory("cpu")
    assert bound is not None
    assert 0 < bound.bytes < 2**50, bound


# -- a real-size target on a GPU

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_billion_parameter_target_loads_in_bf16_on_cuda(tmp_path: Path) -> None:
    """A Llama-3.2-1B-shaped target (1.24e9 parameters, built from its config, random weights) in
    shards: loaded in bf16 on CUDA, its forward equals transformers' own bf16 load of the files."""
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) > 1e9
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="1GB")
    del model
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2
    ours = target_lib.load_checkpoint(str(tmp_path), device="cuda")  # auto: bf16 on CUDA
    assert ours.dtype == torch.bfloat16
    assert ours.device.type == "cuda"
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, local_files_only=True)
    reference = reference.to("cuda").eval()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
    out = target_forward.forward(ours, ids, [2, 8, 13, 16])
    with torch.no_grad():
        ref = reference(ids, output_hidden_states=True)
    # Same weights; the attention kernel CUDA picks may differ between the two calls (a mask or none), so
    # values differ by bf16 rounding steps that compound along the layers: close at each layer's scale.
    pairs = [(out.layers[:, :, j], ref.hidden_states[k]) for j, k in enumerate([2, 8, 13])]
    for ours_t, ref_t in [*pairs, (out.features, ref.hidden_states[16]), (out.logits, ref.logits)]:
        torch.testing.assert_close(ours_t, ref_t, rtol=2e-2, atol=2e-2 * float(ref_t.abs().amax()))
    assert torch.isfinite(out.logits.float()).all()
