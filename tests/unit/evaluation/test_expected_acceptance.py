"""Expected acceptance under vLLM's rule for greedy drafts: the one-forward tree equals a forward per
context, and a drafter's chained proposals equal what its proposer drafts while decoding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.evaluation.expected_acceptance import (
    chain_probabilities,
    drafter_chain,
    eagle3_sampled_chain,
    round_starts,
    target_argmax_chain,
    target_prefix,
)
from pipeline.models import target_forward
from pipeline.models.eagle import CommittedPairs
from pipeline.models.eagle3 import TTTCache
from tests.support.eagle3 import V, drafter_for

K = 4


@pytest.fixture(scope="module")
def sequence() -> torch.Tensor:
    return torch.randint(0, V, (14,), generator=torch.Generator().manual_seed(3))


def _probability(target: LlamaForCausalLM, context: torch.Tensor, token: int, temperature: float) -> float:
    logits = target(context[None]).logits[0, -1] / temperature
    return float(torch.softmax(logits.double(), -1)[token])


@torch.no_grad()
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tree_forward_equals_a_forward_per_context(target, sequence, temperature) -> None:
    starts = torch.tensor([1, 6, 13])
    drafts = torch.randint(0, V, (3, K), generator=torch.Generator().manual_seed(4))
    chain = chain_probabilities(target, sequence, starts, drafts, temperature)
    for i, s in enumerate(starts.tolist()):
        for j in range(K):
            context = torch.cat([sequence[:s], drafts[i, :j]])
            assert chain.accept[i, j].item() == pytest.approx(
                _probability(target, context, int(drafts[i, j]), temperature), rel=1e-4, abs=1e-7)
    cumulative = torch.cumprod(chain.accept, 1)
    assert torch.allclose(chain.tau(), 1 + cumulative.sum(1))
    assert torch.allclose(chain.per_position(), cumulative.mean(0))


@torch.no_grad()
def test_oracle_proposes_the_target_argmax_chain(target, sequence) -> None:
    starts = torch.tensor([4, 9])
    oracle = target_argmax_chain(target, sequence, starts, K, 1.0)
    for i, s in enumerate(starts.tolist()):
        context = sequence[:s]
        for j in range(K):
            logits = target(context[None]).logits[0, -1]
            assert int(oracle.drafts[i, j]) == int(logits.argmax())
            assert oracle.accept[i, j].item() == pytest.approx(float(torch.softmax(logits, -1).max()), rel=1e-4)
            context = torch.cat([context, logits.argmax()[None]])
    # No greedy drafter accepts more at the first position than the target's own argmax.
    other = chain_probabilities(target, sequence, starts, (oracle.drafts + 1) % V, 1.0)
    assert (other.accept[:, 0] <= oracle.accept[:, 0]).all()


@torch.no_grad()
def test_drafter_chain_drafts_what_its_proposer_drafts(target, sequence) -> None:
    drafter = drafter_for(target, seed=2)
    starts = round_starts(prompt_len=5, length=sequence.shape[0])
    assert starts.tolist() == list(range(6, 14))
    chain = drafter_chain(target, drafter, sequence, starts, K, 1.0)
    layer_ids = drafter.decode_layer_ids
    for i, s in enumerate(starts.tolist()):
        # Decoding with context x_0 .. x_{s-1}: the target has run over it, the pairs (f_t, x_{t+1}), t < s - 1,
        # enter the proposer at once.
        out = target_forward.forward(target, sequence[None, :s], layer_ids)
        n = s - 1
        pairs = CommittedPairs(features=out.layers.flatten(2)[:, :n], next_tokens=sequence[None, 1:s],
                               positions=torch.arange(n)[None], valid=torch.ones(1, n, dtype=torch.bool))
        proposal = drafter.proposer().propose(pairs, K)  # (1, K)
        assert chain.drafts[i].tolist() == proposal[0].tolist()
    expected = chain_probabilities(target, sequence, starts, chain.drafts, 1.0)
    assert torch.equal(chain.accept, expected.accept)
    prefix = target_prefix(target, sequence, layer_ids)  # kept and reused: each use crops its drafts off again
    for _ in range(2):
        again = drafter_chain(target, drafter, sequence, starts, K, 1.0, prefix=prefix)
        assert torch.equal(again.drafts, chain.drafts)
        assert torch.allclose(again.accept, chain.accept, atol=1e-6)


@torch.no_grad()
def test_probabilistic_drafting_estimates_the_overlap_of_the_two_distributions(target, sequence) -> None:
    """vLLM's probabilistic drafting accepts a sampled draft d with min(1, p(d) / q(d)); over the drafter's own
    samples the first position's acceptance averages to sum_d min(p(d), q(d)), computed here exactly."""
    drafter = drafter_for(target, seed=2)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(4.0)  # a peaked q, far from a random target's p
    starts = torch.tensor([7])
    temperature = 0.8
    layer_ids = drafter.decode_layer_ids
    prefix = target_prefix(target, sequence, layer_ids)
    out = target_forward.forward(target, sequence[None], layer_ids)
    features = out.layers.flatten(2)[:, :-1]
    # q at the start's pair: the drafter's first step over the sequence, read at t = start - 2
    state = drafter.step(sequence[1:][None], drafter.project_aux(features), torch.arange(13)[None],
                         torch.ones(13, 13, dtype=torch.bool).tril()[None, None], TTTCache())
    q_draft = torch.softmax(drafter.lm_head(drafter.logits_input(state))[0, 5].double() / temperature, -1)
    q = torch.zeros(V, dtype=torch.float64).index_add_(0, drafter.draft_to_target, q_draft)
    p = torch.softmax(out.logits[0, 6].double() / temperature, -1)
    exact = float(torch.minimum(p, q).sum())
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([eagle3_sampled_chain(target, drafter, sequence, starts, 2, temperature, generator,
                                              prefix=prefix).accept[0] for _ in range(400)])  # (400, 2)
    assert draws[:, 0].mean().item() == pytest.approx(exact, abs=4 * draws[:, 0].std().item() / 20)
    assert (draws <= 1).all()
    assert exact < 0.9  # far from a drafter that would always be accepted
