"""The fleet's live tau over a window of the replicas' counters (`pipeline.serving.live_tau`), on hand-made
readings: since a version went live, and since the sensor's last tick."""

from pipeline.data.fleet_state import FleetState, ReplicaDeploy
from pipeline.serving.live_tau import FleetCounters, since_last, since_live, window
from pipeline.serving.metrics import SpecCounters


def _counters(drafts: float, accepted: float) -> SpecCounters:
    return SpecCounters(drafts, drafts * 4, accepted)


def test_a_window_counts_from_its_start_or_from_a_restart() -> None:
    start = _counters(100, 150).to_json()
    assert window(_counters(120, 190), start) == SpecCounters(20, 80, 40)  # tau 3.0 over the window
    assert window(_counters(10, 25), start) == _counters(10, 25)  # restarted since: all it counted
    assert window(_counters(10, 25), None) == _counters(10, 25)  # no start: all it counted


def test_the_live_versions_tau_sums_the_replicas_that_run_it() -> None:
    """standin-0 and standin-1 run v3 since the deploy recorded their counters; standin-2 runs v2: not counted."""
    state = FleetState("3", 5, 0.0, tuple(ReplicaDeploy(name, v, 2.0, 1.0, False) for name, v in
                                          (("standin-0", "3"), ("standin-1", "3"), ("standin-2", "2"))), (),
                       {"standin-0": _counters(100, 150).to_json(), "standin-1": _counters(50, 50).to_json()})
    reading = FleetCounters({"standin-0": _counters(110, 170), "standin-1": _counters(60, 80),
                             "standin-2": _counters(500, 2000)}, {})
    assert since_live(state, reading, "3") == 1 + (20 + 30) / (10 + 10)
    assert since_live(state, FleetCounters({}, {"standin-0": "refused"}), "3") is None  # nothing counted


def test_the_sensors_window_is_each_replicas_since_its_last_tick() -> None:
    earlier = {"standin-0": _counters(100, 150).to_json(), "standin-1": _counters(50, 50).to_json()}
    reading = FleetCounters({"standin-0": _counters(110, 180), "standin-1": _counters(50, 50),
                             "standin-2": _counters(10, 30)}, {"standin-3": "connection refused"})
    # standin-1 counted no draft since; standin-2 had no earlier reading: neither has a window yet
    assert since_last(reading, earlier) == {"standin-0": 4.0}
    assert reading.to_json().keys() == {"standin-0", "standin-1", "standin-2"}  # the next tick's start
