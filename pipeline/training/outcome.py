"""What a step's training stage ended with: trained (and what), reused, or skipped, and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.data.keys import drafter_key
from pipeline.data.records import write_record
from pipeline.data.store import ObjectStore
from pipeline.data.training_record import TrainingFigures, TrainingRecord

if TYPE_CHECKING:  # the orchestrator reads outcomes without importing the training's model code
    from pipeline.training.loop import TrainResult


@dataclass(frozen=True)
class TrainOutcome:
    trained: bool
    reason: str
    buffer_samples: int
    run_id: str | None = None
    version: str | None = None
    warm_start_version: str | None = None
    result: TrainResult | None = None
    trained_on_steps: tuple[int, ...] = ()
    requested_by: str | None = None  # why a retraining was requested off the schedule (e.g. live tau too low)

    def record(self, step: int) -> TrainingRecord:
        """What later stages (and people) need to know about this step's training."""
        figures = None
        if self.result:
            r = self.result
            figures = TrainingFigures(r.iterations, r.resumed_from_iteration, r.loss, r.vloss, r.ploss, r.accuracy,
                                      r.wall_s, r.tokens_per_s, tuple(r.loss_history))
        return TrainingRecord(step, self.trained, self.reason, self.buffer_samples, self.run_id, self.version,
                              self.warm_start_version, tuple(self.trained_on_steps), self.requested_by, figures)


def outcome_metadata(outcome: TrainOutcome) -> dict[str, str | int | float | bool]:
    """What an operator reads on the drafter asset (plain values: Dagster and Dagster Pipes both take them)."""
    metadata: dict[str, str | int | float | bool] = {
        "trained": outcome.trained, "reason": outcome.reason, "buffer_samples": outcome.buffer_samples}
    if outcome.requested_by:
        metadata["retrain_requested_by"] = outcome.requested_by
    if outcome.trained and outcome.result:
        metadata.update({
            "mlflow_run_id": outcome.run_id or "", "model_version": outcome.version or "",
            "trained_on_steps": str(sorted(outcome.trained_on_steps)),
            "warm_start_version": outcome.warm_start_version or "none (fresh)",
            "iterations": outcome.result.iterations, "resumed_from_iteration": outcome.result.resumed_from_iteration,
            "final_loss": round(outcome.result.loss, 4), "token_accuracy": round(outcome.result.accuracy, 4),
            "tokens_per_s": round(outcome.result.tokens_per_s, 1),
        })
    return metadata


def write_outcome(store: ObjectStore, run: str, step: int, outcome: TrainOutcome) -> TrainingRecord:
    record = outcome.record(step)
    write_record(store, drafter_key(run, step), record)
    return record
