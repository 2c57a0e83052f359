"""Stage records: JSON round trips, documents stored before records carried a schema version, and
documents this code cannot read."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pipeline.accounting.cost import DecodingCost, StepCost
from pipeline.data.acceptance_record import AcceptanceRecord, DrafterTau, TauEstimate, read_acceptance
from pipeline.data.buffer_record import BufferEntry, BufferRecord
from pipeline.data.fleet_state import DeployReport, FleetPolicy, FleetState, ReplicaDeploy
from pipeline.data.keys import acceptance_key, drafter_key
from pipeline.data.records import RecordError, read_record, write_record
from pipeline.data.refresh_record import RefreshBreakdown, RefreshRecord, RefreshTimes, TailTau
from pipeline.data.replay_record import ArmReplay, RolloutReplay
from pipeline.data.stage_placement import StagePlacement
from pipeline.data.store import ObjectStore
from pipeline.data.training_record import TrainingFigures, TrainingRecord, read_training
from pipeline.sampling import SamplingParams
from pipeline.stages import TRAINING

RUN = "r"
TAU = DrafterTau("3", 2.5, 0.375, (0.75, 0.5, 0.25, 0.0), 12, 48, 18, 4, TauEstimate(2.25, (0.75, 0.5), 4, 30))
ACCEPTANCE = AcceptanceRecord(2, 2, 4, 4, 32, TAU, None, TAU, None, True,
                              "no drafter serves or is champion yet; new tau 2.500", "3",
                              SamplingParams(temperature=1.0), "probabilistic")
FIGURES = TrainingFigures(8, 0, 1.5, 0.25, 1.25, 0.5, 3.0, 120.0, (3.0, 2.0, 1.5))
TRAINED = TrainingRecord(2, True, "trained", 90, "run-1", "3", "2", (1, 2), None, FIGURES)
REPLICA = ReplicaDeploy("standin-0", "3", 2.75, 1.5, True)
HOT = ReplicaDeploy("standin-1", "4", 2.5, 0.8, False, "hot", "", 0.05, "file:///policies/step-2")
ROLLED_BACK = ReplicaDeploy("standin-0", "3", 2.75, 9.0, True, "rolled back",
                            "hot update failed (/update_weights answered HTTP 500); live tau 0.9 below the gate 1.0")
BUFFER = BufferRecord(2, (BufferEntry(1, "s1-0", "part-00000.arrow", 0, 6),
                          BufferEntry(2, "s2-0", "part-00000.arrow", 0, 4)))
# Published at 1000; the run began 2 s later, its process 4 s after that; extraction 1 s, training 6 s (5 of them
# the loop), the check 1.5 s, the hand-off 0.5 s, the deploy 2 s: live at 1018.
TIMES = RefreshTimes(1002.0, 1006.0, 1007.0, 1013.0, 5.0, 1014.5, 1015.0, 1017.0)
REFRESHED = RefreshRecord(4, 2, (0, 1, 2), 40, 1000.0, "7", "6", 2.8, 2.1, True, "beats", 1017.0, 6.0, True, TIMES)
RECORDS = [
    REFRESHED,
    RefreshRecord(5, 3, (3,), 9, 1100.0, None, None, None, None, False, "skipped: step-000006 qualified as well"),
    BUFFER,
    TRAINED,
    TrainingRecord(3, False, "every 2 steps; next at step 4", 90),
    ACCEPTANCE,
    DeployReport("3", (REPLICA,)),
    FleetState("3", 2, 1700000000.0, (REPLICA,)),
    FleetState("3", 2, 1700000000.0, (ROLLED_BACK, HOT)),
    FleetState(),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_each_record_round_trips_through_the_store(store: ObjectStore, record) -> None:
    write_record(store, "some/record.json", record)
    assert store.read_json("some/record.json")["schema_version"] == 1
    assert read_record(store, "some/record.json", type(record)) == record


def test_stored_json_keeps_the_shape_readers_of_earlier_records_know(store: ObjectStore) -> None:
    write_record(store, acceptance_key(RUN, 2), ACCEPTANCE)
    write_record(store, drafter_key(RUN, 2), TRAINED)
    acceptance = store.read_json(acceptance_key(RUN, 2))
    assert acceptance["drafters"]["cotrained"]["version"] == "3"
    assert acceptance["drafters"]["cotrained"]["per_position"] == [0.75, 0.5, 0.25, 0.0]
    assert acceptance["drafters"]["cotrained"]["estimate"]["sequences"] == 4
    assert acceptance["drafters"]["served"] is None
    training = store.read_json(drafter_key(RUN, 2))
    assert (training["iterations"], training["loss_history"], training["trained_on_steps"]) == (8, [3.0, 2.0, 1.5],
                                                                                                [1, 2])
    assert BUFFER.to_json()["composition"] == {"1": 1, "2": 1}


def test_a_document_without_schema_version_reads_as_version_1(store: ObjectStore) -> None:
    # as the pipeline stored them before records carried a version
    store.write_json(acceptance_key(RUN, 2), ACCEPTANCE.to_json())
    store.write_json(drafter_key(RUN, 2), TRAINED.to_json())
    assert read_acceptance(store, RUN, 2) == ACCEPTANCE
    assert read_training(store, RUN, 2) == TRAINED
    for record in (BUFFER, RECORDS[5]):  # the buffer manifest and the fleet's state
        store.write_json("earlier.json", record.to_json())
        assert read_record(store, "earlier.json", type(record)) == record


@pytest.mark.reliability("bad_input", "stage record (acceptance) of another schema version: refused naming its key")
def test_another_schema_version_is_refused_naming_the_file(store: ObjectStore) -> None:
    store.write_json(acceptance_key(RUN, 2), {**ACCEPTANCE.to_json(), "schema_version": 2})
    with pytest.raises(RecordError, match=r"acceptance/r/step-000002\.json: AcceptanceRecord schema_version 2"):
        read_acceptance(store, RUN, 2)


@pytest.mark.reliability("bad_input", "stage record (training outcome) missing a field, or not a JSON object: "
                                      "refused naming its key")
def test_a_document_missing_a_field_is_refused_naming_the_file_and_field(store: ObjectStore) -> None:
    doc = TRAINED.to_json()
    del doc["reason"]
    store.write_json(drafter_key(RUN, 2), doc)
    with pytest.raises(RecordError, match=r"drafter/r/step-000002\.json: not a TrainingRecord.*'reason'"):
        read_training(store, RUN, 2)
    store.write_json(drafter_key(RUN, 2), [1, 2])
    with pytest.raises(RecordError, match=r"drafter/r/step-000002\.json: not a JSON object"):
        read_training(store, RUN, 2)


def test_a_fleet_state_from_before_hot_updates_says_how_each_replica_got_its_version(store: ObjectStore) -> None:
    """Replicas recorded before hot updates were restarted, or only gated when they served the version already."""
    gated = ReplicaDeploy("standin-1", "3", 2.5, 0.4, False)
    doc = FleetState("3", 2, 1700000000.0, (REPLICA, gated)).to_json()
    for replica in doc["replicas"]:
        for key in ("update", "note", "paused_s", "target"):
            del replica[key]
    store.write_json("fleet/r/state.json", doc)
    state = read_record(store, "fleet/r/state.json", FleetState)
    assert [(r.update, r.note, r.paused_s, r.target) for r in state.replicas] == [("restart", "", 0.0, ""),
                                                                                 ("none", "", 0.0, "")]
    with pytest.raises(ValueError, match="update 'warm' is not one of"):
        ReplicaDeploy("standin-0", "3", 2.75, 1.5, True, "warm")


def test_acceptance_record_lists_the_roles_that_had_a_drafter() -> None:
    assert list(ACCEPTANCE.measured()) == ["cotrained", "baseline"]


def test_an_acceptance_record_from_before_sampling_reads_as_greedy(store: ObjectStore) -> None:
    """Records without `sampling` were measured greedily: their tau is the greedy tau, at temperature 0."""
    old = ACCEPTANCE.to_json()
    del old["sampling"], old["draft_sample_method"]
    store.write_json(acceptance_key(RUN, 2), old)
    record = read_acceptance(store, RUN, 2)
    assert record.sampling.greedy
    assert record.draft_sample_method == "greedy"
    assert record.cotrained.greedy_tau == record.cotrained.tau == 2.5
    assert record.cotrained.greedy_per_position == (0.75, 0.5, 0.25, 0.0)


def test_a_refreshs_latency_breaks_down_into_its_milestones_and_adds_up() -> None:
    breakdown = REFRESHED.breakdown
    assert breakdown == RefreshBreakdown(wait_s=2.0, launch_s=4.0, extract_s=1.0, fine_tune_s=5.0, train_io_s=1.0,
                                         check_s=1.5, handoff_s=0.5, deploy_s=2.0)
    assert breakdown.total_s == REFRESHED.latency_s == 17.0
    assert breakdown.metadata()["latency_launch_s"] == 4.0
    # Not deployed: no deploy segment (-1 in Dagster's metadata), and no mean over it.
    undeployed = RefreshTimes(1002.0, 1006.0, 1007.0, 1013.0, 5.0, 1014.5).breakdown(1000.0)
    assert (undeployed.deploy_s, undeployed.handoff_s, undeployed.metadata()["latency_deploy_s"]) == (None, 0.0, -1.0)
    faster = RefreshBreakdown(1.0, 0.0, 1.0, 3.0, 1.0, 0.5, 0.5, 1.0)
    assert RefreshBreakdown.mean([breakdown, faster, undeployed]) == RefreshBreakdown(
        1.5, 2.0, 1.0, 4.0, 1.0, 1.0, 0.5, 1.5)
    assert RefreshBreakdown.mean([undeployed]) is None
    # Records written before the milestones were kept read without them.
    doc = REFRESHED.to_json()
    del doc["times"]
    assert RefreshRecord.from_json(doc).breakdown is None


COUNTERS = {"drafts": 40.0, "draft_tokens": 120.0, "accepted": 70.0, "accepted_per_position": {"0": 30.0, "1": 25.0}}
ARM = ArmReplay("3", 1.5, 96, 20, 4, 2.4, 0.5, 24, 8, {1: (0.25, 12, 6, 6), 4: (1.25, 84, 18, 2)})
PLACEMENT = StagePlacement(TRAINING, "process", 1, "cpu", 2_000_000, 6.5, 0.25)
# Every stored record kind, each number field in it filled in.
STORED = [
    *(r for r in RECORDS if not isinstance(r, DeployReport) and r != FleetState()),
    FleetState("3", 2, 1700000000.0, (HOT,), (), {"standin-1": COUNTERS}),
    FleetPolicy(3, "file:///store/fleet/r/policies/step-000003", "policy-step-000003", 1700000000.0),
    RolloutReplay(2, 8, 96, 2, SamplingParams(temperature=0.7, top_p=0.9), "probabilistic", {"served": ARM}),
    PLACEMENT,
    TailTau(4, (3, 4), 3, {"start": "6", "refreshed": None}, {"start": 2.0, "refreshed": None}, 12.5, 40.0),
    StepCost(2, {TRAINING: 6.5}, 480, "3", 2.4, DecodingCost(0.01, 0.2, 4), (PLACEMENT,), 3.5),
]


# Written for people beside what they sum up, and never read back: the reader derives them again.
DERIVED = {"schema_version", "num_samples", "num_tokens", "composition", "latency_share"}


def _number_fields(doc: object, path: tuple = ()) -> Iterator[tuple]:
    """The path to every number in a record's JSON that its reader reads."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key not in DERIVED:
                yield from _number_fields(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _number_fields(value, (*path, i))
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        yield path


def _replaced(doc: object, path: tuple, value: object) -> object:
    if not path:
        return value
    if isinstance(doc, dict):
        return {**doc, path[0]: _replaced(doc[path[0]], path[1:], value)}
    return [_replaced(v, path[1:], value) if i == path[0] else v for i, v in enumerate(doc)]


@pytest.mark.parametrize("record", STORED, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("bad", [10**400, float("nan"), "12"], ids=["400-digits", "nan", "a-string"])
@pytest.mark.reliability("bad_input", "a number of hundreds of digits, NaN or a string in any number field of a "
                                      "stored stage record: refused naming the file and the field, never OverflowError")
def test_every_number_a_stored_record_holds_is_checked_naming_the_file_and_field(
    store: ObjectStore, record, bad: object
) -> None:
    """float() and math.isfinite raise OverflowError on an integer of hundreds of digits, which no reader caught: a
    record's number is refused like any other bad value, where it is read."""
    doc = {"schema_version": 1, **record.to_json()}
    paths = list(_number_fields(doc))
    assert paths
    for path in paths:
        store.write_json("some/record.json", _replaced(doc, path, bad))
        field = next(str(p) for p in reversed(path) if isinstance(p, str))
        with pytest.raises(RecordError, match=r"some/record\.json: ") as refused:
            read_record(store, "some/record.json", type(record))
        assert field in str(refused.value), path
