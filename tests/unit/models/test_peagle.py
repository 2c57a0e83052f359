"""The P-EAGLE drafter: COD sampling and its cross-depth mask, parallel decoding, checkpoints, warm start, training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from pipeline.config import DrafterConfig, OptimConfig, TrainConfig
from pipeline.evaluation import speculative
from pipeline.evaluation.round_cost import RoundCost, drafter_cost_ratio
from pipeline.models import drafter as drafters
from pipeline.models import target_forward
from pipeline.models.checkpoint import CheckpointError, load_drafter, save_drafter
from pipeline.models.eagle import CommittedPairs, attend
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter, TTTCache, default_aux_layer_ids, draft_vocab
from pipeline.models.peagle import (
    CodSample,
    ParallelMask,
    PEagleConfig,
    PEagleDrafter,
    PEagleProposer,
    cod_sample,
    context_mask,
    cross_depth_mask,
)
from pipeline.training.dataset import InMemoryDataset, Sample
from pipeline.training.loop import train_drafter
from pipeline.training.losses import peagle_loss
from pipeline.training.window import pack
from tests.support.targets import tiny_target

V, DV, H, HEADS, LAYERS = 32, 24, 32, 2, 4
AUX = default_aux_layer_ids(LAYERS)
MAX_NEW = 12


def make_config(**overrides) -> PEagleConfig:
    base = {
        "vocab_size": V, "draft_vocab_size": DV, "hidden_size": H, "target_hidden_size": H,
        "intermediate_size": 2 * H, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "aux_layer_ids": AUX, "num_hidden_layers": 2, "mask_token_id": V - 1, "num_depths": 4,
    }
    return PEagleConfig(**{**base, **overrides})


def random_counts(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target(V, H, LAYERS, HEADS)


def drafter_for(target: LlamaForCausalLM, seed: int = 0, **overrides) -> PEagleDrafter:
    torch.manual_seed(seed)
    model = PEagleDrafter(make_config(**overrides))
    model.set_vocab(*draft_vocab(random_counts(seed), DV))
    model.attach(target)
    model.init_lm_head(target)
    with torch.no_grad():  # non-trivial norms, so a skipped or misplaced norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model.eval()


# -- COD sampling and the cross-depth mask ----------------------------------------------------------------------


def picture(mask: torch.Tensor) -> list[str]:
    return ["".join("x" if v else "." for v in row) for row in mask.tolist()]


def test_cod_sampling_and_cross_depth_mask_pinned() -> None:
    """Two documents (positions 0-4 and 5-7), 6 counted positions. Depth d keeps
    floor((6 - d) * max(0.5**d, 0.25)) chains: 2 at depth 1 (of the 6 whose token a + 1 counts in
    a's document), 1 at depth 2 (of those 2, the one whose a + 2 still does), none at depth 3."""
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1])
    docs = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])

    sample = cod_sample(loss_mask, docs, num_depths=4, ratio=0.5, ratio_min=0.25,
                        generator=torch.Generator().manual_seed(0))

    assert sample.anchor.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 2, 6, 2]
    assert sample.depth.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2]
    # rows a0..a7 at depth 0, then the chains' deeper rows; x = may attend
    assert picture(cross_depth_mask(sample, docs)) == [
        # a0 .. a7 (d0)  a2d1 a6d1 a2d2
        "x..........",  # a0 d0
        "xx.........",  # a1 d0
        "xxx........",  # a2 d0
        "xxxx.......",  # a3 d0
        "xxxxx......",  # a4 d0
        ".....x.....",  # a5 d0: a new document
        ".....xx....",  # a6 d0
        ".....xxx...",  # a7 d0
        "xxx.....x..",  # a2 d1: its context up to a2, and itself
        ".....xx..x.",  # a6 d1
        "xxx.....x.x",  # a2 d2: its own chain's d1 row, never a6's
    ]


def test_cod_sampling_keeps_every_chain_when_the_ratio_is_one() -> None:
    """ratio 1: depth d keeps every chain that can continue (capped at n_valid - d), none drawn at random."""
    loss_mask = torch.tensor([1, 1, 1, 1, 1, 1])
    docs = torch.tensor([0, 0, 0, 1, 1, 1])
    sample = cod_sample(loss_mask, docs, num_depths=3, ratio=1.0, ratio_min=1.0)
    assert list(zip(sample.anchor.tolist(), sample.depth.tolist(), strict=True)) == [
        (0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0),
        (0, 1), (1, 1), (3, 1), (4, 1),  # a + 1 in the same document
        (0, 2), (3, 2),
    ]


def test_cross_depth_mask_pinned_on_the_docstring_case() -> None:
    sample = CodSample(torch.tensor([0, 1, 2, 0, 1, 0]), torch.tensor([0, 0, 0, 1, 1, 2]))
    assert picture(cross_depth_mask(sample, torch.zeros(3, dtype=torch.int64))) == [
        "x.....",
        "xx....",
        "xxx...",
        "x..x..",
        "xx..x.",
        "x..x.x",
    ]


class DenseAttention:
    """The reference: eager attention under the dense (M, M) mask, every row scored against every row."""

    position_offset = 0

    def attend(self, query, key, value, mask: ParallelMask) -> torch.Tensor:
        return attend(query, key, value, mask.dense())


def test_the_structured_mask_is_the_cross_depth_mask_and_attends_alike(target: LlamaForCausalLM) -> None:
    """The CPU's attention keeps the mask's structure (context block + chain rows); densified it is the
    pictured cross-depth mask, and attending by it gives the dense attention's states."""
    docs = torch.tensor([0] * 9 + [1] * 7)
    loss_mask = torch.ones(16)
    loss_mask[[0, 9]] = 0
    sample = cod_sample(loss_mask, docs, 4, 0.8, 0.3, torch.Generator().manual_seed(2))
    assert int(sample.depth.max()) == 3
    mask = ParallelMask.of(sample, context_mask(sample, docs))
    assert torch.equal(mask.dense()[0, 0], cross_depth_mask(sample, docs))

    model = drafter_for(target)
    g = torch.Generator().manual_seed(6)
    ids, aux = torch.randint(0, V, (1, 16), generator=g), torch.randn(1, 16, len(AUX) * H, generator=g)
    positions = torch.cat([torch.arange(9), torch.arange(7)])[None]
    with torch.no_grad():
        structured = model.forward_parallel(aux, ids, positions, sample, context_mask(sample, docs))
        real = (sample.depth == 0)[None]
        ids_m = torch.where(real, ids[:, sample.anchor], model.config.mask_token_id)
        aux_m = torch.where(real[..., None], aux[:, sample.anchor], model.mask_hidden)
        dense = model.layer_stack(ids_m, model.project_aux(aux_m), positions[:, sample.anchor] + sample.depth, mask,
                                  [DenseAttention() for _ in model.layers])
    torch.testing.assert_close(structured, dense, rtol=1e-5, atol=1e-5)


# -- the parallel forward is what decoding runs -----------------------------------------------------------------


def test_depth_rows_see_only_their_context_and_chain(target: LlamaForCausalLM) -> None:
    """Changing a row the mask hides (a later anchor, another chain) leaves a row's state unchanged."""
    model = drafter_for(target)
    g = torch.Generator().manual_seed(3)
    n = 8
    ids, aux = torch.randint(0, V, (1, n), generator=g), torch.randn(1, n, len(AUX) * H, generator=g)
    sample = CodSample(torch.tensor([*range(n), 2, 5, 2]), torch.tensor([0] * n + [1, 1, 2]))
    mask = context_mask(sample, torch.zeros(n, dtype=torch.int64))
    with torch.no_grad():
        base = model.forward_parallel(aux, ids, torch.arange(n)[None], sample, mask)[0]
        changed_aux = aux.clone()
        changed_aux[0, 3:] += 1.0  # anchors after 2
        other = model.forward_parallel(changed_aux, ids, torch.arange(n)[None], sample, mask)[0]
    for row in (2, n, n + 2):  # a2 d0, a2 d1, a2 d2
        torch.testing.assert_close(other[row], base[row], rtol=0, atol=0)
    assert not torch.allclose(other[n + 1], base[n + 1])  # a5 d1 sees anchors 3..5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_parallel_forward_by_sdpa_equals_the_eager_one(target: LlamaForCausalLM) -> None:
    """The training forward's attention on a GPU (SDPA under the cross-depth mask) against the CPU's eager one."""
    model = drafter_for(target, num_key_value_heads=1)
    g = torch.Generator().manual_seed(4)
    n = 40
    ids, aux = torch.randint(0, V, (1, n), generator=g), torch.randn(1, n, len(AUX) * H, generator=g)
    docs = torch.tensor([0] * 25 + [1] * 15)
    sample = cod_sample(torch.ones(n), docs, 4, 0.7, 0.2, torch.Generator().manual_seed(0))
    mask = context_mask(sample, docs)
    positions = torch.cat([torch.arange(25), torch.arange(15)])[None]
    with torch.no_grad():
        eager = model.forward_parallel(aux, ids, positions, sample, mask)
        gpu = model.to("cuda").forward_parallel(aux.cuda(), ids.cuda(), positions.cuda(), sample.to("cuda"),
                                                mask.cuda())
    torch.testing.assert_close(gpu.cpu(), eager, rtol=1e-4, atol=1e-4)


def test_proposer_equals_the_training_forward(target: LlamaForCausalLM) -> None:
    """One proposal = the parallel forward's depths 0..k-1 at the last committed position."""
    model = drafter_for(target, seed=2)
    prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(5))
    out = target_forward.forward(target, prompt[None], list(AUX))
    features = out.layers.flatten(2)[:, :-1]  # (1, n, n_aux * H)
    n, k = prompt.shape[0] - 1, 4
    pairs = CommittedPairs(features, prompt[None, 1:], torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))

    proposer = PEagleProposer(model)
    proposal = proposer.propose(pairs, k)[0]

    sample = CodSample(torch.tensor([*range(n), *([n - 1] * (k - 1))]), torch.tensor([0] * n + list(range(1, k))))
    with torch.no_grad():
        hidden = model.forward_parallel(features, prompt[None, 1:], torch.arange(n)[None], sample,
                                        context_mask(sample, torch.zeros(n, dtype=torch.int64)))[0]
        rows = hidden[[n - 1, *range(n, n + k - 1)]]
        expected = model.draft_to_target[model.lm_head(model.norm(rows)).argmax(-1)]
    assert proposal.tolist() == expected.tolist()
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    unrolled = model.draft_unrolled(features, [prompt[None, 1:]] * k, torch.arange(n)[None], causal)  # (k, 1, n)
    assert unrolled[:, 0, n - 1].tolist() == proposal.tolist()  # the teacher-forced estimate drafts alike
    assert proposer.forwards == 1
    assert proposer.cache.length == n  # the masked slots withdrawn, the pairs kept


def test_proposer_refuses_more_tokens_than_depths(target: LlamaForCausalLM) -> None:
    model = drafter_for(target)
    pairs = CommittedPairs(torch.zeros(1, 2, len(AUX) * H), torch.zeros(1, 2, dtype=torch.int64),
                           torch.arange(2)[None], torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="exceeds the 4 depths"):
        model.proposer().propose(pairs, 5)


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, V, (n,), generator=g) for n in (2, 5, 9)]


@pytest.mark.parametrize("k", [1, 3, 4], ids=["k1", "k3", "k4"])
def test_parallel_decoding_equals_greedy_decoding(
    target: LlamaForCausalLM, prompts: list[torch.Tensor], k: int
) -> None:
    """Speculative decoding with P-EAGLE, a batch of prompts of different lengths: token for token greedy."""
    model = drafter_for(target, seed=1)
    traces = speculative.generate_batch(target, model.proposer, prompts, MAX_NEW, k)
    for prompt, trace in zip(prompts, traces, strict=True):
        assert trace.tokens == speculative.greedy_generate(target, prompt, MAX_NEW)
        assert all(0 <= a <= k for a in trace.accepted_per_round)


def test_drafter_forwards_per_round_by_kind(target: LlamaForCausalLM, prompts: list[torch.Tensor]) -> None:
    """P-EAGLE drafts k tokens in one forward; EAGLE-3 in k."""
    peagle = drafter_for(target, seed=1)
    eagle3 = Eagle3Drafter(Eagle3Config(**{f: getattr(peagle.config, f) for f in Eagle3Config.__dataclass_fields__}))
    eagle3.attach(target)
    for model, expected in ((peagle, 1.0), (eagle3, 4.0)):
        metrics = speculative.evaluate(target, model.proposer, prompts, MAX_NEW, 4)
        assert metrics.drafter_forwards_per_round == expected
        assert metrics.as_dict()["drafter_forwards_per_round"] == expected


def test_cost_model_counts_forwards_not_tokens(target: LlamaForCausalLM) -> None:
    """c is the weights a drafter forward reads over the target's (embedding tables excluded)."""
    model = drafter_for(target)
    target_weights = sum(p.numel() for n, p in target.named_parameters() if "embed_tokens" not in n)
    drafter_weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert drafter_cost_ratio(model, target) == pytest.approx(drafter_weights / target_weights)
    parallel, chained = RoundCost(4, 3.0, 1.0, 0.1), RoundCost(4, 3.0, 4.0, 0.1)
    assert parallel.speedup == pytest.approx(3.0 / 1.1)
    assert chained.speedup == pytest.approx(3.0 / 1.4)
    assert parallel.drafter_forwards_per_token == pytest.approx(1 / 3)


# -- checkpoints ------------------------------------------------------------------------------------------------


def first_forward_logits(model: torch.nn.Module, seed: int = 12) -> torch.Tensor:
    """Depth 0 over a causal sequence: the first forward of decoding, (1, n, draft_vocab)."""
    g = torch.Generator().manual_seed(seed)
    n = 6
    ids, aux = torch.randint(0, V, (1, n), generator=g), torch.randn(1, n, len(AUX) * H, generator=g)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        if isinstance(model, PEagleDrafter):
            sample = CodSample(torch.arange(n), torch.zeros(n, dtype=torch.int64))
            return model.lm_head(model.norm(model.forward_parallel(aux, ids, torch.arange(n)[None], sample, causal)))
        state = model.step(ids, model.project_aux(aux), torch.arange(n)[None], causal, TTTCache())
        return model.lm_head(model.logits_input(state))


def test_export_import_is_bit_exact(tmp_path: Path, target: LlamaForCausalLM) -> None:
    model = drafter_for(target, seed=4, fc_norm=True)
    directory = save_drafter(model, tmp_path / "ckpt", target_forward.TargetMetadata.of(target.config))

    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    assert "mask_hidden" in tensors
    assert tensors["mask_hidden"].shape == (1, 1, len(AUX) * H)
    assert "embed_tokens.weight" in tensors  # trained, so always written
    assert {k.split(".")[1] for k in tensors if k.startswith("layers.")} == {"0", "1"}
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H  # EAGLE-3's first layer
    assert tensors["layers.1.self_attn.q_proj.weight"].shape[1] == H  # a Llama block
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["parallel_drafting"] is True
    assert config["pard_token"] == config["ptd_token_id"] == config["mask_token_id"] == V - 1
    assert config["num_hidden_layers"] == 2

    loaded = load_drafter(directory)
    assert isinstance(loaded, PEagleDrafter)
    assert loaded.config == model.config
    assert loaded.own_embeddings
    for key, value in model.trainable_state_dict().items():
        assert torch.equal(loaded.trainable_state_dict()[key], value), key
    assert torch.equal(first_forward_logits(loaded), first_forward_logits(model))


def test_without_mask_hidden_the_checkpoint_loads_as_eagle3(tmp_path: Path, target: LlamaForCausalLM) -> None:
    """A P-EAGLE checkpoint only adds mask_hidden (and config keys): without it, a one-layer one is EAGLE-3,
    whose first forward is P-EAGLE's depth 0."""
    model = drafter_for(target, seed=5, num_hidden_layers=1)
    directory = save_drafter(model, tmp_path / "ckpt")
    tensors = load_file(directory / "model.safetensors")
    del tensors["mask_hidden"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    loaded = load_drafter(directory)

    assert isinstance(loaded, Eagle3Drafter)
    assert loaded.own_embeddings  # the P-EAGLE drafter's trained embeddings came along
    torch.testing.assert_close(first_forward_logits(loaded), first_forward_logits(model), rtol=0, atol=0)


def test_a_deeper_checkpoint_without_mask_hidden_is_refused_as_eagle3(tmp_path: Path, target) -> None:
    directory = save_drafter(drafter_for(target), tmp_path / "ckpt")
    tensors = load_file(directory / "model.safetensors")
    del tensors["mask_hidden"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected keys .*layers.1"):
        load_drafter(directory)


# -- warm start -------------------------------------------------------------------------------------------------


def eagle3_for(target: LlamaForCausalLM, seed: int = 6) -> Eagle3Drafter:
    torch.manual_seed(seed)
    fields = {f: getattr(make_config(), f) for f in Eagle3Config.__dataclass_fields__}
    model = Eagle3Drafter(Eagle3Config(**fields))
    model.set_vocab(*draft_vocab(random_counts(seed), DV))
    model.attach(target)
    model.init_lm_head(target)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model.eval()


def test_warm_start_from_eagle3(target: LlamaForCausalLM) -> None:
    """The first layer, fc, norms, head and vocabulary carry over, the added layer starts as the identity:
    depth 0 drafts exactly what EAGLE-3 drafts first."""
    eagle3 = eagle3_for(target)
    cfg = DrafterConfig(kind="peagle", num_layers=3, num_depths=4)

    model = drafters.warm_start_from(eagle3, cfg)

    assert isinstance(model, PEagleDrafter)
    assert model.config.num_hidden_layers == 3
    assert model.config.mask_token_id == int((~eagle3.t2d).nonzero().max())  # outside the draft vocab
    assert torch.equal(model.d2t, eagle3.d2t)
    assert torch.equal(model.layers[0].self_attn.q_proj.weight, eagle3.midlayer.self_attn.q_proj.weight)
    assert torch.equal(model.embed_tokens.weight, eagle3.embed_tokens.weight)
    torch.testing.assert_close(first_forward_logits(model), first_forward_logits(eagle3), rtol=1e-6, atol=1e-6)
    assert drafters.warm_start_from(eagle3, DrafterConfig(kind="eagle3")) is eagle3
    assert drafters.warm_start_from(model, DrafterConfig(kind="eagle3")) is None


def test_warm_start_refuses_an_eagle3_drafter_of_another_shape(target: LlamaForCausalLM) -> None:
    eagle3 = eagle3_for(target)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        PEagleDrafter.from_eagle3(eagle3, make_config(aux_layer_ids=(1, 2, 3)))


def test_fresh_peagle_drafter_follows_the_config(target: LlamaForCausalLM) -> None:
    cfg = DrafterConfig(kind="peagle", draft_vocab_size=DV, num_layers=3, num_depths=5, mask_token_id=7)
    model = drafters.fresh_drafter(cfg, target, random_counts(1), seed=0)
    assert isinstance(model, PEagleDrafter)
    assert (model.config.num_hidden_layers, model.config.num_depths, model.config.mask_token_id) == (3, 5, 7)
    assert model.own_embeddings
    assert model.embed_tokens.weight.requires_grad
    assert torch.equal(model.embed_tokens.weight, target.get_input_embeddings().weight)


# -- training ---------------------------------------------------------------------------------------------------


def target_samples(target: LlamaForCausalLM, count: int, seed: int = 0) -> list[Sample]:
    layer_ids = [*AUX, LAYERS]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(10, 18, (1,), generator=g))
        start = int(torch.randint(0, V, (1,), generator=g))
        ids = (start + 3 * torch.arange(n)) % V
        layers = target_forward.forward(target, ids[None], layer_ids=layer_ids).layers[0]  # (T, n_aux + 1, H)
        mask = torch.ones(n, dtype=torch.int64)
        mask[:3] = 0
        out.append((ids, layers.flatten(1).float(), mask))
    return out


def test_pinned_loss_value(target: LlamaForCausalLM) -> None:
    """The loss of a fixed drafter on a fixed batch and COD sample, pinned and recomputed plainly: the mean
    over counted rows of -sum p log q, row (a, d) against the target's distribution of token a+2+d."""
    model = drafter_for(target, seed=0)
    batch = pack(target_samples(target, 2), window_tokens=64).to("cpu")
    teacher = model.teacher(target)
    with torch.no_grad():
        parts = peagle_loss(model, batch, teacher.norm, teacher.head, torch.Generator().manual_seed(0))
    torch.testing.assert_close(parts.loss, torch.tensor(3.1853807), rtol=1e-6, atol=1e-6)

    aux_dim = len(AUX) * H
    docs, loss_mask = batch.document_ids[0], batch.loss_mask[0]
    sample = cod_sample(loss_mask, docs, 4, 0.7, 0.2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.forward_parallel(batch.hidden_states[..., :aux_dim], batch.input_ids, batch.position_ids,
                                        sample, context_mask(sample, docs))[0]
        log_q = torch.log_softmax(model.lm_head(model.norm(hidden)), dim=-1)
    total = count = 0.0
    for row, (a, d) in enumerate(zip(sample.anchor.tolist(), sample.depth.tolist(), strict=True)):
        if a + d >= docs.shape[0] or docs[a + d] != docs[a] or not loss_mask[a + d]:
            continue
        p = torch.softmax(teacher.head @ teacher.norm(batch.target[0, a + d, aux_dim:]), dim=-1)
        total, count = total - float((p * log_q[row]).sum()), count + 1
    assert count > docs.shape[0] * 0.5  # depths beyond 0 are in the mean too
    assert parts.loss.item() == pytest.approx(total / count, rel=1e-5)


def test_gradients_reach_mask_hidden_embeddings_and_every_layer(target: LlamaForCausalLM) -> None:
    model = drafter_for(target).train()
    batch = pack(target_samples(target, 2), window_tokens=64).to("cpu")
    teacher = model.teacher(target)
    target.zero_grad(set_to_none=True)
    peagle_loss(model, batch, teacher.norm, teacher.head, torch.Generator().manual_seed(1)).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in target.parameters())


def test_train_drafter_lowers_the_peagle_loss() -> None:
    target = tiny_target(V, H, LAYERS, HEADS)
    with torch.no_grad():
        target.lm_head.weight.mul_(10.0)  # a peaked distribution: something to learn
    model = drafter_for(target, seed=0)
    samples = target_samples(target, 8, seed=1)
    teacher = model.teacher(target)
    cfg = TrainConfig(epochs=8, batch_size_per_gpu=4, max_seq_len=128, window_tokens=128, seed=1,
                      optim=OptimConfig(lr=3e-3, lr_warmup_steps=2))
    fixed = pack(samples, window_tokens=128).to("cpu")
    with torch.no_grad():
        before = peagle_loss(model.eval(), fixed, teacher.norm, teacher.head, torch.Generator().manual_seed(0))

    result = train_drafter(model, InMemoryDataset(samples), cfg, teacher=teacher)

    with torch.no_grad():
        after = peagle_loss(model, fixed, teacher.norm, teacher.head, torch.Generator().manual_seed(0))
    assert after.loss.item() < 0.85 * before.loss.item()
    assert sum(result.loss_history[-3:]) < sum(result.loss_history[:3])
