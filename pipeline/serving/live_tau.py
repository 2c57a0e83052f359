"""The fleet's live tau: the mean acceptance length its vLLM replicas count on the requests they serve (the
`vllm:spec_decode_*` counters of their /metrics), over a window between two readings of the counters.

Every reader goes through here: the deploy records the counters where the new version's window starts, the
training schedules take the champion's tau since it went live (`since_live`), and live_tau_sensor the tau of
each replica since its last tick (`since_last`). A replica restarted within a window counts from its start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.data.fleet_state import FleetState
from pipeline.serving.drivers import ReplicaSpec
from pipeline.serving.metrics import SpecCounters, scrape


@dataclass(frozen=True)
class FleetCounters:
    """The replicas' spec-decode counters at one moment: those read, in the fleet's order, and why the others were
    not."""

    counters: dict[str, SpecCounters]
    unreachable: dict[str, str]

    def to_json(self) -> dict[str, dict]:
        return {name: c.to_json() for name, c in self.counters.items()}


def read_counters(replicas: list[ReplicaSpec]) -> FleetCounters:
    """Each replica's counters now; an unreachable one has no say, and its error is kept."""
    counters, unreachable = {}, {}
    for replica in replicas:
        try:
            counters[replica.name] = scrape(replica)
        except OSError as exc:
            unreachable[replica.name] = str(exc)
    return FleetCounters(counters, unreachable)


def window(now: SpecCounters, start: Mapping | None) -> SpecCounters:
    """What a replica counted since `start` (its counters then, as JSON); all it counted when it has no start or
    restarted since (its counters are below the start's)."""
    if start is None or now.drafts < start["drafts"]:
        return now
    return now - SpecCounters.from_json(start)


def since_live(state: FleetState, reading: FleetCounters, version: str) -> float | None:
    """The live tau of `version` since it went live: the windows of the replicas that run it, from the counters the
    deploy recorded (`state.live_counters`), summed; None when no replica has counted a draft of it."""
    running = {r.replica for r in state.replicas if r.version == version}
    total = SpecCounters()
    for name, now in reading.counters.items():
        if name in running:
            total += window(now, state.live_counters.get(name))
    return total.mean_acceptance_length


def since_last(reading: FleetCounters, earlier: Mapping[str, Mapping]) -> dict[str, float]:
    """Each replica's live tau since `earlier` (the counters of the last reading, as JSON), for the replicas that
    were read then and counted a draft since."""
    taus = {}
    for name, now in reading.counters.items():
        if name in earlier and (tau := window(now, earlier[name]).mean_acceptance_length) is not None:
            taus[name] = tau
    return taus
