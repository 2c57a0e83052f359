"""The EAGLE-3 drafter: shapes, the TTT attention pattern, block-causal packing, the draft vocabulary, its config."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from pipeline.models.eagle3 import (
    Eagle3Drafter,
    TTTCache,
    default_aux_layer_ids,
    draft_vocab,
    shift_within_document,
)
from pipeline.training.losses import eagle3_loss
from pipeline.training.window import block_causal_mask, pack
from tests.support.eagle3 import (
    AUX,
    DV,
    HEADS,
    VARIANTS,
    H,
    V,
    causal,
    drafter_for,
    make_config,
    make_drafter,
    random_counts,
    random_inputs,
    target_samples,
    unroll,
)

# -- shapes -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize(("batch", "n"), [(1, 1), (2, 7)], ids=["1x1", "2x7"])
def test_shapes_at_every_stage(variant: str, batch: int, n: int) -> None:
    ht = 48  # a target wider than the drafter
    model = make_drafter(target_hidden_size=ht, **VARIANTS[variant])
    ids, aux = random_inputs(model, n, batch)
    assert aux.shape == (batch, n, len(AUX) * ht)

    g = model.project_aux(aux)
    assert g.shape == (batch, n, H)
    cache = TTTCache()
    positions = torch.arange(n).expand(batch, n)
    mask = causal(n).expand(batch, 1, n, n)
    state = model.step(ids, g, positions, mask, cache)
    assert state.shape == (batch, n, H)
    assert cache.step == 1
    state = model.step(ids, state, positions, mask, cache)
    assert state.shape == (batch, n, H)
    assert cache.step == 2
    logits = model.lm_head(model.logits_input(state))
    assert logits.shape == (batch, n, DV)
    assert torch.isfinite(logits).all()
    assert model.fc.weight.shape == (H, len(AUX) * ht)
    assert (model.fc_norm is not None) == (variant == "fc-norm")


def test_fc_norm_normalises_each_aux_chunk() -> None:
    model = make_drafter(fc_norm=True)
    _, aux = random_inputs(model, 5)
    chunks = aux.split(H, dim=-1)
    normed = [
        norm.weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)
        for norm, c in zip(model.fc_norm, chunks, strict=True)
    ]
    torch.testing.assert_close(model.project_aux(aux), torch.cat(normed, -1) @ model.fc.weight.T)
    # each chunk is normalised on its own: rescaling one chunk changes nothing
    scaled = torch.cat([chunks[0] * 7.0, *chunks[1:]], dim=-1)
    torch.testing.assert_close(model.project_aux(scaled), model.project_aux(aux), rtol=1e-4, atol=1e-4)


def test_norm_output_carries_the_post_norm_state() -> None:
    plain = make_drafter(seed=4)
    post = Eagle3Drafter(make_config(norm_output=True))
    post.load_state_dict(plain.state_dict())
    ids, aux = random_inputs(plain, 6)
    positions, mask = torch.arange(6)[None], causal(6)

    raw = plain.step(ids, plain.project_aux(aux), positions, mask, TTTCache())
    normed = post.step(ids, post.project_aux(aux), positions, mask, TTTCache())

    torch.testing.assert_close(normed, plain.norm(raw))
    assert post.logits_input(normed) is normed  # already post-norm: lm_head reads it as is
    torch.testing.assert_close(plain.logits_input(raw), plain.norm(raw))


# -- TTT step 0 is a plain causal decoder layer -----------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, heads, N, d), positions (B, N): Llama's rotate-half RoPE."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None, :, None].double() * inv_freq  # (B, 1, N, d/2)
    cos, sin = angles.cos().float(), angles.sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_step0(model: Eagle3Drafter, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A causal Llama-style layer over cat(input_layernorm(embed), hidden_norm(g)), written out independently."""
    c, layer = model.config, model.midlayer
    attn = layer.self_attn
    B, N, _ = g.shape
    d = c.head_dim
    embeds = _rms(model.embed_tokens.weight[ids], layer.input_layernorm.weight, c.rms_norm_eps)
    normed = _rms(g, layer.hidden_norm.weight, c.rms_norm_eps)
    residual = normed if c.norm_before_residual else g
    x = torch.cat([embeds, normed], dim=-1)  # (B, N, 2H)
    q = (x @ attn.q_proj.weight.T).view(B, N, c.num_attention_heads, d).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(B, N, c.num_key_value_heads, d).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(B, N, c.num_key_value_heads, d).transpose(1, 2)
    q, k = _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta)
    groups = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = residual + out.transpose(1, 2).reshape(B, N, -1) @ attn.o_proj.weight.T
    m = _rms(h, layer.post_attention_layernorm.weight, c.rms_norm_eps)
    mlp = layer.mlp
    return h + (F.silu(m @ mlp.gate_proj.weight.T) * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


@pytest.mark.parametrize("kv_heads", [HEADS, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("norm_before_residual", [False, True], ids=["residual-first", "norm-before-residual"])
@torch.no_grad()
def test_ttt_step0_is_a_causal_forward(norm_before_residual: bool, kv_heads: int) -> None:
    model = make_drafter(seed=2, norm_before_residual=norm_before_residual, num_key_value_heads=kv_heads)
    n, batch = 9, 2
    ids, aux = random_inputs(model, n, batch)
    g = model.project_aux(aux)
    positions = (torch.arange(n) + 3).expand(batch, n)

    out = model.step(ids, g, positions, causal(n).expand(batch, 1, n, n), TTTCache())

    torch.testing.assert_close(out, reference_step0(model, ids, g, positions))


def referenceunroll(
    model: Eagle3Drafter, step_ids: list[torch.Tensor], g: torch.Tensor, positions: torch.Tensor
) -> list[torch.Tensor]:
    """The TTT unroll written out with explicit keys and one boolean mask per step: step k's queries (phase
    t + k) attend to step 0's keys causally and to the keys of steps 1..k at their own position only."""
    c, layer = model.config, model.midlayer
    attn, mlp = layer.self_attn, layer.mlp
    B, N, _ = g.shape
    d, groups = c.head_dim, c.num_attention_heads // c.num_key_value_heads
    keys, values, states, state = [], [], [], g
    for k, ids in enumerate(step_ids):
        embeds = _rms(model.embed_tokens.weight[ids], layer.input_layernorm.weight, c.rms_norm_eps)
        normed = _rms(state, layer.hidden_norm.weight, c.rms_norm_eps)
        residual = normed if c.norm_before_residual else state
        x = torch.cat([embeds, normed], dim=-1)
        q = _rope((x @ attn.q_proj.weight.T).view(B, N, -1, d).transpose(1, 2), positions + k, c.rope_theta)
        key = _rope((x @ attn.k_proj.weight.T).view(B, N, -1, d).transpose(1, 2), positions + k, c.rope_theta)
        keys.append(key.repeat_interleave(groups, dim=1))
        values.append((x @ attn.v_proj.weight.T).view(B, N, -1, d).transpose(1, 2).repeat_interleave(groups, dim=1))
        mask = torch.cat([torch.ones(N, N, dtype=torch.bool).tril(), *[torch.eye(N, dtype=torch.bool)] * k], dim=1)
        out = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask)
        h = residual + out.transpose(1, 2).reshape(B, N, -1) @ attn.o_proj.weight.T
        m = _rms(h, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        h = h + (F.silu(m @ mlp.gate_proj.weight.T) * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        state = _rms(h, model.norm.weight, c.rms_norm_eps) if c.norm_output else h
        states.append(state)
    return states


@pytest.mark.parametrize("variant", ["plain", "norm-before-residual", "norm-output", "gqa"],
                         ids=["plain", "norm-before-residual", "norm-output", "gqa"])
@torch.no_grad()
def test_ttt_unroll_matches_an_explicit_mask_reference(variant: str) -> None:
    model = make_drafter(seed=9, **VARIANTS[variant])
    n, batch, steps = 7, 2, 4
    g = torch.Generator().manual_seed(2)
    step_ids = [torch.randint(0, V, (batch, n), generator=g) for _ in range(steps)]
    g0 = model.project_aux(torch.randn(batch, n, len(AUX) * H, generator=g))
    positions = (torch.arange(n) + 1).expand(batch, n)

    got = unroll(model, step_ids, g0, positions, causal(n).expand(batch, 1, n, n))
    expected = referenceunroll(model, step_ids, g0, positions)

    for k in range(steps):
        torch.testing.assert_close(got[k], expected[k], msg=f"step {k}")


def test_norm_before_residual_changes_the_output() -> None:
    model = make_drafter(seed=2)
    other = Eagle3Drafter(make_config(norm_before_residual=True))
    other.load_state_dict(model.state_dict())
    ids, aux = random_inputs(model, 5)
    args = (torch.arange(5)[None], causal(5))
    a = model.step(ids, model.project_aux(aux), *args, TTTCache())
    b = other.step(ids, other.project_aux(aux), *args, TTTCache())
    assert not torch.allclose(a, b, atol=1e-3)


# -- TTT attention pattern --------------------------------------------------------------------------------------


def _perturb_ids(ids: torch.Tensor, where) -> torch.Tensor:
    out = ids.clone()
    out[:, where] = (out[:, where] + 7) % V
    return out


@pytest.mark.parametrize("variant", ["plain", "norm-output", "gqa"], ids=["plain", "norm-output", "gqa"])
@pytest.mark.parametrize("k", [1, 2, 3], ids=["step1", "step2", "step3"])
@torch.no_grad()
def test_later_steps_see_only_their_own_position(variant: str, k: int) -> None:
    model = make_drafter(seed=5, **VARIANTS[variant])
    n, t = 8, 4
    g = torch.Generator().manual_seed(3)
    step_ids = [torch.randint(0, V, (1, n), generator=g) for _ in range(k + 1)]
    g0 = model.project_aux(torch.randn(1, n, len(AUX) * H, generator=g))
    positions, mask = torch.arange(n)[None], causal(n)
    others = [i for i in range(n) if i != t]
    base = unroll(model, step_ids, g0, positions, mask)[k]

    # step-k (and step 1..k-1) tokens at other positions: no effect on position t
    for j in range(1, k + 1):
        changed = [*step_ids[:j], _perturb_ids(step_ids[j], others), *step_ids[j + 1 :]]
        torch.testing.assert_close(unroll(model, changed, g0, positions, mask)[k][:, t], base[:, t])
        # ... while they do change the other positions
        assert not torch.allclose(unroll(model, changed, g0, positions, mask)[k][:, others], base[:, others])
    # the same token at position t does matter
    changed = [*step_ids[:k], _perturb_ids(step_ids[k], [t])]
    assert not torch.allclose(unroll(model, changed, g0, positions, mask)[k][:, t], base[:, t])

    # step-0 inputs at positions <= t change position t; at positions > t they do not
    for earlier in (0, t):
        changed = [_perturb_ids(step_ids[0], [earlier]), *step_ids[1:]]
        assert not torch.allclose(unroll(model, changed, g0, positions, mask)[k][:, t], base[:, t]), earlier
        g_changed = g0.clone()
        g_changed[:, earlier] += 1.0
        assert not torch.allclose(unroll(model, step_ids, g_changed, positions, mask)[k][:, t], base[:, t])
    later = [_perturb_ids(step_ids[0], list(range(t + 1, n))), *step_ids[1:]]
    g_later = g0.clone()
    g_later[:, t + 1 :] += 1.0
    torch.testing.assert_close(unroll(model, later, g_later, positions, mask)[k][:, t], base[:, t])


@pytest.mark.parametrize("variant", ["plain", "norm-before-residual", "norm-output", "gqa"],
                         ids=["plain", "norm-before-residual", "norm-output", "gqa"])
@pytest.mark.parametrize("k", [1, 2, 3], ids=["k1", "k2", "k3"])
@torch.no_grad()
def test_training_unroll_matches_the_runtime_single_query(variant: str, k: int) -> None:
    model = make_drafter(seed=6, **VARIANTS[variant])
    n = 7
    g = torch.Generator().manual_seed(8)
    step_ids = [torch.randint(0, V, (1, n), generator=g) for _ in range(k + 1)]
    g0 = model.project_aux(torch.randn(1, n, len(AUX) * H, generator=g))
    positions = torch.arange(n)[None]

    training = unroll(model, step_ids, g0, positions, causal(n))

    # Eagle3Proposer's path: step 0 over the prefix, then one query at the last position
    cache = TTTCache()
    state = model.step(step_ids[0], g0, positions, causal(n), cache)[:, -1:]
    everything = torch.ones(1, 1, 1, n, dtype=torch.bool)
    runtime = [state]
    for j in range(1, k + 1):
        state = model.step(step_ids[j][:, -1:], state, positions[:, -1:], everything, cache)
        runtime.append(state)
    assert cache.step == k + 1
    assert all(key.shape[2] == 1 for key in cache.keys)

    for j in range(k + 1):
        torch.testing.assert_close(runtime[j][:, 0], training[j][:, -1], msg=f"step {j}")


# -- block-causal packing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 3], ids=["step0", "steps0-2"])
@torch.no_grad()
def test_packed_documents_are_independent(steps: int) -> None:
    model = make_drafter(seed=7)
    n0, n1 = 5, 6
    n = n0 + n1
    docs = torch.tensor([[0] * n0 + [1] * n1])
    positions = torch.cat([torch.arange(n0), torch.arange(n1)])[None]
    mask = block_causal_mask(docs)
    g = torch.Generator().manual_seed(4)
    step_ids = [torch.randint(0, V, (1, n), generator=g) for _ in range(steps)]
    aux = torch.randn(1, n, len(AUX) * H, generator=g)

    out = unroll(model, step_ids, model.project_aux(aux), positions, mask)

    aux2 = aux.clone()
    aux2[:, :n0] = torch.randn(1, n0, aux.shape[-1], generator=g) * 3
    ids2 = [_perturb_ids(ids, list(range(n0))) for ids in step_ids]
    out2 = unroll(model, ids2, model.project_aux(aux2), positions, mask)
    alone = unroll(model, [ids[:, n0:] for ids in step_ids], model.project_aux(aux[:, n0:]),
                    torch.arange(n1)[None], causal(n1))
    for k in range(steps):
        torch.testing.assert_close(out2[k][:, n0:], out[k][:, n0:])
        assert not torch.allclose(out2[k][:, :n0], out[k][:, :n0])  # the change did reach document 0
        torch.testing.assert_close(out[k][:, n0:], alone[k])  # document 1 packed == document 1 alone


@pytest.mark.parametrize("k", [0, 1, 2, 5], ids=["k0", "k1", "k2", "k5"])
def test_shift_within_document_never_crosses_documents(k: int) -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    n = docs.shape[1]
    x = torch.arange(1, n + 1)[None] * 10  # (1, N) ints
    feats = torch.randn(1, n, 3)

    shifted = shift_within_document(x, docs, k, fill=-1)
    shifted_feats = shift_within_document(feats, docs, k)

    for t in range(n):
        if t + k < n and docs[0, t + k] == docs[0, t]:
            assert shifted[0, t] == x[0, t + k]
            assert torch.equal(shifted_feats[0, t], feats[0, t + k])
        else:
            assert shifted[0, t] == -1
            assert torch.equal(shifted_feats[0, t], torch.zeros(3))
    assert shifted.shape == x.shape
    assert shifted.dtype == x.dtype
    assert shifted_feats.shape == feats.shape


@pytest.mark.parametrize("variant", ["plain", "fc-norm", "norm-output"], ids=["plain", "fc-norm", "norm-output"])
def test_gradients_reach_only_the_drafters_trainable_weights(target: LlamaForCausalLM, variant: str) -> None:
    model = drafter_for(target, **VARIANTS[variant]).train()
    batch = pack(target_samples(target, model.config.aux_layer_ids, 2), window_tokens=64).to("cpu")
    teacher = model.teacher(target)
    assert teacher is not None
    target.zero_grad(set_to_none=True)

    eagle3_loss(model, batch, teacher.norm, teacher.head, ttt_steps=3, decay=0.8).loss.backward()

    assert model.embed_tokens.weight.grad is None
    assert not model.embed_tokens.weight.requires_grad
    trainable = dict(model.named_parameters())
    trainable.pop("embed_tokens.weight")
    assert trainable
    for name, p in trainable.items():
        assert name.startswith(("fc.", "fc_norm.", "midlayer.", "norm.", "lm_head.")), name
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name
    assert any(name.startswith("fc_norm.") for name in trainable) == (variant == "fc-norm")
    for name, p in target.named_parameters():
        assert p.grad is None, name


# -- the draft vocabulary ---------------------------------------------------------------------------------------


def test_draft_vocab_picks_the_most_frequent_ids_ties_to_the_lower_id() -> None:
    counts = torch.tensor([5, 9, 0, 9, 3, 5, 7, 1, 5, 2])
    d2t, t2d = draft_vocab(counts, 5)
    # 9 (ids 1, 3), 7 (id 6), then the 5s: ids 0 and 5 win over 8
    expected = [0, 1, 3, 5, 6]
    assert (d2t + torch.arange(5)).tolist() == expected
    assert d2t.dtype == torch.int64
    assert t2d.dtype == torch.bool
    assert torch.nonzero(t2d).flatten().tolist() == expected


@pytest.mark.parametrize("size", [1, 7, DV, V], ids=["size1", "size7", "size24", "full"])
def test_draft_vocab_maps(size: int) -> None:
    counts = random_counts(seed=11) // 50  # plenty of ties
    d2t, t2d = draft_vocab(counts, size)

    ids = torch.arange(size) + d2t  # target_id = draft_id + d2t[draft_id]
    # the `size` most frequent, ties broken by lower id, by a plain Python sort
    expected = sorted(sorted(range(V), key=lambda i: (-int(counts[i]), i))[:size])
    assert ids.tolist() == expected
    assert (ids[1:] > ids[:-1]).all()  # ascending
    assert (d2t >= 0).all()
    assert d2t.shape == (size,)
    assert t2d.shape == (V,)
    assert int(t2d.sum()) == size
    assert torch.equal(torch.nonzero(t2d).flatten(), ids)


def test_set_vocab_round_trip() -> None:
    model = make_drafter()
    assert torch.equal(model.draft_to_target, torch.arange(DV))  # identity before set_vocab
    assert int(model.t2d.sum()) == DV
    d2t, t2d = draft_vocab(random_counts(seed=3), DV)

    model.set_vocab(d2t, t2d)

    assert torch.equal(model.d2t, d2t)
    assert torch.equal(model.t2d, t2d)
    assert torch.equal(model.draft_to_target, torch.nonzero(t2d).flatten())
    assert t2d[model.draft_to_target].all()
    with pytest.raises(ValueError, match="do not fit"):
        model.set_vocab(d2t[:-1], t2d)


def test_draft_vocab_rejects_a_size_above_the_vocab() -> None:
    with pytest.raises(ValueError, match="larger than the target vocab"):
        draft_vocab(random_counts(), V + 1)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        make_config(draft_vocab_size=V + 1)


def test_init_lm_head_starts_from_the_draft_rows(target: LlamaForCausalLM) -> None:
    model = drafter_for(target)
    assert torch.equal(model.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(model.lm_head.weight, target.get_output_embeddings().weight[model.draft_to_target])


# -- default aux layers -----------------------------------------------------------------------------------------


def test_default_aux_layer_ids_follow_vllm() -> None:
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(80) == (2, 40, 77)


@pytest.mark.parametrize(
    "layers",
    [
        *(pytest.param(n, id=f"L{n}") for n in (2, 3, 4, 5, 7, 8)),
        pytest.param(6, id="L6"),
    ],
)
def test_default_aux_layer_ids_for_small_targets(layers: int) -> None:
    ids = default_aux_layer_ids(layers)
    assert len(ids) == 3
    assert len(set(ids)) == 3
    assert all(0 <= i <= layers for i in ids)
    assert list(ids) == sorted(ids)


def test_default_aux_layer_ids_rejects_a_one_layer_target() -> None:
    with pytest.raises(ValueError, match="at least 2 layers"):
        default_aux_layer_ids(1)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="aux_layer_ids"):
        make_config(aux_layer_ids=())
    with pytest.raises(ValueError, match="divisible"):
        make_config(num_key_value_heads=3)
    config = make_config()
    assert replace(config, fc_norm=True).fc_norm
    assert not config.fc_norm
    assert config.head_dim == H // HEADS
