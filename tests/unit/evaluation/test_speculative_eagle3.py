"""Speculative decoding with an EAGLE-3 drafter is lossless; its proposer drafts the draft head's argmax."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.evaluation.speculative import greedy_generate, speculative_generate
from pipeline.models import target_forward
from pipeline.models.eagle import CommittedPairs
from pipeline.models.eagle3 import (
    Eagle3Proposer,
    TTTCache,
    default_aux_layer_ids,
)
from tests.support.eagle3 import (
    DV,
    V,
    causal,
    drafter_for,
)

# -- lossless speculative decoding ------------------------------------------------------------------------------

MAX_NEW = 10


class RecordingProposer:
    def __init__(self, inner: Eagle3Proposer, proposals: list[torch.Tensor]) -> None:
        self.inner = inner
        self.layer_ids = inner.layer_ids
        self.proposals = proposals

    def propose(self, pairs: CommittedPairs, k: int) -> torch.Tensor:
        proposal = self.inner.propose(pairs, k)
        self.proposals.append(proposal)
        return proposal


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, V, (n,), generator=g) for n in (2, 5, 9)]


@pytest.fixture(scope="module")
def greedy(target: LlamaForCausalLM, prompts: list[torch.Tensor]) -> list[list[int]]:
    return [greedy_generate(target, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("k", [1, 3, 4], ids=["k1", "k3", "k4"])
def test_speculative_decoding_with_eagle3_is_lossless(
    target: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: list[list[int]], k: int
) -> None:
    model = drafter_for(target, seed=1)
    proposer = model.proposer()
    assert isinstance(proposer, Eagle3Proposer)
    assert proposer.layer_ids == list(default_aux_layer_ids(4))
    proposals: list[torch.Tensor] = []
    allowed = set(model.draft_to_target.tolist())
    assert len(allowed) == DV

    for prompt, expected in zip(prompts, greedy, strict=True):
        trace = speculative_generate(target, lambda: RecordingProposer(model.proposer(), proposals), prompt,
                                     MAX_NEW, k)
        assert trace.tokens == expected
        assert all(0 <= a <= k for a in trace.accepted_per_round)

    assert proposals
    for proposal in proposals:
        assert proposal.shape == (1, k)  # a batch of one prompt
        assert proposal.dtype == torch.int64
        assert set(proposal[0].tolist()) <= allowed


def test_proposer_returns_target_ids_of_the_draft_argmax(target: LlamaForCausalLM) -> None:
    model = drafter_for(target, seed=2)
    prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(5))
    out = target_forward.forward(target, prompt[None], list(model.config.aux_layer_ids))
    features = out.layers.flatten(2)[0, :-1]  # (T-1, n_aux * H)

    n = prompt.shape[0] - 1
    pairs = CommittedPairs(features[None], prompt[None, 1:], torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))
    proposal = Eagle3Proposer(model).propose(pairs, 1)[0]

    with torch.no_grad():
        state = model.step(prompt[None, 1:], model.project_aux(features[None]), torch.arange(n)[None], causal(n),
                           TTTCache())
        draft_id = model.lm_head(model.logits_input(state))[0, -1].argmax()
    assert proposal.tolist() == [int(model.draft_to_target[draft_id])]


