"""The tail-tau bookkeeping on a hand-made step: which parts are the tail, which drafter plays which role, and the
refresh's latency against the step's rollout period."""

from __future__ import annotations

import pytest

from pipeline.data.fleet_state import Deployment, FleetState
from pipeline.data.parts import PartManifest, StepParts, qualify
from pipeline.data.refresh_record import RefreshRecord, TailTau
from pipeline.data.rollouts import PolicyPointer, TargetLimits
from pipeline.data.training_record import TrainingFigures, TrainingRecord
from pipeline.evaluation.tail import tail_parts as tail_of
from pipeline.evaluation.tail import tail_versions

STEP = 4
STARTED = 1000.0
STEP_PARTS = StepParts(STEP, PolicyPointer(4, "policies/r/step-000004", "m"), expected_rollouts=10,
                       limits=TargetLimits(50), started_at=STARTED)


def part(number: int, rows: int, at: float) -> PartManifest:
    return PartManifest(STEP, number, rows, rows * 20, f"digest-{number}", at)


# Published out of number order: part 2's group finished before part 1's.
PARTS = [part(0, 3, 1010.0), part(2, 2, 1020.0), part(1, 1, 1030.0), part(3, 2, 1040.0), part(4, 2, 1050.0)]


@pytest.mark.parametrize(("share", "tokens", "qualifying", "tail"), [
    pytest.param(0.5, 0, 2, (1, 3, 4), id="share: 3 + 2 rows of 10 at part 2"),
    pytest.param(0.55, 0, 1, (3, 4), id="share: the sixth row comes with part 1, published third"),
    pytest.param(1.0, 50, 0, (2, 1, 3, 4), id="tokens: part 0's 60 response tokens reach 50"),
    pytest.param(1.0, 0, 4, (), id="the whole step: no tail"),
])
def test_the_tail_is_what_follows_the_qualifying_part(share: float, tokens: int, qualifying: int,
                                                      tail: tuple[int, ...]) -> None:
    assert qualify(PARTS, STEP_PARTS, share, tokens).part == qualifying
    assert tail_of(PARTS, STEP_PARTS, share, tokens) == tail


def test_a_step_below_the_share_has_no_qualifying_part() -> None:
    assert qualify(PARTS[:2], STEP_PARTS, 0.9) is None
    assert tail_of(PARTS[:2], STEP_PARTS, 0.9) == ()


def _training(version: str | None, trained_on: tuple[int, ...], ran: bool = True) -> TrainingRecord:
    figures = TrainingFigures(10, 0, 1.0, 0.5, 0.5, 0.5, 2.0, 100.0, (1.0,)) if ran else None
    return TrainingRecord(STEP, ran, "r", 40, "run", version, "3", trained_on, None, figures)


def _refresh(version: str, deployed: bool, live_at: float | None) -> RefreshRecord:
    return RefreshRecord(STEP, 2, (0, 2), 5, 1020.0, version, "5", 2.4, 2.0, deployed, "d", live_at, 3.0)


# v5 was live before the step started; the refresh (v7) went live mid-step.
HISTORY = FleetState("7", STEP, 1031.0, (), (Deployment("3", 900.0, 1.0), Deployment("5", 990.0, 1.0),
                                             Deployment("7", 1031.0, 1.0)))


def test_each_role_is_the_drafter_that_played_it() -> None:
    versions = tail_versions(HISTORY, STARTED, _refresh("7", True, 1031.0), _training("8", (3, 4)), STEP)
    assert versions == {"start": "5", "refreshed": "7", "whole_step": "8"}


def test_a_superseded_training_is_no_whole_step_drafter() -> None:
    superseded = _training("6", (), ran=False)  # the step reused / skipped: the challenger did not see the step
    assert tail_versions(HISTORY, STARTED, None, superseded, STEP) == {
        "start": "5", "refreshed": None, "whole_step": None}
    assert tail_versions(FleetState(), STARTED, None, _training("8", (2, 3)), STEP)["whole_step"] is None


def test_latency_is_from_the_qualifying_part_to_the_fleet_against_the_period() -> None:
    refresh = _refresh("7", True, 1031.0)
    assert refresh.latency_s == pytest.approx(11.0)  # part 2 published at 1020, fleet live at 1031
    assert _refresh("7", False, None).latency_s is None
    record = TailTau(STEP, (1, 3, 4), 3, {"start": "5", "refreshed": "7", "whole_step": "8"},
                     {"start": 2.0, "refreshed": 2.6, "whole_step": 2.8}, refresh.latency_s, 60.0)
    assert record.latency_share == pytest.approx(11 / 60, abs=1e-4)
    assert TailTau.from_json(record.to_json()) == record
    assert RefreshRecord.from_json(refresh.to_json()) == refresh
