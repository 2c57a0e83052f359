"""One drafter training of the co-training loop: decide, warm-start, train, register."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from pipeline.config import PipelineConfig, TrainConfig, parse_config
from pipeline.data import rollouts as rollouts_lib
from pipeline.data import shards
from pipeline.data.buffer import BufferEntry, composition, iter_buffer_samples, read_buffer
from pipeline.data.keys import drafter_key
from pipeline.data.shards import HiddenSample
from pipeline.data.store import ObjectStore, open_store
from pipeline.models import drafter as drafters
from pipeline.models import target as target_lib
from pipeline.models.checkpoint import load_drafter, save_drafter
from pipeline.registry import DrafterRegistry, MetricsBatcher
from pipeline.training.dataset import BufferDataset
from pipeline.training.distributed import DistContext, broadcast_state, rank_device
from pipeline.training.loop import NullSink, TrainResult, train_drafter
from pipeline.training.state import ResumeState, TrainingCheckpoints, checkpoint_prefix


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

    def record(self, step: int) -> dict:
        """What later stages (and people) need to know about this step's training."""
        out = {"step": step, "trained": self.trained, "reason": self.reason, "buffer_samples": self.buffer_samples,
               "run_id": self.run_id, "version": self.version, "warm_start_version": self.warm_start_version,
               "trained_on_steps": list(self.trained_on_steps)}
        if self.result:
            out.update(iterations=self.result.iterations, resumed_from_iteration=self.result.resumed_from_iteration,
                       loss=self.result.loss, vloss=self.result.vloss,
                       ploss=self.result.ploss, accuracy=self.result.accuracy, wall_s=self.result.wall_s,
                       tokens_per_s=self.result.tokens_per_s, loss_history=self.result.loss_history)
        return out


def outcome_metadata(outcome: TrainOutcome) -> dict[str, str | int | float | bool]:
    """What an operator reads on the drafter asset (plain values: Dagster and Dagster Pipes both take them)."""
    metadata: dict[str, str | int | float | bool] = {
        "trained": outcome.trained, "reason": outcome.reason, "buffer_samples": outcome.buffer_samples}
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


def write_outcome(store: ObjectStore, run: str, step: int, outcome: TrainOutcome) -> dict:
    record = outcome.record(step)
    store.write_json(drafter_key(run, step), record)
    return record


def read_outcome(store: ObjectStore, run: str, step: int) -> dict:
    return store.read_json(drafter_key(run, step))


def training_decision(
    step: int, buffer_samples: int, cfg: TrainConfig, requested_by: str | None = None
) -> tuple[bool, str]:
    """FastRL's trigger: every `training_interval_steps`, once the buffer holds `min_samples`;
    a request (e.g. live tau below its floor) overrides the interval, not the other two."""
    if not cfg.enable_drafter_training:
        return False, "train.enable_drafter_training is false"
    if requested_by and buffer_samples >= cfg.min_samples:
        return True, f"requested ({requested_by}); buffer holds {buffer_samples} samples"
    if step % cfg.training_interval_steps:
        return False, f"step {step} is not a multiple of train.training_interval_steps={cfg.training_interval_steps}"
    if buffer_samples < cfg.min_samples:
        return False, f"buffer holds {buffer_samples} samples, fewer than train.min_samples={cfg.min_samples}"
    return True, f"buffer holds {buffer_samples} samples"


# Where a training runs and how often it saves do not change what it learns: kept out of its identity.
_PLACEMENT_KEYS = {"launcher", "k8s", "checkpoint_every"}


def input_identity(cfg: PipelineConfig, entries: list[BufferEntry], policy_uri: str) -> str:
    """The data and settings a training depends on. The warm start is left out on purpose: a
    rerun of a step finds the champion that step itself promoted, yet trains on the same data."""
    doc = {
        "run": cfg.run, "train": cfg.train.model_dump(exclude=_PLACEMENT_KEYS), "drafter": cfg.drafter.model_dump(),
        # Samples by id, not by shard file: rewriting a step's shards gives new file names.
        "samples": [(e.step, e.sample_id) for e in entries], "policy": policy_uri,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def _token_counts(hidden: Iterable[HiddenSample], vocab_size: int) -> torch.Tensor:
    """How often each token is a response token: EAGLE-3's draft vocabulary is the most frequent."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in hidden:
        counts += torch.bincount(s.input_ids[s.loss_mask.bool()], minlength=vocab_size)
    return counts


def _initial_drafter(
    cfg: PipelineConfig, registry: DrafterRegistry, champion: str | None, target, hidden: Iterable[HiddenSample]
) -> tuple[drafters.Drafter, str | None]:
    """The champion if it is of the configured kind, else `drafter.warm_start`, else a fresh drafter."""
    if champion:
        drafter = registry.load(champion)
        if drafter.kind == cfg.drafter.kind:
            return drafter, champion
    if cfg.drafter.warm_start:
        drafter = load_drafter(Path(cfg.drafter.warm_start), target.config.num_hidden_layers)
        if drafter.kind != cfg.drafter.kind:
            raise ValueError(f"drafter.warm_start {cfg.drafter.warm_start} is not a {cfg.drafter.kind} checkpoint")
        return drafter, f"file:{cfg.drafter.warm_start}"
    counts = _token_counts(hidden, target.config.vocab_size)
    return drafters.fresh_drafter(cfg.drafter, target, counts, cfg.train.seed), None


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> TrainJob:
        missing = sorted({f.name for f in fields(cls) if f.name != "tags"} - set(doc))
        if missing:
            raise ValueError(f"training job is missing {', '.join(missing)}")
        return cls(**{f.name: doc[f.name] for f in fields(cls) if f.name in doc})

    @property
    def pipeline_config(self) -> PipelineConfig:
        return parse_config(self.config)


def plan_training(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, tags: dict[str, str],
    requested_by: str | None = None,
) -> TrainOutcome | TrainJob:
    """The orchestrator's half: skip (with the reason), reuse a version trained on identical
    inputs, or a job for the training process: with the MLflow run an earlier attempt left
    unfinished, or none (rank 0 starts one once the drafter is built, so a refused warm start
    leaves no run behind)."""
    entries = read_buffer(store, cfg.run, step)
    trained, reason = training_decision(step, len(entries), cfg.train, requested_by)
    if not trained:
        return TrainOutcome(False, reason, len(entries))
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    champion = registry.alias_version("champion")
    identity = input_identity(cfg, entries, pointer.checkpoint_uri)
    existing = registry.find_version({"input_id": identity})
    if existing:  # a rerun of the same partition on the same inputs: no second run, no second version
        run_id = registry.client.get_model_version(registry.model_name, existing).run_id
        if not registry.run_finished(run_id):  # killed after registering: finish what it started
            _publish(registry, existing)
            registry.end_run(run_id, ok=True)
        return TrainOutcome(True, f"reused version {existing}, trained on identical inputs", len(entries),
                            run_id, existing, champion, trained_on_steps=tuple(composition(entries)))
    run_id = registry.unfinished_run({"input_id": identity})
    if run_id:  # an earlier attempt died: its run (and its checkpoint) carry on
        registry.reopen_run(run_id, tags)
    return TrainJob(step, cfg.model_dump(mode="json"), run_id, identity, reason, champion, tags)


def run_training(
    job: TrainJob, ctx: DistContext | None = None, progress: Callable[[str], None] | None = None
) -> TrainOutcome | None:
    """The training process's half, on every rank: warm-start, train (resuming from the last
    checkpoint), and on rank 0 register the drafter, write the outcome and end the run.
    Returns the outcome on rank 0, None on the others."""
    ctx, progress = ctx or DistContext(), progress or (lambda _: None)
    cfg, step = job.pipeline_config, job.step
    store = open_store(cfg)
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.artifact_root)
    device = rank_device(ctx, cfg.device)
    entries = read_buffer(store, cfg.run, step)
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    checkpoints = TrainingCheckpoints(store, checkpoint_prefix(cfg.run, job.input_id))
    # A resumed training keeps the warm start it began with (its vocabulary maps are in the checkpoint).
    origin_key = f"{checkpoints.prefix}/origin.json"
    origin = store.read_json(origin_key) if store.exists(origin_key) else {"champion": job.warm_start_version}
    target = target_lib.load_policy(store, pointer.checkpoint_uri, device, target_lib.load_settings(cfg))
    # A generator: only a fresh drafter reads the buffer (once, streamed) for its token counts, and
    # only on rank 0: the other ranks get rank 0's weights and vocabulary below.
    hidden = iter_buffer_samples(store, cfg.run, entries) if ctx.is_main else iter(())
    drafter, warm_start = _initial_drafter(cfg, registry, origin["champion"], target, hidden)
    if ctx.is_main and not store.exists(origin_key):
        store.write_json(origin_key, {"champion": origin["champion"], "warm_start": warm_start})
    found = checkpoints.latest() if cfg.train.checkpoint_every else None
    if found:
        # The checkpoint's vocabulary maps decide the teacher's rows, so they are in place before it is built.
        drafter.load_state_dict(checkpoints.model_weights(found[1]), strict=False)
        progress(f"resuming from the checkpoint at iteration {found[0].iteration} of {found[0].total_iterations}")
    drafter.attach(target)
    broadcast_state(drafter.to(device).trainable_state_dict(), ctx)  # before the teacher reads the vocabulary
    num_layers = target.config.num_hidden_layers
    for step_in_buffer in sorted({e.step for e in entries}):
        manifest = shards.read_manifest(store, cfg.run, step_in_buffer)
        drafters.check_layers(drafter, manifest.layer_ids, num_layers, f"hidden states of step {step_in_buffer}")
    data = BufferDataset(store, cfg.run, entries, lambda s: drafter.training_sample(s, num_layers),
                         cfg.train.max_unreadable_share)

    run_id = job.run_id
    if ctx.is_main and run_id is None:
        run_id = registry.start_run(f"drafter-step-{step:06d}", {**job.tags, "input_id": job.input_id})
    sink = NullSink()
    try:
        if ctx.is_main:
            registry.log_params(run_id, {  # a continued run keeps what its first attempt logged
                **cfg.train.model_dump(exclude={"optim", "k8s"}),
                **{f"optim.{k}": v for k, v in cfg.train.optim.model_dump().items()},
                **{f"drafter.{k}": v for k, v in cfg.drafter.model_dump().items()},
                "warm_start_version": warm_start or "none", "world_size": ctx.world_size,
                "policy_version": pointer.policy_version, "buffer_samples": len(entries),
            })
            # Metrics reach MLflow when a checkpoint commits: a resumed run never logs an iteration twice.
            sink = MetricsBatcher(registry.client, run_id, flush_every=1 << 62 if cfg.train.checkpoint_every else 200)

        def committed(state: ResumeState) -> None:
            sink.flush()
            progress(f"checkpoint at iteration {state.iteration} of {state.total_iterations}, "
                     f"loss {state.loss_history[-1]:.4f}")

        result = train_drafter(
            drafter, data, cfg.train, sink, device, drafter.teacher(target), ctx=ctx,
            checkpoints=checkpoints if cfg.train.checkpoint_every else None, on_checkpoint=committed,
        )
        if not ctx.is_main:
            return None
        result = replace(result, samples=data.samples_read)  # what was read, not what the buffer lists
        registry.log_params(run_id, {"samples_read": data.samples_read, "samples_unreadable": data.unreadable_samples})
        sink.flush()
        version = _register(registry, job, run_id, cfg, entries, drafter, warm_start,
                            target_lib.TargetMetadata.of(target.config), result.samples)
        registry.end_run(run_id, ok=True)
    except BaseException:
        if ctx.is_main:
            registry.end_run(run_id, ok=False)
        raise
    checkpoints.clear()  # the registered version is the result now
    outcome = TrainOutcome(True, job.reason, len(entries), run_id, version, warm_start, result,
                           tuple(composition(entries)))
    write_outcome(store, cfg.run, step, outcome)
    return outcome


def _register(
    registry: DrafterRegistry, job: TrainJob, run_id: str, cfg: PipelineConfig, entries: list[BufferEntry],
    drafter: drafters.Drafter, warm_start: str | None, target: target_lib.TargetMetadata, samples_read: int,
) -> str:
    """One version per input identity, even when a process died between registering and finishing."""
    version = registry.find_version({"input_id": job.input_id})
    if version is None:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = save_drafter(drafter, Path(tmp) / "drafter", target)
            steps = list(composition(entries))
            version = registry.register(run_id, checkpoint, {
                "rl_step": str(job.step), "pipeline_run": cfg.run, "trained_on_steps": json.dumps(steps),
                "train_samples": str(samples_read), "warm_start_version": warm_start or "none",
                "input_id": job.input_id, "drafter_kind": cfg.drafter.kind,
            }, description=f"{cfg.drafter.kind} drafter trained at RL step {job.step} of run {cfg.run} on "
               f"{samples_read} samples of steps {steps}, warm-started from "
               f"{f'version {warm_start}' if warm_start else 'a fresh initialisation'}.")
    _publish(registry, version)
    return version


def _publish(registry: DrafterRegistry, version: str) -> None:
    registry.set_alias("challenger", version)
    if registry.alias_version("baseline") is None:
        registry.set_alias("baseline", version)


def train_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, tags: dict[str, str],
    requested_by: str | None = None,
) -> TrainOutcome:
    """Decide and train in this process (benchmarks, notebooks); the drafter asset launches
    `run_training` as its own process instead."""
    planned = plan_training(store, cfg, step, registry, tags, requested_by)
    if isinstance(planned, TrainOutcome):
        write_outcome(store, cfg.run, step, planned)
        return planned
    outcome = run_training(planned)
    if outcome is None:
        raise RuntimeError("train_step runs one process, which is rank 0: set no RANK in its environment")
    return outcome
