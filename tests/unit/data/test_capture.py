"""The capture plan: which rollouts of a step are stored, and which of their tokens."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pipeline.data import capture
from pipeline.data.capture import CapturedSample, CapturePlan, CapturePlanError, plan_capture, window_bounds
from pipeline.data.held_out import is_held_out
from pipeline.data.rollouts import Rollout
from pipeline.data.store import ObjectStore

HELD_OUT = 0.125


def _long_tailed(n: int, seed: int = 0, prompt: int = 16) -> list[Rollout]:
    """Rollouts with lognormal lengths (mean about 300 tokens, a long tail) and uniform rewards."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        response = max(1, min(4000, int(rng.lognormvariate(5.3, 0.8))))
        out.append(Rollout(f"s{i:05d}", [rng.randrange(100) for _ in range(prompt + response)],
                           [0] * prompt + [1] * response, rng.random(), 1))
    return out


def test_plan_is_deterministic_by_sample_id_whatever_the_order() -> None:
    rollouts = _long_tailed(400)
    plan = plan_capture(rollouts, 3, held_out_fraction=HELD_OUT, window_tokens=128, max_samples=50)
    shuffled = rollouts[:]
    random.Random(1).shuffle(shuffled)
    again = plan_capture(shuffled, 3, held_out_fraction=HELD_OUT, window_tokens=128, max_samples=50)
    assert {s.sample_id for s in plan.samples} == {s.sample_id for s in again.samples}
    assert plan == plan_capture(rollouts, 3, held_out_fraction=HELD_OUT, window_tokens=128, max_samples=50)


def test_sample_budget_is_met_exactly_and_held_out_never_captured() -> None:
    rollouts = _long_tailed(400)
    eligible = [r for r in rollouts if not is_held_out(r.sample_id, HELD_OUT)]
    for budget in (1, 7, 64, 200, len(eligible)):
        plan = plan_capture(rollouts, 1, held_out_fraction=HELD_OUT, window_tokens=128, max_samples=budget)
        assert plan.captured == budget
        assert not any(is_held_out(s.sample_id, HELD_OUT) for s in plan.samples)
    everything = plan_capture(rollouts, 1, held_out_fraction=HELD_OUT, window_tokens=128, max_samples=0)
    assert everything.captured == len(eligible)
    assert everything.held_out == len(rollouts) - len(eligible)
    over = plan_capture(rollouts, 1, held_out_fraction=HELD_OUT, window_tokens=128, max_samples=10_000)
    assert over.captured == len(eligible)


def test_token_budget_is_never_exceeded_and_nearly_filled() -> None:
    rollouts = _long_tailed(400)
    for budget in (500, 5_000, 20_000):
        plan = plan_capture(rollouts, 1, held_out_fraction=HELD_OUT, window_tokens=128, max_tokens=budget)
        assert plan.stored_tokens <= budget
        assert plan.stored_tokens > budget - 128  # it stops at the first window that does not fit
    both = plan_capture(rollouts, 1, held_out_fraction=HELD_OUT, window_tokens=128, max_samples=30, max_tokens=10**6)
    assert both.captured == 30


def test_long_tail_and_rewards_keep_their_share() -> None:
    """A quarter of the step captured: each length quartile (the longest included) and each reward half
    holds its share of the plan, within one sample per stratum."""
    rollouts = _long_tailed(2000, seed=3)
    eligible = [r for r in rollouts if not is_held_out(r.sample_id, HELD_OUT)]
    lengths = sorted(len(r.input_ids) for r in eligible)
    longest_quarter = lengths[3 * len(lengths) // 4]
    plan = plan_capture(rollouts, 1, held_out_fraction=HELD_OUT, window_tokens=128, max_samples=len(eligible) // 4)
    by_id = {r.sample_id: r for r in rollouts}
    captured = [by_id[s.sample_id] for s in plan.samples]
    long_share = sum(len(r.input_ids) >= longest_quarter for r in captured) / len(captured)
    assert abs(long_share - 0.25) <= 8 / len(captured)
    median = sorted(r.reward for r in eligible)[(len(eligible) - 1) // 2]
    high_share = sum(r.reward > median for r in captured) / len(captured)
    assert abs(high_share - 0.5) <= 8 / len(captured)
    # the tail itself: the longest 5% of the step is represented, not left to chance
    tail = lengths[int(0.95 * len(lengths))]
    assert sum(len(r.input_ids) >= tail for r in captured) >= 0.03 * len(captured)
    # a simple hash prefix (no strata) is what this is measured against: the strata are never emptied
    strata = Counter(capture._strata(eligible))
    captured_strata = Counter(capture._strata(eligible)[eligible.index(r)] for r in captured)
    assert set(captured_strata) == set(strata)


def test_each_sample_keeps_exactly_its_training_window() -> None:
    rollouts = _long_tailed(200)
    plan = plan_capture(rollouts, 1, held_out_fraction=HELD_OUT, window_tokens=128)
    by_id = {r.sample_id: r for r in rollouts}
    for s in plan.samples:
        r = by_id[s.sample_id]
        assert (s.start, s.end) == window_bounds(torch.tensor(r.loss_mask), 128)
        assert s.tokens == len(r.input_ids)
    assert plan.stored_tokens == sum(min(128, s.tokens) for s in plan.samples)
    assert plan.forwarded_tokens == sum(s.end for s in plan.samples)
    assert plan.summary()["tokens_stored"] < plan.summary()["tokens_forwarded"] <= plan.summary()["tokens_published"]


@pytest.mark.parametrize("seed", range(20))
def test_a_window_of_a_window_is_itself(seed: int) -> None:
    rng = random.Random(seed)
    n, window = rng.randint(2, 300), rng.randint(2, 100)
    mask = torch.zeros(n, dtype=torch.int64)
    a = rng.randrange(n)
    mask[a : rng.randint(a + 1, n)] = 1
    start, end = window_bounds(mask, window)
    assert window_bounds(mask[start:end], window) == (0, end - start)


def test_plan_round_trips_through_the_store(store: ObjectStore) -> None:
    plan = plan_capture(_long_tailed(50), 12, held_out_fraction=HELD_OUT, window_tokens=64, max_samples=9,
                        max_tokens=10**5)
    capture.write_plan(store, "run", plan)
    assert capture.read_plan(store, "run", 12) == plan
    assert capture.read_plan(store, "run", 13) is None
    assert store.read_json("capture/run/step-000012.json")["schema_version"] == capture.SCHEMA_VERSION


@pytest.mark.parametrize(("doc", "field"), [
    ({"schema_version": 99}, "schema_version"),
    ({"schema_version": 1, "step": "1"}, "step"),
    ({"schema_version": 1, "step": 1, "window_tokens": 8, "max_samples": 0, "max_tokens": 0, "published": 1,
      "published_tokens": 4, "held_out": 0, "samples": [["a", 3, 2, 4]]}, "sample"),
])
def test_a_malformed_plan_is_refused_naming_the_field(doc: dict, field: str) -> None:
    with pytest.raises(CapturePlanError, match=field):
        CapturePlan.from_json(doc)
    assert CapturedSample.from_json(["a", 0, 2, 4]).stored == 2
