"""The promotion decision: who is promoted, by which margin, and the reason it gives; the price of the step's
cost entry."""

from __future__ import annotations

import pytest

from pipeline.accounting.cost import DecodingCost
from pipeline.config import PromotionConfig, load_config
from pipeline.data.rollouts import PolicyPointer, Rollout, write_rollouts
from pipeline.data.store import open_store
from pipeline.evaluation.acceptance import Decision, StepMeasurement, promotion_decision, replay_batch, step_cost
from pipeline.sampling import GREEDY

AUTO = PromotionConfig(policy="auto", margin=0.05)


@pytest.mark.parametrize(
    ("new_tau", "champion_tau", "promote", "reason"),
    [
        (None, 2.0, False, "no new drafter at this step"),
        (None, None, False, "no new drafter at this step"),
        (2.0, None, True, "no drafter serves or is champion yet; new tau 2.000"),
        (2.5, 2.0, True, "new tau 2.500 > incumbent tau 2.000 + margin 0.05"),
        (2.04, 2.0, False, "new tau 2.040 <= incumbent tau 2.000 + margin 0.05"),
        (2.05, 2.0, False, "new tau 2.050 <= incumbent tau 2.000 + margin 0.05"),  # the margin itself is not enough
        (1.5, 2.0, False, "new tau 1.500 <= incumbent tau 2.000 + margin 0.05"),
    ],
    ids=["no-new-drafter", "nothing-at-all", "first-drafter", "better", "within-margin", "at-margin", "worse"],
)
def test_automatic_promotion(new_tau: float | None, champion_tau: float | None, promote: bool, reason: str) -> None:
    assert promotion_decision(AUTO, new_tau, champion_tau) == Decision(promote, reason)


def test_manual_policy_never_promotes_and_says_who_does() -> None:
    manual = PromotionConfig(policy="manual", margin=0.0)
    for champion_tau in (None, 1.0):
        decision = promotion_decision(manual, 4.0, champion_tau)
        assert not decision.promote
        assert "a person moves `champion` in the MLflow UI" in decision.reason
    assert promotion_decision(manual, None, 1.0) == Decision(False, "no new drafter at this step")


def test_zero_margin_promotes_any_strict_improvement() -> None:
    even = PromotionConfig(policy="auto", margin=0.0)
    assert promotion_decision(even, 2.001, 2.0).promote
    assert not promotion_decision(even, 2.0, 2.0).promote


def test_the_ledger_prices_a_drafter_forward_as_the_fleet_does(tmp_path) -> None:
    """eval.draft_cost_ratio: the step's cost entry keeps the timed t and f, and takes the fleet's c."""
    timed = DecodingCost(3e-4, 0.45, 4)
    measurement = StepMeasurement(2, 2, 3, {"served": None}, {}, timed, GREEDY, "greedy")
    for ratio, expected in ((0.0, timed), (0.078, DecodingCost(3e-4, 0.078, 4))):
        cfg = load_config(overrides={"data_dir": str(tmp_path), "eval": {"draft_cost_ratio": ratio}})
        store = open_store(cfg)
        write_rollouts(store, cfg.run, 2, [Rollout("s0", [1, 2, 3, 4], [0, 0, 1, 1], 0.5, 2)],
                       PolicyPointer(2, f"policies/{cfg.run}/x", "m"))
        cost = step_cost(store, cfg, measurement, {"training": 10.0})
        assert cost.decoding == expected
        assert cost.rollout_tokens == 2


@pytest.mark.parametrize(("rollouts", "replicas", "max_requests", "batch"), [
    (96, 2, 256, 48),  # the demo: each of two replicas decoded half the step
    (97, 2, 256, 49),
    (96, 0, 256, 96),  # no fleet: the whole step
    (5000, 8, 256, 256),  # a production step: bounded
])
def test_the_replay_decodes_one_replicas_share_of_the_step(rollouts, replicas, max_requests, batch) -> None:
    assert replay_batch(rollouts, replicas, max_requests) == batch
