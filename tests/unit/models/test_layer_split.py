"""A policy's decoder layers split across devices (pipeline.models.layer_split): its hidden states equal the
whole policy's, for every supported family.

On the CPU every block is on the one CPU device, so these tests prove the placement (every layer in a
contiguous block, a tied lm_head beside its embeddings), the meta build and per-block allocation, the
hooks running before each block and the final norm, the layer catching and a KV-cached decode through
them, all bit-equal to the whole policy. The copies between devices are no-ops here: what the hooks
carry is checked on the meta device, and real copies only by the tests on two CUDA devices at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, GemmaConfig, LlamaConfig, MixtralConfig

from pipeline.config import DrafterConfig, PipelineConfig
from pipeline.data.rollouts import Rollout
from pipeline.data.store import ObjectStore
from pipeline.evaluation.speculative import follow_target, generate_batch
from pipeline.models import layer_split, target_checks, target_forward
from pipeline.models import target as target_lib
from pipeline.models.drafter import fresh_drafter
from pipeline.models.layer_split import Placement, UnsplittableFamilyError, balance
from pipeline.models.memory import MemoryBound
from pipeline.models.target import LoadSettings
from pipeline.sources import extract
from tests.support.families import COMMON, LAYERS, SHARD, VARIANTS, V, random_model

GiB = 2**30
SEQ = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in VARIANTS:
        directory = tmp_path_factory.mktemp(family)
        random_model(family).save_pretrained(directory, safe_serialization=True, max_shard_size=SHARD)
        out[family] = directory
    return out


def _ids(rows: int = 2, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (rows, length), generator=torch.Generator().manual_seed(seed))


def _whole_and_split(directory: Path, dtype: str, devices: int = 2):
    whole = target_lib.load_checkpoint(directory.as_uri(), settings=LoadSettings(dtype=dtype, split="none"))
    split = target_lib.load_checkpoint(directory.as_uri(),
                                       settings=LoadSettings(dtype=dtype, split="layers", split_devices=devices))
    return whole, split


def _decode(model: torch.nn.Module, prompt: torch.Tensor, steps: torch.Tensor) -> list[target_forward.TargetOutput]:
    """A prefill, then the columns of `steps` one at a time through the KV cache: evaluation's path."""
    cache = DynamicCache()
    every = list(range(model.config.num_hidden_layers + 1))
    outs = [target_forward.forward(model, prompt, every, past_key_values=cache,
                                   position_ids=torch.arange(prompt.shape[1], device=prompt.device).expand(
                                       prompt.shape[0], -1))]
    for t in range(steps.shape[1]):
        position = torch.full((steps.shape[0], 1), prompt.shape[1] + t, device=prompt.device)
        outs.append(target_forward.forward(model, steps[:, t : t + 1], every, past_key_values=cache,
                                           position_ids=position))
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", VARIANTS)
def test_split_policy_hidden_states_equal_the_whole_policy_bitwise(saved: dict, family: str, dtype: str) -> None:
    """Every layer id (vLLM's, 0..L), as extraction catches them and as evaluation's forward returns them
    with logits, prefill and cached decoding: bit-equal between the whole policy and its two blocks.
    Broke if a block missed a parameter, a buffer (rotary inv_freq) were computed differently, a tied
    lm_head were split from its embeddings, or a layer read its mask or phases from another block."""
    whole, split = _whole_and_split(saved[family], dtype)
    placement = layer_split.placement_of(split)
    assert placement.devices == ("cpu", "cpu")
    assert set(placement.layer_blocks) == {0, 1}  # both blocks hold layers
    assert not layer_split.placement_of(whole).split
    assert (split.lm_head.weight is split.model.embed_tokens.weight) == (family == "qwen3")
    for name, tensor in whole.state_dict().items():
        assert torch.equal(split.state_dict()[name], tensor), name

    ids, every = _ids(), list(range(LAYERS + 1))
    for ours, theirs in zip(target_forward.layer_states(split, ids, every),
                            target_forward.layer_states(whole, ids, every), strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(target_forward.layer_states(split, ids, None)[0],
                       target_forward.layer_states(whole, ids, None)[0])
    for ours, theirs in zip(_decode(split, ids, _ids(2, 3, 2)), _decode(whole, ids, _ids(2, 3, 2)), strict=True):
        assert torch.equal(ours.layers, theirs.layers)
        assert torch.equal(ours.features, theirs.features)
        assert torch.equal(ours.logits, theirs.logits)


def test_five_layers_in_three_blocks_equal_the_whole_policy(tmp_path: Path) -> None:
    """More layers than blocks, three blocks: contiguous, balanced, and still bit-equal."""
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 5}, tie_word_embeddings=False)
    model = target_lib.build_target(config, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size=SHARD)
    whole, split = _whole_and_split(tmp_path, "float32", devices=3)
    blocks = layer_split.placement_of(split).layer_blocks
    assert list(blocks) == sorted(blocks)
    assert set(blocks) == {0, 1, 2}
    ids, every = _ids(), list(range(6))
    for ours, theirs in zip(target_forward.layer_states(split, ids, every),
                            target_forward.layer_states(whole, ids, every), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", VARIANTS)
def test_extraction_and_speculative_decoding_of_a_split_policy_equal_the_whole(saved: dict, family: str) -> None:
    """The stages' own code on the split policy: extraction's stored bf16 samples (padded batches, capture
    windows) and evaluation's batched speculative decoding with an EAGLE-3 drafter (its traces: tokens and
    accepted lengths per round), identical to the whole policy's."""
    whole, split = _whole_and_split(saved[family], "float32")
    g = torch.Generator().manual_seed(5)
    rollouts = [Rollout(sample_id=f"s{i}", input_ids=torch.randint(0, V, (n,), generator=g).tolist(),
                        loss_mask=[1] * n, reward=1.0, policy_version=1) for i, n in enumerate((9, 14, 5, 11))]
    windows = {"s0": (0, 9), "s1": (3, 14), "s2": (0, 5), "s3": (2, 8)}

    def samples(model):
        return list(extract.iter_hidden_states(model, rollouts, 1, tokens_per_batch=32, layer_ids=[0, 1, LAYERS],
                                               windows=windows))

    for ours, theirs in zip(samples(split), samples(whole), strict=True):
        assert ours.sample_id == theirs.sample_id
        assert torch.equal(ours.hidden, theirs.hidden)

    prompts = [torch.randint(0, V, (n,), generator=g) for n in (3, 7, 12)]
    drafter = fresh_drafter(DrafterConfig(kind="eagle3"), whole, torch.ones(V, dtype=torch.int64), seed=0)
    traces = [generate_batch(model, follow_target(drafter, model), prompts, 8, 3) for model in (split, whole)]
    assert [(t.tokens, t.accepted_per_round) for t in traces[0]] == \
        [(t.tokens, t.accepted_per_round) for t in traces[1]]


# -- which families, and when

def test_every_family_the_split_takes_is_tested_above() -> None:
    """A family enters SPLIT_FAMILIES only with its equality test: the families parametrizing the tests above
    cover the table, and the table holds only families the loader takes."""
    tested = {VARIANTS[name]().model_type for name in VARIANTS}
    assert set(layer_split.SPLIT_FAMILIES) <= tested
    assert set(layer_split.SPLIT_FAMILIES) <= set(target_checks.FAMILIES)


@pytest.mark.parametrize("config", [
    MixtralConfig(**COMMON, num_local_experts=2, num_experts_per_tok=1),
    GemmaConfig(**COMMON, head_dim=8),
], ids=["mixtral", "gemma"])
def test_a_family_without_an_exact_split_is_refused_by_name(config) -> None:
    with pytest.raises(UnsplittableFamilyError, match=rf"model_type '{config.model_type}' cannot be split") as e:
        layer_split.check_splittable(config, "s3://bucket/policy")
    assert "llama, mistral, qwen2, qwen3" in str(e.value)


@pytest.mark.reliability("bad_input", "a policy of a family the layer split does not cover, with target.split "
                                      "layers: refused naming its model_type, before allocating")
def test_the_load_refuses_a_split_of_an_uncovered_family(saved: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the load path: a family outside SPLIT_FAMILIES (qwen2 taken out of the table) is refused
    when a split is asked for, and loads whole when none is."""
    monkeypatch.delitem(layer_split.SPLIT_FAMILIES, "qwen2")
    with pytest.raises(UnsplittableFamilyError, match="model_type 'qwen2' cannot be split"):
        target_lib.load_checkpoint(saved["qwen2"].as_uri(), settings=LoadSettings(split="layers", split_devices=2))
    assert target_lib.load_checkpoint(saved["qwen2"].as_uri(), settings=LoadSettings(split="auto")) is not None


FREE_H100 = MemoryBound(79 * GiB, "free memory of cuda:0")


@pytest.mark.parametrize(("mode", "needed", "bound", "split"), [
    ("auto", 16 * GiB, FREE_H100, False),  # an 8B policy in bf16 fits: whole
    ("auto", 79 * GiB, FREE_H100, False),  # exactly the free memory still fits
    ("auto", 141 * GiB, FREE_H100, True),  # a 70B policy in bf16 does not: split
    ("auto", 141 * GiB, None, False),  # no figure to decide on: whole
    ("layers", 1 * GiB, FREE_H100, True),  # always
    ("none", 141 * GiB, FREE_H100, False),  # never: the memory check refuses it
])
def test_auto_splits_only_when_the_weights_exceed_the_device(mode, needed, bound, split) -> None:
    assert layer_split.wants_split(mode, needed, bound) is split


def test_auto_never_splits_on_the_cpu(saved: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks on the one CPU would gain no memory: with the CPU's figure below the weights, `auto` still
    loads whole (and the load's own memory check, on the real figure, decides)."""
    monkeypatch.setattr(layer_split, "available_memory", lambda _device: MemoryBound(1, "hand-made"))
    model = target_lib.load_checkpoint(saved["llama"].as_uri(), settings=LoadSettings(split="auto", split_devices=2))
    assert not layer_split.placement_of(model).split


@pytest.mark.parametrize(("layers", "home", "blocks", "expected"), [
    ([4, 4, 4, 4], 0, 2, (0, 0, 1, 1)),
    ([1] * 6, 6, 2, (1,) * 6),  # the home block's embeddings and head weigh as much as every layer
    ([3, 3, 3, 3, 3, 3], 3, 3, (0, 0, 1, 1, 1, 2)),  # largest load 9; earlier blocks fill first
    ([5, 1, 1, 1, 5], 0, 2, (0, 0, 0, 1, 1)),
])
def test_blocks_are_contiguous_with_the_least_largest_load(layers, home, blocks, expected) -> None:
    assert balance(layers, home, blocks) == expected


def test_a_split_whose_block_exceeds_its_device_is_refused_naming_it() -> None:
    placement = Placement(("cpu", "cpu"), (0, 1), (2**50, 2**50))
    with pytest.raises(target_checks.TargetMemoryError, match=r"s3://b/p: split across 2 devices, cpu needs "
                                                              r"2251799813685248 bytes"):
        layer_split._check_blocks(placement, "s3://b/p", torch.bfloat16)


@pytest.mark.parametrize(("index", "count", "visible", "ranks", "block"), [
    (0, 0, 8, 1, list(range(8))),  # one rank: every GPU
    (2, 0, 8, 1, list(range(2, 8))),  # from the process's own
    (0, 4, 8, 1, [0, 1, 2, 3]),
    (4, 0, 8, 2, [4, 5, 6, 7]),  # two ranks share the node: four each
    (6, 2, 8, 4, [6, 7]),
])
def test_a_split_spans_its_share_of_the_node_s_gpus(index, count, visible, ranks, block) -> None:
    assert layer_split.gpu_block(index, count, visible, ranks) == block


@pytest.mark.parametrize(("index", "count", "visible", "ranks", "message"), [
    (1, 0, 8, 2, "device must be the first of its own block"),  # rank 1 on cuda:1 would overlap rank 0's GPUs
    (4, 6, 8, 1, "target.split_devices is 6 from cuda:4, but 8 CUDA devices are visible"),
])
def test_a_split_that_would_share_or_lack_gpus_is_refused(index, count, visible, ranks, message) -> None:
    with pytest.raises(ValueError, match=message):
        layer_split.gpu_block(index, count, visible, ranks)


# -- the configuration, and the load function the stages call

def test_load_policy_splits_as_the_config_says(saved: dict, tmp_path: Path) -> None:
    """`target.split` reaches every stage through load_settings and load_policy; a split and a whole load
    of one checkpoint are distinct cache entries."""
    cfg = PipelineConfig(target={"split": "layers", "split_devices": 2})
    settings = target_lib.load_settings(cfg)
    assert (settings.split, settings.split_devices) == ("layers", 2)
    store = ObjectStore(saved["llama"].parent.as_uri())
    split = target_lib.load_policy(store, saved["llama"].name, "cpu", settings)
    whole = target_lib.load_policy(store, saved["llama"].name, "cpu", LoadSettings(split="none"))
    assert layer_split.placement_of(split).split
    assert not layer_split.placement_of(whole).split


@pytest.mark.parametrize(("overrides", "message"), [
    ({"target": {"split": "auto", "split_devices": 1}}, "target.split_devices is 1"),
    ({"target": {"split": "layers"}}, "target.split layers on device cpu needs target.split_devices >= 2"),
    ({"device": "mps", "target": {"split": "layers", "split_devices": 2}},
     "target.split layers needs device cpu or cuda"),
    ({"target": {"split": "tensor"}}, "target.split"),
])
def test_split_settings_that_cannot_work_are_refused_naming_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**overrides)


# -- two GPUs

@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("family", VARIANTS)
def test_split_across_two_gpus_equals_one_gpu_bitwise(saved: dict, family: str) -> None:
    """bf16 on cuda:0 whole, and across cuda:0 and cuda:1: the residual stream really crosses devices."""
    uri = saved[family].as_uri()
    whole = target_lib.load_checkpoint(uri, "cuda:0", settings=LoadSettings(dtype="bfloat16", split="none"))
    split = target_lib.load_checkpoint(uri, "cuda:0",
                                       settings=LoadSettings(dtype="bfloat16", split="layers", split_devices=2))
    assert layer_split.placement_of(split).devices == ("cuda:0", "cuda:1")
    assert split.model.layers[-1].mlp.down_proj.weight.device == torch.device("cuda:1")
    ids, every = _ids().cuda(), list(range(LAYERS + 1))
    for ours, theirs in zip(target_forward.layer_states(split, ids, every),
                            target_forward.layer_states(whole, ids, every), strict=True):
        assert ours.device == torch.device("cuda:0")
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(_decode(split, ids, _ids(2, 3, 2).cuda()), _decode(whole, ids, _ids(2, 3, 2).cuda()),
                            strict=True):
        assert torch.equal(ours.layers, theirs.layers)
        assert torch.equal(ours.logits, theirs.logits)


def test_a_layer_s_inputs_are_carried_whole_to_its_device() -> None:
    """What the hooks carry, on a device that differs from the CPU (meta): the residual stream, the rotary
    phases (a tuple), a mask per layer type (a dict) and positions; a KV cache object is left as it is."""
    cache = DynamicCache()
    args, kwargs = layer_split._inputs_to("meta")(
        None, (torch.ones(2, 3, 4),),
        {"position_embeddings": (torch.ones(3, 8), torch.ones(3, 8)), "attention_mask": {"full_attention": None,
         "sliding_attention": torch.zeros(2, 1, 3, 3)}, "position_ids": torch.arange(3)[None], "past_key_values": cache,
         "use_cache": True},
    )
    assert args[0].device.type == "meta"
    assert all(t.device.type == "meta" for t in kwargs["position_embeddings"])
    assert isinstance(kwargs["position_embeddings"], tuple)
    assert kwargs["attention_mask"]["full_attention"] is None
    assert kwargs["attention_mask"]["sliding_attention"].device.type == "meta"
    assert kwargs["position_ids"].device.type == "meta"
    assert kwargs["past_key_values"] is cache
    assert kwargs["use_cache"] is True


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_auto_splits_a_policy_that_does_not_fit_its_gpu(saved: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each GPU reported with one byte less free than the whole policy needs: `auto` splits it across two,
    each block within the figure, and the forward equals the whole policy's."""
    uri = saved["llama"].as_uri()
    whole = target_lib.load_checkpoint(uri, "cuda:0", settings=LoadSettings(dtype="bfloat16", split="none"))
    needed = sum(p.numel() * p.element_size() for p in whole.parameters())
    monkeypatch.setattr(layer_split, "available_memory", lambda _device: MemoryBound(needed - 1, "hand-made"))
    split = target_lib.load_checkpoint(uri, "cuda:0",
                                       settings=LoadSettings(dtype="bfloat16", split="auto", split_devices=2))
    assert layer_split.placement_of(split).devices == ("cuda:0", "cuda:1")
    ids = _ids().cuda()
    assert torch.equal(target_forward.forward(split, ids, [1]).logits, target_forward.forward(whole, ids, [1]).logits)
