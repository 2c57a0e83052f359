"""Each training schedule's decision on hand-made staleness series, pinned."""

import pytest

from pipeline.cost import DecodingCost
from pipeline.training.schedule import (
    ChampionTrack,
    ScheduleInputs,
    expected_gain_s,
    schedule_decision,
)

# t = 10 ms per token, c = 0.05, k = 4: a round costs 1.2 target forwards
DECODING = DecodingCost(0.01, 0.05, 4)


def _champion(tau_now: float, measured_at_step: int, promoted_at_step: int = 2, tau_at_promotion: float = 3.6):
    return ChampionTrack("3", promoted_at_step, tau_at_promotion, tau_now, measured_at_step)


def _inputs(champion, tokens=100_000, training_cost_s=40.0):
    return ScheduleInputs(champion, tokens, training_cost_s, DECODING)


# A champion promoted at step 2 with tau 3.6, measured on later steps' policies.
STALENESS = [(3, 3.5), (4, 3.3), (5, 3.0), (6, 2.6)]


def test_interval_trains_on_its_multiples_whatever_the_staleness():
    decisions = [schedule_decision("interval", s, 2, 0.3, _inputs(_champion(tau, s))).train for s, tau in STALENESS]
    assert decisions == [False, True, False, True]


def test_acceptance_trains_once_the_drop_exceeds_the_threshold():
    decisions = [schedule_decision("acceptance", s + 1, 1, 0.35, _inputs(_champion(tau, s))) for s, tau in STALENESS]
    assert [d.train for d in decisions] == [False, False, True, True]
    assert "fell 0.600" in decisions[2].reason
    assert "train.schedule.tau_drop=0.35" in decisions[2].reason


def test_cost_gain_pinned():
    """Step 5: the champion lost 0.6 tau in 3 steps (0.2/step); not retrained it would be at 2.8 next step,
    a fresh one at 3.6: gain = 1e5 * 0.01 * 1.2 * (1/2.8 - 1/3.6) = 95.238 s."""
    gain = expected_gain_s(_champion(3.0, 5), 100_000, DECODING)
    assert gain == pytest.approx(1e5 * 0.01 * 1.2 * (1 / 2.8 - 1 / 3.6))
    assert gain == pytest.approx(95.238, abs=1e-3)


def test_cost_trains_when_the_gain_exceeds_the_training():
    decisions = [schedule_decision("cost", s + 1, 1, 0.3, _inputs(_champion(tau, s))) for s, tau in STALENESS]
    gains = [d.expected_gain_s for d in decisions]
    # rates 0.1, 0.15, 0.2, 0.25 tau/step; gain grows as the champion goes stale
    assert gains == pytest.approx([1e5 * 0.012 * (1 / (tau - rate) - 1 / 3.6) for (_, tau), rate in
                                   zip(STALENESS, [0.1, 0.15, 0.2, 0.25], strict=True)], abs=1e-3)
    assert [d.train for d in decisions] == [False, True, True, True]  # 8.3 s, 44.0 s, 95.2 s, 172.3 s vs 40 s
    assert decisions[0].expected_cost_s == 40.0
    assert "<=" in decisions[0].reason


def test_cost_with_fewer_tokens_waits_longer():
    """Half the rollout tokens before the next chance halve the gain: the same staleness no longer pays."""
    decision = schedule_decision("cost", 5, 1, 0.3, _inputs(_champion(3.3, 4), tokens=50_000))
    assert not decision.train


def test_without_a_champion_or_a_measured_cost_every_schedule_trains():
    no_champion = ScheduleInputs(None, 100_000, 40.0, DECODING)
    unmeasured = ScheduleInputs(_champion(3.5, 3), 100_000, None, None)
    assert schedule_decision("acceptance", 3, 1, 0.3, no_champion).train
    assert schedule_decision("cost", 3, 1, 0.3, no_champion).train
    assert schedule_decision("cost", 3, 1, 0.3, unmeasured).train
    # and off the interval nothing trains
    assert not schedule_decision("cost", 3, 2, 0.3, no_champion).train
