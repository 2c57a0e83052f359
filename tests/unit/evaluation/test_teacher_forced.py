"""The teacher-forced acceptance estimate: on the target's own greedy text it is exact, start by start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.config import DrafterConfig, OptimConfig, TrainConfig
from pipeline.data.shard_format import HiddenSample
from pipeline.evaluation.speculative import acceptance_metrics, generate_batch, greedy_generate, request_sampling
from pipeline.evaluation.teacher_forced import estimate_acceptance
from pipeline.models import target_forward
from pipeline.models.drafter import Drafter, fresh_drafter
from pipeline.models.ttt import UnrollPrefix
from pipeline.sampling import SamplingParams
from pipeline.training.dataset import InMemoryDataset
from pipeline.training.loop import train_drafter
from tests.support.targets import tiny_target

V, H, LAYERS, HEADS = 32, 32, 4, 2
K = 3


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    """A larger lm_head makes the greedy text repetitive enough for a briefly trained drafter to predict."""
    model = tiny_target(V, H, LAYERS, HEADS)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def greedy_texts(target: LlamaForCausalLM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (int(n),), generator=g) for n in torch.randint(2, 6, (20,), generator=g)]
    return [torch.cat([p, torch.tensor(greedy_generate(target, p, 16))]) for p in prompts]


@pytest.fixture(scope="module", params=["eagle", "eagle3", "peagle"])
def drafter(request: pytest.FixtureRequest, target: LlamaForCausalLM, greedy_texts: list[torch.Tensor]) -> Drafter:
    kind = request.param
    model = fresh_drafter(DrafterConfig(kind=kind), target, torch.ones(V, dtype=torch.int64), seed=0)
    layer_ids = model.stored_layer_ids(LAYERS)
    samples = []
    for i, text in enumerate(greedy_texts[:14]):  # trains on some texts, is measured on all
        out = target_forward.forward(target, text[None], None if kind == "eagle" else layer_ids)
        hidden = out.features[0][:, None] if kind == "eagle" else out.layers[0]  # (T, stored layers, H), as extracted
        stored = HiddenSample(f"s{i}", 1, text, torch.ones_like(text), hidden)
        samples.append(model.training_sample(stored, LAYERS))
    # P-EAGLE's deeper depths read a mask, not the token before: they take longer to predict anything
    cfg = TrainConfig(epochs=20 if kind == "peagle" else 6, batch_size_per_gpu=4, max_seq_len=64, window_tokens=64,
                      seed=0, ttt_steps=3,
                      optim=OptimConfig(lr=3e-3, lr_warmup_steps=2))
    train_drafter(model, InMemoryDataset(samples), cfg, teacher=model.teacher(target))
    model.attach(target)
    return model.eval()


def test_estimate_on_greedy_text_is_one_decoding_round_per_start(
    target: LlamaForCausalLM, greedy_texts: list[torch.Tensor], drafter: Drafter
) -> None:
    """On text the target itself decoded greedily, step j at start t is accepted exactly when a decoding
    round whose context ends at token t+1 accepts more than j drafts: the estimate's shares are those of
    one real round from every start."""
    prompt_lens = [int(t.shape[0]) - 16 for t in greedy_texts]

    estimate = estimate_acceptance(target, drafter, greedy_texts, prompt_lens, K, batch_size=7)

    # a round from start t: the prompt is the text up to t, so the first generated token is t+1's
    starts = [text[: t + 1] for text, p in zip(greedy_texts, prompt_lens, strict=True)
              for t in range(p - 1, text.shape[0] - K)]
    rounds = [trace.accepted_per_round[0] for trace in generate_batch(target, drafter.proposer, starts, 2, K)]
    exact = acceptance_metrics(rounds, K)
    assert estimate is not None
    assert estimate.positions == len(starts)
    assert estimate.sequences == len(greedy_texts)
    assert estimate.per_position == pytest.approx(exact.per_position)
    assert estimate.tau == pytest.approx(exact.tau)
    assert estimate.per_position[0] > 0.2  # the drafter predicts something: the comparison is not 0 == 0
    assert estimate.per_position == sorted(estimate.per_position, reverse=True)


def test_estimate_needs_a_response_of_k_tokens(
    target: LlamaForCausalLM, greedy_texts: list[torch.Tensor], drafter: Drafter
) -> None:
    text = greedy_texts[0][: 4 + K]
    assert estimate_acceptance(target, drafter, [text], [5], K) is None
    assert estimate_acceptance(target, drafter, [text], [4], K).positions == 1


def test_only_tokens_the_target_would_pick_start_a_round(
    target: LlamaForCausalLM, greedy_texts: list[torch.Tensor], drafter: Drafter
) -> None:
    """Decoding's rounds start from the target's greedy token; a start after any other token is left out."""
    text = greedy_texts[0][: 4 + K].clone()
    text[4] = (text[4] + 1) % V  # token t+1 of the only start is not the target's choice
    assert estimate_acceptance(target, drafter, [text], [4], K) is None


def test_a_step_counts_only_where_it_reads_what_decoding_would_feed_it(
    target: LlamaForCausalLM, greedy_texts: list[torch.Tensor], drafter: Drafter
) -> None:
    """Sampled text: where decoding would feed step 1 the accepted draft (the target's choice), the rollout
    has another token. Step 0 is measured as before; the steps reading that token are not measured at all."""
    prompt_lens = [int(t.shape[0]) - 16 for t in greedy_texts]
    texts = [t[: p + K] for t, p in zip(greedy_texts, prompt_lens, strict=True)]  # one start each, at p - 1
    sampled = [t.clone() for t in texts]
    for t, p in zip(sampled, prompt_lens, strict=True):
        t[p + 1] = (t[p + 1] + 1) % V  # token t+2, what step 1 reads
    clean = estimate_acceptance(target, drafter, texts, prompt_lens, K)
    estimate = estimate_acceptance(target, drafter, sampled, prompt_lens, K)
    assert estimate.positions == clean.positions == len(texts)
    assert estimate.per_position[0] == clean.per_position[0] > 0
    assert clean.per_position[1] > 0
    assert estimate.per_position[1:] == [0.0] * (K - 1)


def test_on_rollouts_sampled_at_their_temperature_a_step_is_kept_where_it_draws_the_rollouts_token(
    target: LlamaForCausalLM, drafter: Drafter
) -> None:
    """Speculative sampling emits what sampling the target does, and with greedy drafting a draft is kept exactly when
    the emitted token is the draft: so on rollouts sampled at T=0.3 the estimate (drafts matched against the rollout's
    own tokens, every start) and real rounds of vLLM's rule from the same starts agree in expectation, position by
    position (1,600 starts each: the two sides' sampling noise is about 0.015; measured 0.004-0.014 apart)."""
    params = SamplingParams(temperature=0.3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (int(n),), generator=g) for n in torch.randint(2, 6, (20,), generator=g)] * 8
    texts = [torch.cat([p, torch.tensor(t.tokens)]) for p, t in zip(prompts, generate_batch(
        target, drafter.proposer, prompts, 12, K, sampling=request_sampling(params, range(len(prompts)), "cpu")),
        strict=True)]
    prompt_lens = [len(p) for p in prompts]
    estimate = estimate_acceptance(target, drafter, texts, prompt_lens, K, sampled=True)

    # a round from start t: the prompt is the text up to t; its first token is sampled as the rollout's t+1 was
    starts = [text[: t + 1] for text, p in zip(texts, prompt_lens, strict=True) for t in range(p - 1, len(text) - K)]
    rounds = generate_batch(target, drafter.proposer, starts, 2, K,
                            sampling=request_sampling(params, range(10_000, 10_000 + len(starts)), "cpu"))
    exact = acceptance_metrics([trace.accepted_per_round[0] for trace in rounds], K)
    assert estimate.positions == len(starts)
    assert estimate.per_position[0] > 0.15
    assert estimate.per_position == pytest.approx(exact.per_position, abs=0.05)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_a_pass_in_chunks_counts_what_the_whole_pass_counts(
    target: LlamaForCausalLM, drafter: Drafter, greedy_texts: list[torch.Tensor], chunk: int
) -> None:
    """The target over its cache and the drafter after the earlier chunks' keys, `chunk` columns at a time: the
    drafts at every position are the whole unroll's, so the estimate is too, greedy and sampled, over rows of
    different lengths (some ending inside a chunk, some padded through whole chunks)."""
    g = torch.Generator().manual_seed(5)
    sampled_texts = [torch.randint(0, V, (int(n),), generator=g) for n in (9, 23, 40, 4)]
    for texts, sampled in ((greedy_texts, False), (sampled_texts, True)):
        prompts = [3] * len(texts)
        whole = estimate_acceptance(target, drafter, texts, prompts, K, batch_size=8, sampled=sampled,
                                    chunk_tokens=None)
        chunked = estimate_acceptance(target, drafter, texts, prompts, K, batch_size=8, sampled=sampled,
                                      chunk_tokens=chunk)
        assert (chunked.positions, chunked.sequences) == (whole.positions, whole.sequences)
        assert chunked.tau == pytest.approx(whole.tau, abs=1e-12)
        assert chunked.per_position == pytest.approx(whole.per_position, abs=1e-12)
    # the drafts themselves, position by position, against one unroll over the whole sequence
    ids = sampled_texts[2][None]  # (1, 40)
    out = target_forward.forward(target, ids, drafter.decode_layer_ids)
    features = (out.features if drafter.decode_layer_ids is None else out.layers.flatten(2))[:, :-1]  # (1, n, D)
    n = features.shape[1]
    step_ids = [torch.nn.functional.pad(ids[:, 1 + j :], (0, j))[:, :n] for j in range(K)]
    positions = torch.arange(n)[None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]  # (1, 1, n, n)
    with torch.no_grad():
        reference = drafter.draft_unrolled(features, step_ids, positions, causal)  # (K, 1, n)
        prefix = UnrollPrefix()
        pieces = [drafter.draft_unrolled(features[:, s : s + chunk], [x[:, s : s + chunk] for x in step_ids],
                                         positions[:, s : s + chunk], causal[:, :, s : s + chunk, : s + chunk],
                                         prefix) for s in range(0, n, chunk)]
    assert torch.equal(torch.cat(pieces, dim=2), reference)


def _peak(length: int, chunk: int | None) -> dict:
    """The estimate's peak memory over 8 rollouts of `length` tokens, in a process of its own (its peak RSS: torch's
    CPU allocations are not tracemalloc's); a 4,096-token vocabulary, hidden 64, EAGLE-3."""
    argv = [sys.executable, "-m", "benchmarks.evaluation", "--estimate-peak", str(length), str(chunk or 0), "64",
            "4096"]
    out = subprocess.run(argv, cwd=Path(__file__).resolve().parents[3], check=True, capture_output=True, text=True,
                         timeout=600)
    return json.loads(out.stdout)


@pytest.mark.reliability("fault", "acceptance estimate over rollouts 4x longer (1,024 tokens): peak memory bounded "
                         "by eval.estimate_chunk_tokens, below one pass's (batch, tokens, vocab) logits")
def test_the_estimates_memory_is_bounded_by_its_chunk_not_the_rollouts_length() -> None:
    """What grows with the rollout is the caches (a few H per token); the chunk's logits, layers and attention
    scores do not, so the 768 tokens more cost well under half of what their logits alone would, and the peak stays
    below the whole pass's logits."""
    short, long = _peak(256, 64), _peak(1024, 64)
    growth = long["peak_growth_mb"] - short["peak_growth_mb"]
    assert growth < 0.5 * (long["logits_mb"] - short["logits_mb"]), (short, long)
    assert long["peak_growth_mb"] < long["logits_mb"], long
