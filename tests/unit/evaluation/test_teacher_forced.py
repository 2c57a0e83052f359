"""The teacher-forced acceptance estimate: on the target's own greedy text it is exact, start by start."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.config import DrafterConfig, OptimConfig, TrainConfig
from pipeline.data.shards import HiddenSample
from pipeline.evaluation.speculative import acceptance_metrics, generate_batch, greedy_generate, request_sampling
from pipeline.evaluation.teacher_forced import estimate_acceptance
from pipeline.models import target_forward
from pipeline.models.drafter import Drafter, fresh_drafter
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
