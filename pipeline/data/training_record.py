"""A step's training outcome as the drafter asset stores it: trained (and what it ended with), reused, or skipped."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeline.data.keys import drafter_key
from pipeline.data.records import flag, integer, integers, number, numbers, optional, read_record, text
from pipeline.data.store import ObjectStore


@dataclass(frozen=True)
class TrainingFigures:
    """What a training that ran ended with."""

    iterations: int
    resumed_from_iteration: int
    loss: float
    vloss: float
    ploss: float
    accuracy: float
    wall_s: float
    tokens_per_s: float
    loss_history: tuple[float, ...]

    def to_json(self) -> dict:
        return {**asdict(self), "loss_history": list(self.loss_history)}

    @classmethod
    def from_json(cls, doc: dict) -> TrainingFigures:
        return cls(*(integer(doc[f], f) for f in ("iterations", "resumed_from_iteration")),
                   *(number(doc[f], f) for f in ("loss", "vloss", "ploss", "accuracy", "wall_s", "tokens_per_s")),
                   numbers(doc["loss_history"], "loss_history"))


@dataclass(frozen=True)
class TrainingRecord:
    """A step's training stage: trained (and what), reused, or skipped, and why."""

    step: int
    trained: bool
    reason: str
    buffer_samples: int
    run_id: str | None = None
    version: str | None = None  # the registered drafter version this step's training produced or reused
    warm_start_version: str | None = None
    trained_on_steps: tuple[int, ...] = ()
    requested_by: str | None = None  # why a retraining was requested off the schedule (e.g. live tau too low)
    figures: TrainingFigures | None = None  # None: nothing ran at this step

    def to_json(self) -> dict:
        # the figures stand flat beside the outcome, as every stored record has them
        return {"step": self.step, "trained": self.trained, "reason": self.reason,
                "buffer_samples": self.buffer_samples, "run_id": self.run_id, "version": self.version,
                "warm_start_version": self.warm_start_version, "trained_on_steps": list(self.trained_on_steps),
                "requested_by": self.requested_by, **(self.figures.to_json() if self.figures else {})}

    @classmethod
    def from_json(cls, doc: dict) -> TrainingRecord:
        return cls(integer(doc["step"], "step"), flag(doc["trained"], "trained"), text(doc["reason"], "reason"),
                   integer(doc["buffer_samples"], "buffer_samples"), optional(doc.get("run_id"), text, "run_id"),
                   optional(doc.get("version"), text, "version"),
                   optional(doc.get("warm_start_version"), text, "warm_start_version"),
                   integers(doc.get("trained_on_steps", []), "trained_on_steps"),
                   optional(doc.get("requested_by"), text, "requested_by"),
                   TrainingFigures.from_json(doc) if "iterations" in doc else None)


def read_training(store: ObjectStore, run: str, step: int) -> TrainingRecord:
    return read_record(store, drafter_key(run, step), TrainingRecord)
