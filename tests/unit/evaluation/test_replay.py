"""A step's rollouts replayed per drafter: every arm decodes the same requests, the tail is the longest requests on
their own, and the speedups and the saving are read from the arms' own figures."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.data.replay_record import ArmReplay, RolloutReplay
from pipeline.data.rollouts import Rollout
from pipeline.evaluation.replay import TAIL_BATCH, replay_arm, replay_step, step_requests, tail_requests
from pipeline.evaluation.scheduler import SpeculationThreshold
from pipeline.evaluation.speculative import follow_target
from pipeline.models.eagle import EagleConfig, EagleDrafter
from pipeline.sampling import GREEDY, SamplingParams
from tests.support.targets import tiny_target

V = 16
LENGTHS = [2, 3, 3, 4, 9, 12]  # six requests, the tail the last four


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target(V, 16, 1, 2)


@pytest.fixture(scope="module")
def proposer(target):
    drafter = EagleDrafter(EagleConfig.from_target(target.config))
    drafter.attach(target)
    return follow_target(drafter, target)


def rollouts() -> list[Rollout]:
    return [Rollout.from_prompt_and_response(f"s{i}", [1 + i, 2], list(range(n)), 0.0, 1)
            for i, n in enumerate(LENGTHS)]


def test_an_arm_decodes_every_request_to_its_rollouts_length(target, proposer) -> None:
    requests = step_requests(rollouts(), SamplingParams(temperature=1.0), seed=7, device="cpu")
    assert [r.max_tokens for r in requests] == LENGTHS
    plain = replay_arm(target, None, requests, 3, "greedy", SpeculationThreshold(), None)
    assert plain.tokens == sum(LENGTHS)
    assert (plain.speculative_rows, plain.tau) == (0, 1.0)
    # every round serves each running request once: the first token comes from the prefill
    assert plain.plain_rows == sum(n - 1 for n in LENGTHS)
    assert plain.tail_seconds > 0
    assert plain.tail_tokens == sum(sorted(LENGTHS)[-TAIL_BATCH:])  # the longest four, decoded to their ends
    # the rounds by batch size: buckets of 8 (six rows), 4 (four, three) and 2 and 1, every round's tokens counted
    assert set(plain.by_batch) <= {1, 2, 4, 8}
    assert sum(t for _, t, _, _ in plain.by_batch.values()) == plain.tokens - len(LENGTHS)
    assert sum(n for _, _, n, _ in plain.by_batch.values()) == max(LENGTHS) - 1  # one round per token of the longest
    assert all(speculative == 0 for *_, speculative in plain.by_batch.values())
    always = replay_arm(target, proposer, requests, 3, "greedy", SpeculationThreshold(fixed=64), "3")
    assert always.tokens == sum(LENGTHS)  # the same work, in fewer rounds when drafts are kept
    assert always.plain_rows == 0
    assert all(speculative == rounds for _, _, rounds, speculative in always.by_batch.values())
    assert always.speculative_rows <= plain.plain_rows
    assert always.version == "3"


def test_the_tail_is_the_longest_requests() -> None:
    requests = step_requests(rollouts(), GREEDY, seed=7, device="cpu")
    assert sorted(r.max_tokens for r in tail_requests(requests)) == sorted(LENGTHS)[-TAIL_BATCH:]


def test_the_arms_share_requests_and_seeds_and_one_version_is_measured_once(target, proposer) -> None:
    """Replaying leaves the requests' streams where they were: each arm starts from the same seeds; two roles with
    the same drafter are one measurement."""
    requests = step_requests(rollouts(), SamplingParams(temperature=1.0), seed=7, device="cpu")
    states = [r.sampling.generator.get_state() for r in requests]
    arms = {"none": (None, None), "baseline": ("1", proposer), "served": ("1", proposer), "cotrained": ("2", proposer)}
    record = replay_step(target, arms, requests, 3, "greedy", lambda: SpeculationThreshold(fixed=64), 5,
                         SamplingParams(temperature=1.0), runs_per_arm=3)
    assert all(torch.equal(s, r.sampling.generator.get_state()) for s, r in zip(states, requests, strict=True))
    assert record.arms["baseline"] is record.arms["served"]
    assert record.arms["cotrained"] is not record.arms["served"]
    assert {a.tokens for a in record.arms.values()} == {sum(LENGTHS)} == {record.tokens}
    assert (record.step, record.requests, record.tail_batch) == (5, len(LENGTHS), TAIL_BATCH)
    # the rounds by batch size are the three runs' together
    plain = record.arms["none"]
    assert sum(n for _, _, n, _ in plain.by_batch.values()) == 3 * (max(LENGTHS) - 1)
    assert sum(t for _, t, _, _ in plain.by_batch.values()) == 3 * (sum(LENGTHS) - len(LENGTHS))


def test_speedups_and_the_saving_are_read_from_the_arms() -> None:
    """tokens/s of an arm over no speculation's, whole or in the tail; the saving is the served arm's seconds less."""
    none = ArmReplay(None, 10.0, 1000, 0, 900, 1.0, 4.0, 200, 0, {4: (4.0, 200, 60, 0), 128: (6.0, 800, 9, 0)})
    served = ArmReplay("3", 8.0, 1000, 300, 100, 2.5, 2.0, 200, 8, {4: (2.0, 200, 30, 28), 128: (6.2, 800, 9, 1)})
    record = RolloutReplay(2, 96, 1000, 4, GREEDY, "greedy", {"none": none, "served": served, "baseline": none})
    assert record.batch_speedups("served") == pytest.approx({4: 2.0, 128: 6.0 / 6.2})
    # at 128 rows the scheduler chose plain rounds (one exploring speculative round among nine)
    assert record.batch_speedups("served", speculated=True) == pytest.approx({4: 2.0})
    assert record.speedup("served") == pytest.approx(1.25)
    assert record.speedup("served", tail=True) == pytest.approx(2.0)
    assert record.speedup("served", over="baseline") == pytest.approx(1.25)
    assert record.speedup("cotrained") is None  # no such arm
    assert record.saved_s == pytest.approx(2.0)
    assert RolloutReplay.from_json(record.to_json()) == record


@pytest.mark.reliability("bad_input", "a step whose rollouts answer in one token (yes/no, multiple choice): "
                         "the replay decodes them, every arm")
def test_one_token_rollouts_replay(target, proposer) -> None:
    """One-token answers are done with their prefill's token: every arm decodes them, with no round to run."""
    one_token = [Rollout.from_prompt_and_response(f"y{i}", [1 + i, 2], [3], 0.0, 1) for i in range(3)]
    requests = step_requests([*one_token, *rollouts()[:2]], SamplingParams(temperature=1.0), seed=7, device="cpu")
    for new_proposer, fixed in ((None, None), (proposer, 64)):
        arm = replay_arm(target, new_proposer, requests, 3, "greedy", SpeculationThreshold(fixed=fixed), None)
        assert arm.tokens == 3 + sum(LENGTHS[:2])
    alone = replay_arm(target, proposer, requests[:3], 3, "greedy", SpeculationThreshold(fixed=64), "3")
    assert (alone.tokens, alone.speculative_rows, alone.plain_rows, alone.tau) == (3, 0, 0, 1.0)
