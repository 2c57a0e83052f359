"""The orchestrator's half of a training: decide, identify the inputs, and hand the training
process a job (or record why there is nothing to train).

`plan_training` only reads (the buffer, the policy pointer, the registry); `settle_plan`
is where the plan touches MLflow: it finishes what a killed attempt left registered, or
reopens the run an unfinished attempt left behind.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

from pipeline.accounting.cost import read_cost
from pipeline.config import PipelineConfig, TrainConfig, parse_resolved_config
from pipeline.data import order
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.acceptance_record import read_acceptance
from pipeline.data.buffer import read_buffer
from pipeline.data.buffer_record import BufferEntry, composition
from pipeline.data.keys import acceptance_key, drafter_key
from pipeline.data.refresh_record import read_refresh
from pipeline.data.store import ObjectStore
from pipeline.data.training_record import read_training
from pipeline.registry import DrafterRegistry
from pipeline.training.outcome import TrainOutcome
from pipeline.training.schedule import (
    LiveTau,
    ScheduleInputs,
    StepHistory,
    TrainingDecision,
    gather_inputs,
    schedule_decision,
)


def training_decision(
    step: int, buffer_samples: int, cfg: TrainConfig, requested_by: str | None = None,
    inputs: ScheduleInputs | None = None, superseded_by: int | None = None,
) -> TrainingDecision:
    """FastRL's trigger, or the configured schedule's, once the buffer holds `min_samples`. A newer step
    committed while this one waited supersedes its training (its hidden states enter that step's buffer); a
    request (e.g. live tau below its floor) overrides the schedule, not the buffer's size."""
    if not cfg.enable_drafter_training:
        return TrainingDecision(False, "train.enable_drafter_training is false")
    if superseded_by is not None:
        return TrainingDecision(False, f"superseded: step {superseded_by} was committed while this step waited, "
                                       "and trains on the newer buffer")
    if requested_by and buffer_samples >= cfg.min_samples:
        return TrainingDecision(True, f"requested ({requested_by}); buffer holds {buffer_samples} samples")
    scheduled = schedule_decision(cfg.schedule.kind, step, cfg.training_interval_steps, cfg.schedule.tau_drop,
                                  inputs or ScheduleInputs(None, 0, None, None))
    if not scheduled.train:
        return scheduled
    if buffer_samples < cfg.min_samples:
        return TrainingDecision(
            False, f"buffer holds {buffer_samples} samples, fewer than train.min_samples={cfg.min_samples}")
    why = "" if cfg.schedule.kind == "interval" else f"{scheduled.reason}; "
    return replace(scheduled, reason=f"{why}buffer holds {buffer_samples} samples")


# Where a training runs, whether its ranks shard the drafter (the same steps, up to float rounding),
# how often and how it saves and how often it reports do not change what it learns: kept out of its identity.
_PLACEMENT_KEYS = {"checkpoint_every", "log_every", "checkpoint_background", "parallelism", "fsdp_memory_share",
                   "fsdp_units", "gpu_memory_gb"}


def _identity_settings(cfg: PipelineConfig) -> dict:
    """The training settings an identity digests: `train` less placement, and the world the training runs on
    (its ranks per node and nodes split every batch into the ranks' shares), under the names the identities in
    the registry give them. Those identities digest `launch.warm_idle_s` too: without it every trained step
    would get a new identity, and its rerun would train again instead of finding its version."""
    launch = cfg.launch
    return {**cfg.train.model_dump(exclude=_PLACEMENT_KEYS), "nproc_per_node": launch.training.nproc,
            "nnodes": launch.training.nnodes, "warm_idle_s": launch.warm_idle_s}


def input_identity(
    cfg: PipelineConfig, entries: list[BufferEntry], policy_uri: str, requested_by: str | None = None
) -> str:
    """The data and settings a training depends on, and the request that asked for it off the
    schedule: a retraining must not find the version the step's scheduled training registered.
    The warm start is left out on purpose: a rerun of a step finds the champion that step itself
    promoted, yet trains on the same data."""
    doc = {
        "run": cfg.run, "train": _identity_settings(cfg), "drafter": cfg.drafter.model_dump(),
        # Samples by id, not by shard file: rewriting a step's shards gives new file names.
        "samples": [(e.step, e.sample_id) for e in entries], "policy": policy_uri,
    }
    if requested_by:
        doc["requested_by"] = requested_by
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class RefreshSpec:
    """What makes a training a same-step refresh: it reads the buffer of its own namespace (`data_run`), the
    step's policy from its parts (the step is not committed yet), and registers a version no alias follows."""

    part: int  # the qualifying part
    data_run: str  # keys.refresh_data_run: its hidden states and buffer
    checkpoint_uri: str
    policy_version: int
    model_id: str


@dataclass(frozen=True)
class TrainJob:
    """One training as the training process receives it (JSON: Dagster Pipes extras or a file).

    The orchestrator decides, names the MLflow run and fixes the warm start; the training
    process (every rank) rebuilds everything else from the config and the store.
    """

    step: int
    config: dict  # the full PipelineConfig, resolved (the process may not see the orchestrator's files)
    run_id: str | None  # the MLflow run an earlier attempt left unfinished; None: rank 0 starts one
    input_id: str
    reason: str
    warm_start_version: str | None  # the champion when the training was first decided
    tags: dict[str, str] = field(default_factory=dict)  # of a new MLflow run
    requested_by: str | None = None  # why a retraining was requested off the schedule
    refresh: RefreshSpec | None = None  # a same-step refresh; None: the step's own training

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: object) -> TrainJob:
        if not isinstance(doc, dict):
            raise ValueError(f"no training job: the Pipes extra `job` is a {type(doc).__name__}")
        optional = {"tags", "requested_by", "refresh"}
        missing = sorted({f.name for f in fields(cls) if f.name not in optional} - set(doc))
        if missing:
            raise ValueError(f"training job is missing {', '.join(missing)}")
        values = {f.name: doc[f.name] for f in fields(cls) if f.name in doc}
        if values.get("refresh") is not None:
            values["refresh"] = RefreshSpec(**values["refresh"])
        return cls(**values)

    @functools.cached_property
    def pipeline_config(self) -> PipelineConfig:
        """The job's configuration, parsed at its first use and kept with the job."""
        return parse_resolved_config(self.config, f"the training job of step {self.step}")


@dataclass(frozen=True)
class RegisteredVersion:
    """A version already trained on a plan's inputs, and whether the run that trained it finished."""

    version: str
    run_id: str
    run_finished: bool


@dataclass(frozen=True)
class TrainingPlan:
    step: int
    train: bool
    reason: str
    buffer_samples: int
    requested_by: str | None = None
    input_id: str = ""
    champion: str | None = None  # the warm start of a new training
    trained_on_steps: tuple[int, ...] = ()
    existing: RegisteredVersion | None = None  # a rerun on identical inputs: nothing to train
    unfinished_run: str | None = None  # the MLflow run of an attempt that died: its training carries on


def plan_training(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, requested_by: str | None = None,
    coalesce: bool = False, live_tau: Callable[[str], float | None] | None = None,
) -> TrainingPlan:
    """Skip (with the reason), reuse a version trained on identical inputs, or train; reads only. With
    `coalesce` (a run the sensor asked for, not a backfill) a newer committed step supersedes this one's training.
    `live_tau`: the fleet's live tau of a version (None: the fleet does not run it), which the `acceptance` and
    `cost` schedules take for the champion's tau now."""
    entries = list(read_buffer(store, cfg.run, step).entries)
    newer = order.committed_after(store, cfg.run, step) if coalesce else []  # by commit time, not number
    inputs = None if cfg.train.schedule.kind == "interval" else schedule_inputs(store, cfg, step, registry, live_tau)
    decision = training_decision(step, len(entries), cfg.train, requested_by, inputs, newer[-1] if newer else None)
    if not decision.train:
        return TrainingPlan(step, False, decision.reason, len(entries), requested_by)
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    identity = input_identity(cfg, entries, pointer.checkpoint_uri, requested_by)
    existing = registry.find_version({"input_id": identity})
    registered = None
    if existing:
        run_id = registry.client.get_model_version(registry.model_name, existing).run_id
        registered = RegisteredVersion(existing, run_id, registry.run_finished(run_id))
    return TrainingPlan(
        step, True, decision.reason, len(entries), requested_by, identity, registry.alias_version("champion"),
        tuple(composition(entries)), registered,
        None if registered else registry.unfinished_run({"input_id": identity}),
    )


SCHEDULE_HISTORY_STEPS = 100  # records a decision reads: a champion promoted earlier counts as unknown (train)


def schedule_inputs(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry,
    live_tau: Callable[[str], float | None] | None = None,
) -> ScheduleInputs:
    """What the `acceptance` and `cost` schedules read, gathered in one pass: the earlier steps' records (each read
    once), the step's rollout tokens, the champion and its live tau; `schedule.gather_inputs` makes the inputs of
    them."""
    earlier = order.committed_before(store, cfg.run, step)[-SCHEDULE_HISTORY_STEPS:]
    tokens = sum(sum(r.loss_mask) for r in rollouts_lib.read_rollouts(store, cfg.run, step))
    champion = registry.alias_version("champion")
    tau = live_tau(champion) if live_tau is not None and champion is not None else None
    return gather_inputs(read_history(store, cfg.run, earlier), step, tokens, champion,
                         None if tau is None else LiveTau(champion, tau), cfg.train.schedule.kind,
                         cfg.fleet.live_tau_floor)


def read_history(store: ObjectStore, run: str, steps: list[int]) -> list[StepHistory]:
    """What each of `steps` recorded (its training, refresh, acceptance and cost), each record read once."""
    return [StepHistory(s, read_training(store, run, s) if store.exists(drafter_key(run, s)) else None,
                        read_refresh(store, run, s),
                        read_acceptance(store, run, s) if store.exists(acceptance_key(run, s)) else None,
                        read_cost(store, run, s))
            for s in steps]


def settle_plan(
    plan: TrainingPlan, cfg: PipelineConfig, registry: DrafterRegistry, tags: dict[str, str]
) -> TrainOutcome | TrainJob:
    """The step's outcome when there is nothing to train, else the training process's job: with
    the MLflow run an earlier attempt left unfinished, or none (rank 0 starts one once the drafter
    is built, so a refused warm start leaves no run behind)."""
    if not plan.train:
        return TrainOutcome(False, plan.reason, plan.buffer_samples, requested_by=plan.requested_by)
    if plan.existing:  # a rerun of the same partition on the same inputs: no second run, no second version
        if not plan.existing.run_finished:  # killed after registering: finish what it started
            publish_challenger(registry, plan.existing.version)
            registry.end_run(plan.existing.run_id, ok=True)
        return TrainOutcome(True, f"reused version {plan.existing.version}, trained on identical inputs",
                            plan.buffer_samples, plan.existing.run_id, plan.existing.version, plan.champion,
                            trained_on_steps=plan.trained_on_steps, requested_by=plan.requested_by)
    if plan.unfinished_run:  # an earlier attempt died: its run (and its checkpoint) carry on
        registry.reopen_run(plan.unfinished_run, tags)
    return TrainJob(plan.step, cfg.model_dump(mode="json"), plan.unfinished_run, plan.input_id, plan.reason,
                    plan.champion, tags, plan.requested_by)


def publish_challenger(registry: DrafterRegistry, version: str) -> None:
    """A newly registered version is the challenger; the first one ever is also the baseline."""
    registry.set_alias("challenger", version)
    if registry.alias_version("baseline") is None:
        registry.set_alias("baseline", version)
