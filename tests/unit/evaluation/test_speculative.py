"""Chain speculative decoding with greedy verification and its acceptance metrics."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.evaluation.speculative import (
    EagleProposer,
    acceptance_metrics,
    evaluate,
    greedy_generate,
    speculative_generate,
)
from pipeline.models import target as target_lib
from pipeline.models.eagle import EagleConfig, EagleDrafter

V, H, LAYERS, HEADS = 32, 32, 1, 2
MAX_NEW = 10
K_MAX = 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return target_lib.build_target(target_lib.tiny_llama_config(V, H, LAYERS, HEADS), seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, V, (n,), generator=g) for n in (2, 5, 9)]


@pytest.fixture(scope="module")
def greedy(model: LlamaForCausalLM, prompts: list[torch.Tensor]) -> GreedyOracle:
    return GreedyOracle(model, prompts)


class GreedyOracle:
    """The target's greedy continuation of a sequence; precomputed for the test prompts (one target forward
    per token is the slow part of these tests), computed with greedy_generate for anything else."""

    def __init__(self, model: LlamaForCausalLM, prompts: list[torch.Tensor]) -> None:
        self.model = model
        self.references = [torch.cat([p, torch.tensor(greedy_generate(model, p, MAX_NEW + K_MAX))]) for p in prompts]

    def continuation(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        n = tokens.shape[0]
        for ref in self.references:
            if ref.shape[0] >= n + k and torch.equal(ref[:n], tokens):
                return ref[n : n + k].clone()
        return torch.tensor(greedy_generate(self.model, tokens, k))

    def generate(self, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
        return self.continuation(prompt, max_new_tokens).tolist()


class OracleProposer:
    """Proposes exactly what the target would generate greedily."""

    layer_ids = None  # reads the post-norm last layer, like an EAGLE-1/2 drafter

    def __init__(self, greedy: GreedyOracle) -> None:
        self.greedy = greedy

    def propose(self, tokens: torch.Tensor, features: torch.Tensor, k: int) -> torch.Tensor:
        return self.greedy.continuation(tokens, k)


class WrongProposer:
    """Always proposes a token the target does not pick next."""

    layer_ids = None  # reads the post-norm last layer, like an EAGLE-1/2 drafter

    def __init__(self, greedy: GreedyOracle) -> None:
        self.greedy = greedy

    def propose(self, tokens: torch.Tensor, features: torch.Tensor, k: int) -> torch.Tensor:
        return (self.greedy.continuation(tokens, k) + 1) % V


class RecordingProposer:
    """Records what speculative_generate hands a proposer; always proposes token 0."""

    layer_ids = None  # reads the post-norm last layer, like an EAGLE-1/2 drafter

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def propose(self, tokens: torch.Tensor, features: torch.Tensor, k: int) -> torch.Tensor:
        self.calls.append((tokens.clone(), features.clone()))
        return torch.zeros(k, dtype=torch.int64)


def eagle_proposer(greedy: GreedyOracle) -> EagleProposer:
    torch.manual_seed(5)
    drafter = EagleDrafter(EagleConfig.from_target(greedy.model.config))
    drafter.use_target_heads(greedy.model)
    return EagleProposer(drafter)


PROPOSERS = {"oracle": OracleProposer, "wrong": WrongProposer, "eagle": eagle_proposer}


@pytest.mark.parametrize("k", [1, 3, 4], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_output_is_exactly_greedy(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle, kind: str, k: int
) -> None:
    proposer = PROPOSERS[kind](greedy)
    for prompt in prompts:
        trace = speculative_generate(model, proposer, prompt, MAX_NEW, k)

        assert trace.tokens == greedy.generate(prompt, MAX_NEW)  # greedy_generate's tokens, precomputed
        assert len(trace.tokens) == MAX_NEW
        assert all(0 <= a <= k for a in trace.accepted_per_round)
        # every round commits accepted + 1 tokens, after the prefill's one
        assert 1 + sum(a + 1 for a in trace.accepted_per_round) >= MAX_NEW


@pytest.mark.parametrize("k", [1, 3, 4], ids=lambda k: f"k{k}")
def test_oracle_accepts_every_proposal(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle, k: int
) -> None:
    proposer = OracleProposer(greedy)
    for prompt in prompts:
        trace = speculative_generate(model, proposer, prompt, MAX_NEW, k)
        metrics = acceptance_metrics(trace.accepted_per_round, k)

        assert trace.accepted_per_round == [k] * math.ceil((MAX_NEW - 1) / (k + 1))
        assert metrics.tau == k + 1
        assert metrics.acceptance_rate == 1.0
        assert metrics.per_position == [1.0] * k


@pytest.mark.parametrize("k", [1, 3, 4], ids=lambda k: f"k{k}")
def test_wrong_proposer_accepts_nothing(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle, k: int
) -> None:
    proposer = WrongProposer(greedy)
    for prompt in prompts:
        trace = speculative_generate(model, proposer, prompt, MAX_NEW, k)
        metrics = acceptance_metrics(trace.accepted_per_round, k)

        assert trace.accepted_per_round == [0] * (MAX_NEW - 1)
        assert metrics.tau == 1.0
        assert metrics.acceptance_rate == 0.0
        assert metrics.per_position == [0.0] * k


def test_proposer_gets_tokens_and_features_of_all_but_the_newest(
    model: LlamaForCausalLM, prompts: list[torch.Tensor]
) -> None:
    proposer = RecordingProposer()
    speculative_generate(model, proposer, prompts[1], MAX_NEW, 3)

    assert proposer.calls
    for tokens, features in proposer.calls:
        assert features.shape == (tokens.shape[0] - 1, H)
        expected = target_lib.forward(model, tokens[None]).features[0, :-1]
        torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)


def test_evaluate_aggregates_rounds_over_prompts(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle
) -> None:
    k = 3
    oracle = evaluate(model, OracleProposer(greedy), prompts, MAX_NEW, k)
    wrong = evaluate(model, WrongProposer(greedy), prompts, MAX_NEW, k)

    assert oracle.tau == k + 1
    assert oracle.rounds == len(prompts) * math.ceil((MAX_NEW - 1) / (k + 1))
    assert wrong.tau == 1.0
    assert wrong.rounds == len(prompts) * (MAX_NEW - 1)
    assert wrong.drafted == wrong.rounds * k


def test_greedy_generate_matches_argmax_of_the_model(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle
) -> None:
    prompt = prompts[2]
    tokens = greedy_generate(model, prompt, 4)
    assert tokens == greedy.generate(prompt, 4)  # a shorter run is a prefix of a longer one
    full = torch.cat([prompt, torch.tensor(tokens)])
    logits = model(full[None]).logits[0]
    assert tokens == logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()


# -- acceptance_metrics -----------------------------------------------------------------------------------------


def test_acceptance_metrics_hand_made() -> None:
    m = acceptance_metrics([4, 0, 2], k=4)

    assert m.tau == pytest.approx(1 + 6 / 3)
    assert m.tau == pytest.approx(3.0)
    assert m.acceptance_rate == pytest.approx(6 / 12)
    assert m.per_position == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert (m.rounds, m.drafted, m.accepted) == (3, 12, 6)
    assert m.as_dict() == {
        "tau": m.tau, "acceptance_rate": m.acceptance_rate, "per_position": m.per_position,
        "rounds": 3, "drafted": 12, "accepted": 6,
    }


def test_acceptance_metrics_needs_rounds() -> None:
    with pytest.raises(ValueError, match="no speculative rounds"):
        acceptance_metrics([], k=4)
