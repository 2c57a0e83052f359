"""Chain speculative decoding with greedy verification and its acceptance metrics."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.config import DrafterConfig
from pipeline.evaluation import speculative
from pipeline.evaluation.rejection_sampler import BatchSampling, RequestSampling
from pipeline.evaluation.speculative import (
    DecodingBatch,
    Request,
    RoundTimes,
    Sequence,
    acceptance_metrics,
    evaluate,
    follow_target,
    generate_batch,
    greedy_generate,
    speculative_generate,
)
from pipeline.models import target_forward
from pipeline.models.drafter import CommittedPairs, Drafter, Proposer, fresh_drafter
from pipeline.models.eagle import EagleConfig, EagleDrafter
from pipeline.models.eagle3 import TTTCache
from pipeline.sampling import DRAFT_SAMPLE_METHODS, GREEDY, SamplingParams
from tests.support.families import VARIANTS, random_model
from tests.support.targets import tiny_target

V, H, LAYERS, HEADS = 32, 32, 1, 2
MAX_NEW = 10
K_MAX = 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_target(V, H, LAYERS, HEADS)


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


class History:
    """Each row's sequence as a proposer sees it: the prompt's first token, then every committed pair."""

    def __init__(self, prompts: list[torch.Tensor]) -> None:
        self.tokens = [p[:1].clone() for p in prompts]  # row b: x_0, x_1, ... (T,)
        self.features: list[torch.Tensor | None] = [None] * len(prompts)  # row b: f_0 ... f_{T-2} (T-1, D)
        self.requests = list(range(len(prompts)))  # row b serves prompt requests[b]

    def select(self, rows: torch.Tensor) -> None:
        """Finished requests leave the batch."""
        rows = rows.tolist()
        self.tokens, self.features = [self.tokens[b] for b in rows], [self.features[b] for b in rows]
        self.requests = [self.requests[b] for b in rows]

    def add(self, pairs: CommittedPairs) -> None:
        for b in range(pairs.valid.shape[0]):
            valid = pairs.valid[b]
            feats = pairs.features[b, valid]
            self.tokens[b] = torch.cat([self.tokens[b], pairs.next_tokens[b, valid]])
            self.features[b] = feats if self.features[b] is None else torch.cat([self.features[b], feats])


class OracleProposer:
    """Proposes exactly what the target would generate greedily."""

    layer_ids = None  # reads the post-norm last layer, like an EAGLE-1/2 drafter

    def __init__(self, greedy: GreedyOracle, prompts: list[torch.Tensor]) -> None:
        self.greedy, self.history = greedy, History(prompts)

    def propose(self, pairs: CommittedPairs, k: int) -> torch.Tensor:
        self.history.add(pairs)
        return torch.stack([self.greedy.continuation(tokens, k) for tokens in self.history.tokens])

    def select(self, rows: torch.Tensor) -> None:
        self.history.select(rows)


class WrongProposer(OracleProposer):
    """Always proposes a token the target does not pick next."""

    def propose(self, pairs: CommittedPairs, k: int) -> torch.Tensor:
        return (super().propose(pairs, k) + 1) % V


class PartlyRightProposer(OracleProposer):
    """Right up to a place that moves with the round and the row: rows accept different numbers of
    drafts, so every row's cache holds columns the others rejected."""

    def __init__(self, greedy: GreedyOracle, prompts: list[torch.Tensor]) -> None:
        super().__init__(greedy, prompts)
        self.round = 0

    def propose(self, pairs: CommittedPairs, k: int) -> torch.Tensor:
        proposal = super().propose(pairs, k)
        for b in range(proposal.shape[0]):
            j = (self.round + b) % (k + 1)
            if j < k:
                proposal[b, j] = (proposal[b, j] + 1) % self.greedy.model.config.vocab_size
        self.round += 1
        return proposal


class RecordingProposer:
    """Records each row's sequence and features as a proposer sees them; always proposes token 0."""

    layer_ids = None  # reads the post-norm last layer, like an EAGLE-1/2 drafter

    def __init__(self, prompts: list[torch.Tensor]) -> None:
        self.history = History(prompts)
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def propose(self, pairs: CommittedPairs, k: int) -> torch.Tensor:
        self.history.add(pairs)
        self.calls.append([(r, t.clone(), f.clone()) for r, t, f in zip(
            self.history.requests, self.history.tokens, self.history.features, strict=True)])
        return torch.zeros(pairs.valid.shape[0], k, dtype=torch.int64)

    def select(self, rows: torch.Tensor) -> None:
        self.history.select(rows)


def eagle_drafter(model: LlamaForCausalLM) -> EagleDrafter:
    torch.manual_seed(5)
    drafter = EagleDrafter(EagleConfig.from_target(model.config))
    drafter.attach(model)
    return drafter


def proposer_factory(kind: str, greedy: GreedyOracle, prompts: list[torch.Tensor]) -> Callable[[], Proposer]:
    if kind == "eagle":
        return eagle_drafter(greedy.model).proposer
    return lambda: PROPOSERS[kind](greedy, prompts)


PROPOSERS = {"oracle": OracleProposer, "wrong": WrongProposer, "eagle": None}


@pytest.mark.parametrize("family", VARIANTS)
def test_batched_output_is_greedy_for_every_family(family: str) -> None:
    """Prompts of different lengths (padding) and rows accepting differently (rejected columns kept):
    positions and cache columns part, which sliding-window layers (Mistral's, Qwen2's) must not see."""
    model = random_model(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (3, 7, 12)]
    greedy = GreedyOracle(model, prompts)
    traces = generate_batch(model, lambda: PartlyRightProposer(greedy, prompts), prompts, MAX_NEW, 3)
    assert [t.tokens for t in traces] == [greedy.generate(p, MAX_NEW) for p in prompts]
    assert len({tuple(t.accepted_per_round) for t in traces}) == len(prompts)


@pytest.mark.parametrize("k", [1, 3, 4], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_output_is_exactly_greedy(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle, kind: str, k: int
) -> None:
    for prompt in prompts:
        trace = speculative_generate(model, proposer_factory(kind, greedy, [prompt]), prompt, MAX_NEW, k)

        assert trace.tokens == greedy.generate(prompt, MAX_NEW)  # greedy_generate's tokens, precomputed
        assert len(trace.tokens) == MAX_NEW
        assert all(0 <= a <= k for a in trace.accepted_per_round)
        # every round commits accepted + 1 tokens, after the prefill's one
        assert 1 + sum(a + 1 for a in trace.accepted_per_round) >= MAX_NEW


@pytest.mark.parametrize("k", [1, 3, 4], ids=lambda k: f"k{k}")
def test_oracle_accepts_every_proposal(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle, k: int
) -> None:
    for prompt in prompts:
        trace = speculative_generate(model, lambda p=prompt: OracleProposer(greedy, [p]), prompt, MAX_NEW, k)
        metrics = acceptance_metrics(trace.accepted_per_round, k)

        assert trace.accepted_per_round == [k] * math.ceil((MAX_NEW - 1) / (k + 1))
        assert metrics.tau == k + 1
        assert metrics.acceptance_rate == 1.0
        assert metrics.per_position == [1.0] * k


@pytest.mark.parametrize("k", [1, 3, 4], ids=lambda k: f"k{k}")
def test_wrong_proposer_accepts_nothing(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle, k: int
) -> None:
    for prompt in prompts:
        trace = speculative_generate(model, lambda p=prompt: WrongProposer(greedy, [p]), prompt, MAX_NEW, k)
        metrics = acceptance_metrics(trace.accepted_per_round, k)

        assert trace.accepted_per_round == [0] * (MAX_NEW - 1)
        assert metrics.tau == 1.0
        assert metrics.acceptance_rate == 0.0
        assert metrics.per_position == [0.0] * k


def test_proposer_gets_tokens_and_features_of_all_but_the_newest(
    model: LlamaForCausalLM, prompts: list[torch.Tensor]
) -> None:
    proposer = RecordingProposer(prompts)
    generate_batch(model, lambda: proposer, prompts, MAX_NEW, 3)

    assert proposer.calls
    for call in proposer.calls:
        for request, tokens, features in call:
            prompt = prompts[request]
            assert torch.equal(tokens[: prompt.shape[0]], prompt)
            assert features.shape == (tokens.shape[0] - 1, H)
            expected = target_forward.forward(model, tokens[None]).features[0, :-1]
            torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)


def test_evaluate_aggregates_rounds_over_prompts(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle
) -> None:
    k = 3
    oracle = evaluate(model, lambda: OracleProposer(greedy, prompts), prompts, MAX_NEW, k)
    wrong = evaluate(model, lambda: WrongProposer(greedy, prompts), prompts, MAX_NEW, k)

    assert oracle.tau == k + 1
    assert oracle.rounds == len(prompts) * math.ceil((MAX_NEW - 1) / (k + 1))
    assert wrong.tau == 1.0
    assert wrong.rounds == len(prompts) * (MAX_NEW - 1)
    assert wrong.drafted == wrong.rounds * k
    assert oracle.drafter_forwards_per_round is None  # an oracle is no drafter: nothing counted


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
        "rounds": 3, "drafted": 12, "accepted": 6, "drafter_forwards_per_round": None,
    }


def test_acceptance_metrics_needs_rounds() -> None:
    with pytest.raises(ValueError, match="no speculative rounds"):
        acceptance_metrics([], k=4)


# -- batched, cached decoding with both drafter kinds --------------------------------------------------------------

KINDS = ["eagle", "eagle3"]


@pytest.fixture(scope="module")
def deep_model() -> LlamaForCausalLM:
    """Four layers: EAGLE-3 reads three of them."""
    return tiny_target(V, H, 4, HEADS, seed=3)


@pytest.fixture(scope="module")
def ragged_prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return [torch.randint(0, V, (n,), generator=g) for n in (1, 4, 9, 13)]


@pytest.fixture(scope="module")
def deep_greedy(deep_model: LlamaForCausalLM, ragged_prompts: list[torch.Tensor]) -> GreedyOracle:
    return GreedyOracle(deep_model, ragged_prompts)


def drafter_of(kind: str, model: LlamaForCausalLM) -> Drafter:
    drafter = fresh_drafter(DrafterConfig(kind=kind), model, torch.arange(V), seed=4)
    drafter.attach(model)
    return drafter


def reference_proposal(drafter: Drafter, tokens: torch.Tensor, features: torch.Tensor, k: int) -> list[int]:
    """The drafter's k tokens computed without any cache: every step re-runs the whole prefix
    (EAGLE-1/2), or step 0 over the prefix and the TTT steps at its last position (EAGLE-3)."""
    n = tokens.shape[0] - 1
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]  # (1, 1, n, n)
    positions = torch.arange(n)[None]  # (1, n)
    proposal = []
    with torch.no_grad():
        if isinstance(drafter, EagleDrafter):  # the reference is per kind on purpose
            feats, ids = features, tokens[1:]
            for _ in range(k):
                m = ids.shape[0]
                mask = torch.ones(m, m, dtype=torch.bool).tril()[None, None]
                predicted = drafter(feats[None], ids[None], torch.arange(m)[None], mask)[0, -1]  # (H,)
                token = drafter.lm_head(predicted).argmax()
                proposal.append(int(token))
                feats, ids = torch.cat([feats, predicted[None]]), torch.cat([ids, token[None]])
            return proposal
        cache = TTTCache()
        state = drafter.step(tokens[None, 1:], drafter.project_aux(features[None]), positions, causal, cache)[:, -1:]
        for j in range(k):
            token = drafter.draft_to_target[drafter.lm_head(drafter.logits_input(state)).argmax(-1)]  # (1, 1)
            proposal.append(int(token))
            if j + 1 < k:
                state = drafter.step(token, state, positions[:, -1:], torch.ones(1, 1, 1, n, dtype=torch.bool), cache)
    return proposal


class ShadowProposer:
    """Checks the drafter's cached proposals against `reference_proposal` at every round, while it
    proposes the target's greedy tokens with one of them spoilt in turn, so that rows accept
    0..k tokens in changing patterns (the cache must withdraw exactly the rejected columns)."""

    def __init__(self, drafter: Drafter, greedy: GreedyOracle, prompts: list[torch.Tensor]) -> None:
        self.drafter, self.inner, self.greedy = drafter, drafter.proposer(), greedy
        self.layer_ids = self.inner.layer_ids
        self.history = History(prompts)
        self.rounds = 0
        self.checked = 0

    def propose(self, pairs: CommittedPairs, k: int) -> torch.Tensor:
        self.history.add(pairs)
        drafted = self.inner.propose(pairs, k)
        out = []
        for b, (tokens, features) in enumerate(zip(self.history.tokens, self.history.features, strict=True)):
            if pairs.valid[b].any():  # a row with no new pair (one just joined) drafts from nothing: discarded
                assert drafted[b].tolist() == reference_proposal(self.drafter, tokens, features, k), (b, self.rounds)
                self.checked += 1
            proposal = self.greedy.continuation(tokens, k)
            spoilt = (self.rounds + b) % (k + 1)
            if spoilt < k:
                proposal[spoilt] = (proposal[spoilt] + 1) % V
            out.append(proposal)
        self.rounds += 1
        return torch.stack(out)

    def select(self, rows: torch.Tensor) -> None:
        self.inner.select(rows)
        self.history.select(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_proposals_equal_the_uncached_reference(
    deep_model: LlamaForCausalLM, ragged_prompts: list[torch.Tensor], deep_greedy: GreedyOracle, kind: str
) -> None:
    k = 3
    shadow = ShadowProposer(drafter_of(kind, deep_model), deep_greedy, ragged_prompts)

    traces = generate_batch(deep_model, lambda: shadow, ragged_prompts, MAX_NEW, k)

    assert shadow.checked >= len(ragged_prompts) * 3
    assert {a for t in traces for a in t.accepted_per_round} == set(range(k + 1))  # every acceptance count occurs
    for trace, prompt in zip(traces, ragged_prompts, strict=True):
        assert trace.tokens == deep_greedy.generate(prompt, MAX_NEW)


@pytest.mark.parametrize("k", [1, 4], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("kind", KINDS)
def test_batched_output_is_the_targets_greedy_generate(
    deep_model: LlamaForCausalLM, ragged_prompts: list[torch.Tensor], kind: str, k: int
) -> None:
    """Prompts of different lengths in one batch, each row accepting its own count: every row's tokens are
    transformers' own greedy `generate`'s (its KV-cached decoding, independent of ours)."""
    drafter = drafter_of(kind, deep_model)

    traces = generate_batch(deep_model, follow_target(drafter, deep_model), ragged_prompts, MAX_NEW, k)

    for trace, prompt in zip(traces, ragged_prompts, strict=True):
        expected = deep_model.generate(prompt[None], attention_mask=torch.ones(1, prompt.shape[0], dtype=torch.int64),
                                       max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
        assert trace.tokens == expected[0, prompt.shape[0] :].tolist()
        assert all(0 <= a <= k for a in trace.accepted_per_round)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_rounds_are_the_one_at_a_time_rounds(
    deep_model: LlamaForCausalLM, ragged_prompts: list[torch.Tensor], kind: str
) -> None:
    drafter = drafter_of(kind, deep_model)

    batched = generate_batch(deep_model, drafter.proposer, ragged_prompts, MAX_NEW, 3)
    alone = [speculative_generate(deep_model, drafter.proposer, p, MAX_NEW, 3) for p in ragged_prompts]

    assert [t.accepted_per_round for t in batched] == [t.accepted_per_round for t in alone]
    assert [t.tokens for t in batched] == [t.tokens for t in alone]
    metrics = evaluate(deep_model, drafter.proposer, ragged_prompts, MAX_NEW, 3, batch_size=3)
    assert metrics.rounds == sum(len(t.accepted_per_round) for t in alone)


def test_generate_batch_refuses_an_empty_prompt(model: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(model, lambda: OracleProposer(None, []), [torch.tensor([], dtype=torch.int64)], 4, 2)


def test_round_times_measure_the_decoding_cost(model: LlamaForCausalLM, prompts: list[torch.Tensor]) -> None:
    """Every round is timed once for the target and once for the drafter: t and c come out of them, and the
    decoded tokens are those of an untimed run."""
    new_proposer = follow_target(eagle_drafter(model), model)
    plain = generate_batch(model, new_proposer, prompts, 12, 3)
    times = RoundTimes()
    timed = generate_batch(model, new_proposer, prompts, 12, 3, times)
    assert [t.tokens for t in timed] == [t.tokens for t in plain]
    assert times.rounds == max(len(t.accepted_per_round) for t in timed)
    assert times.row_rounds == len(prompts) * times.rounds
    cost = times.decoding_cost(drafter_forwards_per_round=3)
    assert cost.target_s_per_token == pytest.approx(times.target_s / times.row_rounds)
    assert cost.draft_cost_ratio == pytest.approx(times.draft_s / (3 * times.target_s))
    assert RoundTimes().decoding_cost(3) is None


# -- continuous batching: requests join and leave between rounds -------------------------------------------------


class JoiningShadow(ShadowProposer):
    """A ShadowProposer over a batch that requests join between rounds, their prompts in admission order; the
    drafter's cached proposals are checked against the uncached reference for every row that has pairs."""

    def __init__(self, drafter: Drafter, greedy: GreedyOracle, first: list[torch.Tensor],
                 joining: list[torch.Tensor]) -> None:
        super().__init__(drafter, greedy, first)
        self.joining = list(joining)
        self.history.requests = list(range(len(first)))

    def add_rows(self, n: int) -> None:
        self.inner.add_rows(n)
        for _ in range(n):
            self.history.tokens.append(self.joining.pop(0)[:1].clone())
            self.history.features.append(None)
            self.history.requests.append(len(self.history.requests))


def _greedy_request(prompt: torch.Tensor, max_tokens: int) -> Sequence:
    return Sequence(Request(prompt, max_tokens, BatchSampling.greedy(1).rows[0]))


@pytest.mark.parametrize("kind", KINDS)
def test_requests_joining_and_leaving_between_rounds_get_their_greedy_tokens(
    deep_model: LlamaForCausalLM, ragged_prompts: list[torch.Tensor], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows join a running batch (caches merged), leave it when done (caches selected), and rounds alternate
    between speculative and plain ones, with a run of plain rounds long enough that the drafter takes its pairs
    in between proposals: every request's tokens are its greedy decoding, and the drafter's cached proposals are
    the uncached reference's at every round."""
    monkeypatch.setattr(speculative, "PENDING_PAIRS_LIMIT", 3)
    k = 3
    g = torch.Generator().manual_seed(21)
    extra = [torch.randint(0, V, (n,), generator=g) for n in (6, 2)]
    prompts = [*ragged_prompts, *extra]  # lengths 1, 4, 9, 13, 6, 2
    max_tokens = [30, 5, 11, 8, 9, 12]  # the first outlives the others: the batch never empties
    oracle = GreedyOracle(deep_model, prompts)
    shadow = JoiningShadow(drafter_of(kind, deep_model), oracle, prompts[:2], prompts[2:])
    batch = DecodingBatch(deep_model, lambda: shadow, k)
    sequences = [_greedy_request(p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    joins = {0: sequences[:2], 2: sequences[2:4], 3: sequences[4:5], 9: sequences[5:]}  # round -> who joins
    speculate = [True, True, False, True, False, False, False, False, True, True, False]  # then speculative
    finished, sizes = [], []
    for r in range(40):
        finished += batch.admit(joins.get(r, []))
        sizes.append(len(batch))
        finished += batch.step(speculate[r] if r < len(speculate) else True)
        if not batch.rows:
            break
    assert sorted(map(id, finished)) == sorted(map(id, sequences))  # each left once, when done
    assert max(sizes) >= 4  # the batch grew
    assert sizes[-1] == 1  # and shrank
    for sequence, prompt, n in zip(sequences, prompts, max_tokens, strict=True):
        assert sequence.trace.tokens == oracle.generate(prompt, n)
        assert sequence.finish_reason == "length"
    assert shadow.checked >= 3 * len(prompts)
    assert {a for s in sequences for a in s.trace.accepted_per_round} == set(range(k + 1))


@pytest.mark.parametrize("draft_method", DRAFT_SAMPLE_METHODS)
def test_seeded_requests_joining_a_running_batch_decode_as_they_do_alone(
    deep_model: LlamaForCausalLM, ragged_prompts: list[torch.Tensor], draft_method: str
) -> None:
    """Requests with their own sampling parameters and seeds, joining a batch at different rounds: each gets the
    tokens (and logprobs, and acceptance) it gets decoded alone from its seed; the same seed again, the same."""
    drafter = drafter_of("eagle", deep_model)
    rows = [(SamplingParams(temperature=1.0), 3), (GREEDY, 4), (SamplingParams(temperature=0.7, top_p=0.9), 5),
            (SamplingParams(temperature=1.3, top_k=5), 6)]
    max_tokens = [12, 9, 15, 10]

    def request(b: int) -> Sequence:
        params, seed = rows[b]
        return Sequence(Request(ragged_prompts[b], max_tokens[b], RequestSampling.seeded(params, seed)))

    together = [request(b) for b in range(len(rows))]
    batch = DecodingBatch(deep_model, follow_target(drafter, deep_model), 3, draft_method)
    for joining in [together[:1], [], together[1:3], together[3:]]:
        batch.admit(joining)
        batch.step(speculate=True)
    while batch.rows:
        batch.step(speculate=True)
    for b, sequence in enumerate(together):
        alone = request(b)
        single = DecodingBatch(deep_model, follow_target(drafter, deep_model), 3, draft_method)
        single.admit([alone])
        while single.rows:
            single.step(speculate=True)
        assert sequence.trace.tokens == alone.trace.tokens
        assert sequence.trace.logprobs == pytest.approx(alone.trace.logprobs, abs=1e-5)
        assert sequence.trace.accepted_per_round == alone.trace.accepted_per_round
    assert len({tuple(s.trace.tokens) for s in together}) == len(rows)


def test_a_stop_token_ends_a_request_and_is_kept(model: LlamaForCausalLM, prompts: list[torch.Tensor],
                                                 greedy: GreedyOracle) -> None:
    expected = greedy.generate(prompts[1], MAX_NEW)
    stop = expected[3]
    sequence = Sequence(Request(prompts[1], MAX_NEW, BatchSampling.greedy(1).rows[0], frozenset({stop})))
    batch = DecodingBatch(model, lambda: OracleProposer(greedy, [prompts[1]]), 3)
    batch.admit([sequence])
    while batch.rows:
        batch.step(speculate=True)
    assert sequence.trace.tokens == expected[: expected.index(stop) + 1]
    assert sequence.finish_reason == "stop"


@pytest.mark.reliability("bad_input", "requests that end at their first token (max_tokens 1, or a first token in "
                         "stop_token_ids) joining a running batch: they leave at admission, the running rows decode on")
def test_requests_done_at_their_first_token_leave_at_admission_and_the_batch_decodes_on(
    model: LlamaForCausalLM, prompts: list[torch.Tensor], greedy: GreedyOracle
) -> None:
    """A prefill whose every new request is done with its first token selects no row out of its caches: the
    index of no rows must still be an index (int64), or the round fails and with it every running request."""
    running = _greedy_request(prompts[2], MAX_NEW)
    batch = DecodingBatch(model, follow_target(drafter_of("eagle", model), model), 3)
    batch.admit([running])
    batch.step(speculate=True)
    first = greedy.generate(prompts[0], 1)[0]
    one = _greedy_request(prompts[1], 1)
    stopped = Sequence(Request(prompts[0], MAX_NEW, BatchSampling.greedy(1).rows[0], frozenset({first})))
    assert batch.admit([one, stopped]) == [one, stopped]
    assert (one.trace.tokens, one.finish_reason) == (greedy.generate(prompts[1], 1), "length")
    assert (stopped.trace.tokens, stopped.finish_reason) == ([first], "stop")
    assert batch.rows == [running]
    while batch.rows:
        batch.step(speculate=True)
    assert running.trace.tokens == greedy.generate(prompts[2], MAX_NEW)
    # a batch whose every request is done at its first token: one token each, no round
    traces = generate_batch(model, follow_target(drafter_of("eagle", model), model), prompts, 1, 3)
    assert [t.tokens for t in traces] == [greedy.generate(p, 1) for p in prompts]
    assert all(t.accepted_per_round == [] for t in traces)
