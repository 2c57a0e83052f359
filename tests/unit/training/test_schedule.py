"""Each training schedule's decision on hand-made staleness series, pinned."""

import pytest

from pipeline.accounting.cost import DecodingCost
from pipeline.training.schedule import (
    AgedTau,
    ChampionTrack,
    ScheduleInputs,
    Staleness,
    cost_decision,
    cycle_costs_s,
    keeping_loss_s,
    measure_staleness,
    schedule_decision,
)

# t = 10 ms per token, c = 0.05, k = 4: a round costs 1.2 target forwards
DECODING = DecodingCost(0.01, 0.05, 4)
TOKENS = 10_000  # a step's rollouts: 100 s of plain decoding


def _champion(tau_now: float, measured_at_step: int, promoted_at_step: int = 2, tau_at_promotion: float = 3.6):
    return ChampionTrack("3", promoted_at_step, tau_at_promotion, tau_now, measured_at_step)


STALE = Staleness(0.8, 3.6, 4)  # drafters keep 0.8 of their excess tau per step; a training reaches 3.6


def _inputs(champion, staleness=STALE, tokens=TOKENS, training_cost_s=40.0, decoding=DECODING):
    return ScheduleInputs(champion, tokens, training_cost_s, decoding, staleness=staleness)


def _saved(tau: float) -> float:
    return TOKENS * 0.01 * (1 - 1.2 / tau)


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


def test_staleness_compares_drafters_on_the_same_step():
    """Drafters keep 0.75 of their excess tau per step, and step 3's policy is harder to draft for: every drafter
    measured on it keeps half its excess. v1 3.4 (step 1, age 0), 2.8 (step 2); v2 3.4 on its own step 2; step 3:
    v3 2.2 (age 0), v2 1.9, v1 1.675. Side by side on each step: (1.8 + 0.9 + 0.675) / (2.4 + 1.2 + 0.9) = 0.75.
    Following each drafter across steps (the rule this replaces) charged step 3's difficulty to age: (1.8 + 0.675 +
    0.9) / (2.4 + 1.8 + 2.4) = 0.51, and a schedule deciding with it would retrain as if drafters lost half their
    excess per step. What a skipped training costs is one drafter against another on the same step, as measured
    here."""
    taus = [AgedTau("1", 1, 0, 3.4), AgedTau("1", 2, 1, 2.8), AgedTau("2", 2, 0, 3.4), AgedTau("1", 3, 2, 1.675),
            AgedTau("2", 3, 1, 1.9), AgedTau("3", 3, 0, 2.2)]
    staleness = measure_staleness(taus)
    assert staleness.keep == pytest.approx(0.75)
    assert staleness.tau_fresh == pytest.approx(2.2)  # the newest step's fresh drafter: the level of the coming steps
    assert staleness.pairs == 3
    assert staleness.tau_at(2) == pytest.approx(1 + 1.2 * 0.75 ** 2)
    # no fresh drafter on the newest step: its youngest, v2 at age 1, brought back to age 0 (1 + 0.9 / 0.75)
    assert measure_staleness(taus[:-1]).tau_fresh == pytest.approx(2.2)
    # a pair two ages apart counts per step of age: 1.5 = 1 + 2.0 * keep^2
    assert measure_staleness([AgedTau("1", 1, 0, 3.0), AgedTau("1", 3, 2, 1.5),
                              AgedTau("2", 3, 0, 3.0)]).keep == pytest.approx(0.5)
    # one drafter across steps, or drafters of one age: nothing tells age from the step's policy, no staleness yet
    assert measure_staleness([AgedTau("1", 1, 0, 3.0), AgedTau("1", 3, 2, 1.5)]) is None
    assert measure_staleness([AgedTau("1", 1, 0, 3.0), AgedTau("2", 2, 0, 3.2)]) is None


def test_cost_reads_a_fresh_drafter_at_the_newest_steps_level():
    """Step 4's policy is hard (v4 measures 3.0 on its own step), step 6's easy (v4 3.4 at age 2): on every step v3,
    one step older, keeps 0.8 of v4's excess. Deciding step 7 the champion v4 is 4 steps old by step 8 (expected
    1 + 2.4 * 0.64 = 2.536). A drafter trained now serves at step 6's level, 1 + 2.4 / 0.8^2 * 0.8 = 4.0 at age 1:
    keeping v4 loses 17.3 s > 15.5 s per chance, so the step trains. The rule this replaces took tau_0 from the
    newest drafter measured on its own step (v4's 3.0 on hard step 4), expected a fresh drafter at 2.6, below the
    champion's 3.4 measured now, and kept a 4-step-old drafter for a loss of 1.2 s: the comparison mixed the
    levels of two steps' policies."""
    taus = [AgedTau("4", 4, 0, 3.0), AgedTau("3", 4, 1, 2.6), AgedTau("4", 5, 1, 2.6), AgedTau("3", 5, 2, 2.28),
            AgedTau("4", 6, 2, 3.4), AgedTau("3", 6, 3, 2.92)]
    staleness = measure_staleness(taus)
    assert staleness.keep == pytest.approx(0.8)
    assert staleness.tau_fresh == pytest.approx(4.75)
    champion = ChampionTrack("4", 4, 3.0, 3.4, 6)
    decision = cost_decision(_inputs(champion, staleness=staleness, training_cost_s=30.0), 7)
    assert decision.train
    assert decision.expected_gain_s == pytest.approx(17.319, abs=1e-3)
    assert decision.expected_cost_s == pytest.approx(15.463, abs=1e-3)
    assert "expected 2.536 on step 8" in decision.reason
    assert "tau 4.000 at age 1" in decision.reason
    old_level = Staleness(0.8, 3.0, 3)
    assert not cost_decision(_inputs(champion, staleness=old_level, training_cost_s=30.0), 7).train


def test_cost_figures_pinned():
    """keep 0.8, tau_0 3.6: a drafter trained now serves at 3.08, 2.664, 2.331, ... The champion, measured 3.0
    at step 5 (trained at 2), serves step 6 at 1 + 2.0 * 0.8 = 2.6: keeping it loses S(3.08) - S(2.6)."""
    staleness = Staleness(0.8, 3.6, 4)
    assert keeping_loss_s(_champion(3.0, 5), staleness, 5, 1, TOKENS, DECODING) == pytest.approx(
        _saved(3.08) - _saved(2.6))
    g = cycle_costs_s(staleness, 1, TOKENS, DECODING, 40.0)
    assert g[0] == pytest.approx(40.0)  # retrained every step: the training alone
    assert g[1] == pytest.approx((40.0 + _saved(3.08) - _saved(2.664)) / 2)
    assert min(g) == g[3]  # every fourth step is the cheapest at this staleness and price
    decision = cost_decision(_inputs(_champion(3.0, 5)), 5)
    assert decision.expected_gain_s == pytest.approx(_saved(3.08) - _saved(2.6), abs=1e-3)
    assert decision.expected_cost_s == pytest.approx(g[3], abs=1e-3) == pytest.approx(19.438, abs=1e-3)
    assert decision.best_interval_chances == 4


def test_cost_counts_every_step_a_skipped_training_leaves_stale():
    """A champion going stale as the model says: it is replaced when the next step's loss (25.8 s) passes the
    19.4 s per step that a training every fourth step costs, not when one step's loss passes the 40 s training
    (a comparison that forgets every later step the skipped training leaves stale: step 8 here)."""
    decisions = [cost_decision(_inputs(_champion(1 + 2.6 * 0.8 ** (s - 2), s)), s) for s in (3, 4, 5, 6)]
    assert [d.train for d in decisions] == [False, False, False, True]
    assert [d.expected_gain_s for d in decisions] == pytest.approx([6.084, 12.515, 19.151, 25.835], abs=1e-3)
    assert "<=" in decisions[0].reason
    assert "best interval of 4 chance(s)" in decisions[0].reason
    assert decisions[3].reason.startswith(
        "keeping champion v3 (evaluated tau 2.065 at step 6, expected 1.852 on step 7)")


def test_cost_trains_sooner_as_staleness_rises():
    """The champion promoted at 3.6 on step 2 measures 3.5, 3.3, 3.0, 2.6 on the next steps, and beside it v1,
    trained a step earlier, keeps a smaller share of the champion's excess on each (0.95, 0.9, 0.85, 0.8): the
    share a drafter keeps per step falls (0.95 -> 0.88), the best interval shortens, and at step 7 the champion is
    replaced. (Pinned on the champion alone across steps before drafters were compared on the same step; v1 is
    what that comparison needs.)"""
    taus = [AgedTau("3", 2, 0, 3.6)]
    decisions, keeps = [], []
    for (s, tau), share in zip(STALENESS, (0.95, 0.9, 0.85, 0.8), strict=True):
        taus += [AgedTau("3", s, s - 2, tau), AgedTau("1", s, s - 1, round(1 + (tau - 1) * share, 3))]
        staleness = measure_staleness(taus)
        keeps.append(staleness.keep)
        decisions.append(cost_decision(_inputs(_champion(tau, s), staleness=staleness), s + 1))
    assert keeps == pytest.approx([0.95, 0.926, 0.904, 0.884], abs=1e-3)
    assert [d.train for d in decisions] == [False, False, False, True]
    assert [d.best_interval_chances for d in decisions] == [8, 6, 5, 5]
    assert decisions[3].expected_gain_s == pytest.approx(17.150, abs=1e-3)
    assert decisions[3].expected_cost_s == pytest.approx(14.642, abs=1e-3)


def test_cost_stops_training_a_drafter_that_cannot_pay():
    """c = 0.7: a round of k = 4 costs 3.8 target forwards, above tau 3.08 of a drafter trained now: however stale
    the champion, no training pays, and the reason says why."""
    decision = cost_decision(_inputs(_champion(1.2, 6), decoding=DecodingCost(0.01, 0.7, 4)), 6)
    assert not decision.train
    assert "at or below its round cost 1 + c*f = 3.800" in decision.reason
    assert "tau 3.080 (age 1)" in decision.reason


def test_cost_with_more_tokens_retrains_sooner():
    """The same champion three steps stale: kept on a step of 10,000 tokens, replaced on one of 40,000."""
    champion = _champion(1 + 2.6 * 0.8 ** 3, 5)
    assert not cost_decision(_inputs(champion), 5).train
    assert cost_decision(_inputs(champion, tokens=4 * TOKENS), 5).train


def test_cost_weighs_a_chance_of_several_steps():
    """Every second step a chance: keeping the champion loses both steps until the next."""
    staleness = Staleness(0.8, 3.6, 4)
    loss = keeping_loss_s(_champion(3.0, 5), staleness, 5, 2, TOKENS, DECODING)
    assert loss == pytest.approx(_saved(3.08) - _saved(2.6) + _saved(2.664) - _saved(2.28))
    g = cycle_costs_s(staleness, 2, TOKENS, DECODING, 40.0)
    # against retraining at every chance (ages 1, 2, 1, 2, ...): every other chance serves ages 3 and 4
    assert g[0] == pytest.approx(40.0)
    assert g[1] == pytest.approx((40.0 + _saved(3.08) - _saved(1 + 2.6 * 0.8 ** 3)
                                  + _saved(2.664) - _saved(1 + 2.6 * 0.8 ** 4)) / 2)


def test_without_a_champion_a_measured_cost_or_staleness_every_schedule_trains():
    no_champion = ScheduleInputs(None, TOKENS, 40.0, DECODING)
    unmeasured = ScheduleInputs(_champion(3.5, 3), TOKENS, None, None)
    no_staleness = ScheduleInputs(_champion(3.5, 3), TOKENS, 40.0, DECODING)  # no tau yet at two ages
    assert schedule_decision("acceptance", 3, 1, 0.3, no_champion).train
    assert schedule_decision("cost", 3, 1, 0.3, no_champion).train
    assert schedule_decision("cost", 3, 1, 0.3, unmeasured).train
    decision = schedule_decision("cost", 3, 1, 0.3, no_staleness)
    assert decision.train
    assert decision.reason.startswith("staleness not measured yet")
    # and off the interval nothing trains
    assert not schedule_decision("cost", 3, 2, 0.3, no_champion).train
