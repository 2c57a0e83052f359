"""The drafter's lag and the cost ledger, on hand-made histories."""

import pytest

from pipeline.accounting.cost import DecodingCost, StepCost
from pipeline.accounting.ledger import cumulative, step_lags, totals, with_deployments
from pipeline.data.fleet_state import Deployment
from pipeline.stages import DEPLOYMENT, EVALUATION, EXTRACTION, TRAINING

# Steps published every 10 s from t=100; the fleet ran v1 (trained on step 1) from 105, v2 (trained on
# steps 1-3, so it has seen step 3) from 142, v3 (has seen step 4) from 160.
PUBLISHED = {1: 100.0, 2: 110.0, 3: 120.0, 4: 130.0, 5: 140.0}
FLEET = (Deployment("1", 105.0, 3.0), Deployment("2", 142.0, 2.5), Deployment("3", 160.0, 2.0))
SEEN = {"1": 1, "2": 3, "3": 4}


def test_lag_per_step_from_the_fleets_history():
    lags = {lag.step: lag for lag in step_lags(PUBLISHED, FLEET, SEEN)}
    assert lags[1].served_version is None
    assert lags[1].lag_steps is None  # no drafter served step 1's rollouts
    assert lags[1].lag_s == pytest.approx(5.0)  # v1 went live at 105
    assert (lags[2].served_version, lags[2].seen_step, lags[2].lag_steps) == ("1", 1, 1)
    assert lags[2].lag_s == pytest.approx(32.0)  # the first version to have seen step 2 is v2, live at 142
    assert (lags[4].served_version, lags[4].lag_steps, lags[4].lag_s) == ("1", 3, pytest.approx(30.0))
    # step 5 was published while v1 still served (v2 went live 2 s later): 4 steps old; nothing has seen it yet
    assert (lags[5].served_version, lags[5].lag_steps, lags[5].lag_s) == ("1", 4, None)


def test_ledger_adds_up_across_steps():
    decoding = DecodingCost(0.01, 0.05, 4)  # a round costs 1.2 target forwards
    costs = [
        StepCost(1, {EXTRACTION: 2.0, TRAINING: 20.0, EVALUATION: 3.0}, 5000, None, 1.0, None),
        StepCost(2, {EXTRACTION: 2.0, TRAINING: 10.0, EVALUATION: 3.0}, 5000, "1", 2.4, decoding),
        StepCost(3, {EXTRACTION: 2.0, EVALUATION: 3.0}, 6000, "1", 3.0, decoding),
    ]
    # v1 trained at step 1, v2 at step 2 (deployed twice: a rollback and a redeploy), v9 of another run
    costs = with_deployments(costs, (Deployment("1", 0, 3.0), Deployment("2", 0, 1.5), Deployment("2", 0, 1.5),
                                     Deployment("9", 0, 7.0)), {"1": 1, "2": 2})
    assert [c.seconds[DEPLOYMENT] for c in costs] == [3.0, 3.0, 0.0]
    assert [c.saved_s for c in costs] == pytest.approx([0.0, 5000 * 0.01 * 0.5, 6000 * 0.01 * 0.6])
    total = totals(costs)
    assert total.by_stage == {EXTRACTION: 6.0, TRAINING: 30.0, EVALUATION: 9.0, DEPLOYMENT: 6.0}
    assert total.spent_s == pytest.approx(51.0)
    assert total.saved_s == pytest.approx(61.0)
    running = cumulative(costs)
    assert [r.spent_s for r in running] == pytest.approx([28.0, 46.0, 51.0])
    assert [r.saved_s for r in running] == pytest.approx([0.0, 25.0, 61.0])


def test_step_cost_round_trips():
    cost = StepCost(4, {EXTRACTION: 1.5, TRAINING: 0.0}, 321, "3", 2.75, DecodingCost(0.002, 0.08, 4))
    assert StepCost.from_json(cost.to_json()) == cost


def test_a_measured_saving_replaces_the_cost_models():
    """A step the replay measured saved what the replay says (here less than the model's 25 s, and a loss is a loss);
    a step without a replay keeps the model's figure."""
    decoding = DecodingCost(0.01, 0.05, 4)
    measured = StepCost(2, {TRAINING: 10.0}, 5000, "1", 2.4, decoding, (), measured_saved_s=-0.75)
    modeled = StepCost(3, {TRAINING: 10.0}, 5000, "1", 2.4, decoding)
    assert (measured.saved_s, measured.saving_measured) == (-0.75, True)
    assert (modeled.saved_s, modeled.saving_measured) == (pytest.approx(25.0), False)
    assert totals([measured, modeled]).saved_s == pytest.approx(24.25)
    assert StepCost.from_json(measured.to_json()) == measured
