"""The speculative-decoding cost model: tau to rollout seconds, pinned on values worked out by hand."""

import pytest

from pipeline.accounting.cost import DecodingCost


def test_autoregressive_drafter_round_costs_k_drafter_forwards():
    # t = 20 ms, c = 0.05, f = k = 4: a round costs 1.2 target forwards
    cost = DecodingCost(target_s_per_token=0.02, draft_cost_ratio=0.05, drafter_forwards_per_round=4)
    assert cost.round_cost == pytest.approx(1.2)
    assert cost.speedup(3.0) == pytest.approx(2.5)
    assert cost.seconds_per_token(3.0) == pytest.approx(0.008)
    # 1,000 tokens: 20 s plain, 8 s speculative
    assert cost.saved_seconds(3.0, 1000) == pytest.approx(12.0)


def test_parallel_drafter_pays_one_forward_per_round():
    """P-EAGLE's k proposals cost one drafter forward: at the same tau it saves more."""
    serial = DecodingCost(0.02, 0.05, 8)
    parallel = DecodingCost(0.02, 0.05, 1)
    assert parallel.round_cost == pytest.approx(1.05)
    assert parallel.saved_seconds(3.0, 1000) == pytest.approx(1000 * (0.02 - 0.02 * 1.05 / 3))
    assert parallel.saved_seconds(3.0, 1000) > serial.saved_seconds(3.0, 1000)


def test_a_drafter_below_its_round_cost_loses_time():
    """tau < 1 + c*f: speculative decoding is slower than plain, and the saving says so (negative)."""
    cost = DecodingCost(0.02, 0.1, 4)  # a round costs 1.4 target forwards
    assert cost.speedup(1.2) < 1
    assert cost.saved_seconds(1.2, 600) == pytest.approx(600 * (0.02 - 0.02 * 1.4 / 1.2))
    assert cost.saved_seconds(1.2, 600) < 0


def test_round_trip_and_bad_values():
    cost = DecodingCost(0.015, 0.04, 4)
    assert DecodingCost.from_json(cost.to_json()) == cost
    with pytest.raises(ValueError, match="t > 0"):
        DecodingCost(0.0, 0.1, 4)
    with pytest.raises(ValueError, match="schema_version"):
        DecodingCost.from_json({**cost.to_json(), "schema_version": 9})
