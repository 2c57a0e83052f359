"""Where a launched stage of a step ran, as its worker records it (placement/<run>/step-N/<stage>.json)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.data.keys import placement_key
from pipeline.data.records import integer, number, read_record, typed
from pipeline.data.store import ObjectStore
from pipeline.stages import STEP_STAGES, Stage, stage_named


@dataclass(frozen=True)
class StagePlacement:
    """Where a launched stage of a step ran, as its worker measured it."""

    stage: Stage  # stored by its name
    where: str  # process (a subprocess of the Dagster run) | pod (a Kubernetes pod) | ray (a Ray job on a cluster)
    ranks: int
    device: str  # the torch device of rank 0, with the GPU's name on CUDA
    peak_memory_bytes: int  # the largest rank's peak: resident host memory, or allocated GPU memory on CUDA
    seconds: float  # wall time of the stage's work in its worker, from start-up to its result
    waited_s: float = 0.0  # a Ray job: submitted -> its process started (waiting for its resources, then its start)

    def metadata(self) -> dict[str, str | int | float]:
        """The figures as a materialization shows them."""
        return {"ran_in": self.where, "ranks": self.ranks, "device": self.device,
                "peak_memory_gb": round(self.peak_memory_bytes / 1e9, 3), "stage_seconds": round(self.seconds, 2),
                "waited_seconds": round(self.waited_s, 2)}

    def to_json(self) -> dict:
        return {"stage": self.stage.name, "where": self.where, "ranks": self.ranks, "device": self.device,
                "peak_memory_bytes": self.peak_memory_bytes, "seconds": self.seconds, "waited_s": self.waited_s}

    @classmethod
    def from_json(cls, doc: dict) -> StagePlacement:
        return cls(stage_named(doc["stage"], "stage placement"), typed(doc["where"], str, "where"),
                   integer(doc["ranks"], "ranks"), typed(doc["device"], str, "device"),
                   integer(doc["peak_memory_bytes"], "peak_memory_bytes"), number(doc["seconds"], "seconds"),
                   number(doc.get("waited_s", 0.0), "waited_s"))  # a record without it: its stage never queued


def read_placements(store: ObjectStore, run: str, step: int) -> tuple[StagePlacement, ...]:
    """The placements the step's launched stages recorded, in stage order."""
    keys = [placement_key(run, step, stage) for stage in STEP_STAGES if stage.launched]
    return tuple(read_record(store, key, StagePlacement) for key in keys if store.exists(key))
