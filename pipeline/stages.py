"""The stages of an RL step, one record each: what the assets, the launcher, the records and the ledger call them.

    stage        asset              launched worker (python -m)   container   a rank holds
    extraction   hidden_states      pipeline.sources.worker       extractor   the policy (target.split_devices GPUs)
    training     drafter            pipeline.training.worker      trainer     one GPU
    evaluation   acceptance         pipeline.evaluation.worker    evaluator   the policy
    refresh      refreshed_drafter  pipeline.refresh.worker       refresher   the policy
    deployment   fleet              (runs in the Dagster run)

A stage's ranks and its pod's resources are the configuration's `launch.<name>`. The store keeps a stage by
its name (placement keys and records, the cost ledger's seconds, a launched job), so a stored record reads the
same whatever this table holds besides.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str  # as the store and the launched jobs write it
    asset: str  # the Dagster asset that runs it
    worker: str | None = None  # the module its launched process runs; None: it runs in the Dagster run
    container: str = ""  # its container in a pod
    policy_per_rank: bool = False  # each rank loads the policy: a pod gives a rank a split policy's GPUs

    @property
    def launched(self) -> bool:
        return self.worker is not None

    @property
    def app(self) -> str:
        """Its pods' `app.kubernetes.io/name`."""
        return f"drafter-{self.name}"

    def __str__(self) -> str:
        return self.name


EXTRACTION = Stage("extraction", "hidden_states", "pipeline.sources.worker", "extractor", policy_per_rank=True)
TRAINING = Stage("training", "drafter", "pipeline.training.worker", "trainer")
EVALUATION = Stage("evaluation", "acceptance", "pipeline.evaluation.worker", "evaluator", policy_per_rank=True)
REFRESH = Stage("refresh", "refreshed_drafter", "pipeline.refresh.worker", "refresher", policy_per_rank=True)
DEPLOYMENT = Stage("deployment", "fleet")

STEP_STAGES = (EXTRACTION, TRAINING, EVALUATION, DEPLOYMENT)  # a step's own, in order: the cost ledger's columns
LAUNCHED = tuple(s for s in (*STEP_STAGES, REFRESH) if s.launched)  # those with a process of their own
BY_NAME = {s.name: s for s in (*STEP_STAGES, REFRESH)}


def stage_named(name: object, where: str = "") -> Stage:
    """The stage a stored record or a job names; ValueError (naming `where`) for any other name."""
    if isinstance(name, str) and name in BY_NAME:
        return BY_NAME[name]
    raise ValueError(f"{where + ': ' if where else ''}stage {name!r} is not one of {', '.join(BY_NAME)}")
