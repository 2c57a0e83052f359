"""The promotion decision: who is promoted, by which margin, and the reason it gives."""

from __future__ import annotations

import pytest

from pipeline.config import PromotionConfig
from pipeline.evaluation.acceptance import Decision, promotion_decision

AUTO = PromotionConfig(policy="auto", margin=0.05)


@pytest.mark.parametrize(
    ("new_tau", "champion_tau", "promote", "reason"),
    [
        (None, 2.0, False, "no new drafter at this step"),
        (None, None, False, "no new drafter at this step"),
        (2.0, None, True, "no champion yet; new tau 2.000"),
        (2.5, 2.0, True, "new tau 2.500 > champion tau 2.000 + margin 0.05"),
        (2.04, 2.0, False, "new tau 2.040 <= champion tau 2.000 + margin 0.05"),
        (2.05, 2.0, False, "new tau 2.050 <= champion tau 2.000 + margin 0.05"),  # the margin itself is not enough
        (1.5, 2.0, False, "new tau 1.500 <= champion tau 2.000 + margin 0.05"),
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
