"""The schedule benchmark's arithmetic on hand-made rows: which steps a window counts, the rollout scale, the
ratios and the goal, the warm-ups' comparison."""

from __future__ import annotations

import pytest

from benchmarks.schedule import Window, goal_met, ratios, rollout_scale_for, warmups_identical
from pipeline.accounting.cost import DecodingCost

PRICE = DecodingCost(0.01, 0.0, 4)  # c = 0: a step of 1,000 tokens at tau 2 saves 5 s, at tau 4 7.5 s
TIMED = PRICE.to_json()


def _row(step: int, phase: str, trained: bool, training_s: float, tau_served: float, tokens: int = 1000) -> dict:
    return {"step": step, "phase": phase, "trained": trained, "training_s": training_s, "tau_served": tau_served,
            "tau_cotrained": 4.0 if trained else None, "version_served": str(step - 1) if step > 1 else None,
            "rollout_tokens": tokens, "decoding": TIMED if step > 1 else None}


# W = 2 (steps 1-2), M = 3 (steps 3-5) deciding, step 6 served and measured only
ROWS = [_row(1, "warmup", True, 30.0, 1.0), _row(2, "warmup", True, 10.0, 2.0), _row(3, "measured", True, 10.0, 4.0),
        _row(4, "measured", False, 0.0, 4.0), _row(5, "measured", True, 12.0, 2.0), _row(6, "last", False, 0.0, 4.0)]


def test_a_window_pairs_its_trainings_with_the_steps_their_drafters_serve():
    """Steps 3-5's decisions serve steps 4-6: step 3's saving belongs to the warm-up's last training, step 6's to
    step 5's decision, and the untrained last step adds no training."""
    measured = Window(3, 5).totals(ROWS, PRICE)
    assert measured == {"trained_steps": [3, 5], "trainings": 2, "training_s": 22.0, "saved_s": 20.0, "net_s": -2.0}
    whole = Window(1, 5).totals(ROWS, PRICE)  # step 1 served nothing: no timing, no saving
    assert whole == {"trained_steps": [1, 2, 3, 5], "trainings": 4, "training_s": 62.0, "saved_s": 32.5, "net_s": -29.5}


def test_the_rollout_scale_prices_the_median_step_at_the_ratio_to_the_mean_training():
    rows = [_row(3, "measured", True, 10.0, 3.0, 1000), _row(4, "measured", False, 0.0, 3.0, 3000),
            _row(5, "measured", True, 20.0, 3.0, 2000)]
    # median rollouts 2,000 tokens x 0.01 s = 20 s against a mean training of 15 s: 50 x 15 / 20
    assert rollout_scale_for(rows, 50.0) == pytest.approx(37.5)
    with pytest.raises(ValueError, match="a step that trained"):
        rollout_scale_for([_row(4, "measured", False, 0.0, 3.0)], 50.0)


def test_ratios_and_the_goal():
    interval = {"trainings": 10, "training_s": 100.0, "saved_s": 1000.0, "net_s": 900.0}
    figures = ratios(interval, {"trainings": 5, "training_s": 60.0, "saved_s": 950.0, "net_s": 890.0})
    assert figures == {"trainings_ratio": 0.5, "training_s_ratio": 0.6, "saved_s_ratio": 0.95,
                       "net_s_vs_interval": -10.0}
    assert goal_met(figures)
    assert not goal_met(ratios(interval, {"trainings": 5, "training_s": 61.0, "saved_s": 990.0, "net_s": 929.0}))
    assert not goal_met(ratios(interval, {"trainings": 5, "training_s": 50.0, "saved_s": 949.0, "net_s": 899.0}))
    # interval saved nothing: no ratio of savings, and no goal met on it
    lost = ratios({"trainings": 10, "training_s": 100.0, "saved_s": -5.0, "net_s": -105.0},
                  {"trainings": 0, "training_s": 0.0, "saved_s": -5.0, "net_s": -5.0})
    assert lost["saved_s_ratio"] is None
    assert not goal_met(lost)


def test_warmups_compare_what_they_trained_served_and_measured():
    other = [dict(r) for r in ROWS]
    other[3]["trained"] = True  # a measured step: not the warm-up's
    assert warmups_identical(ROWS, other)
    other[1]["tau_served"] = 2.001
    assert not warmups_identical(ROWS, other)
