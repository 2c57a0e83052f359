"""The training process's half of one drafter training: warm-start, train, register.

`plan.plan_training` and `plan.settle_plan` decide in the orchestrator; `run_training` runs
on every rank of the training process; `train_step` does both in one process.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pipeline.config import PipelineConfig, TrainConfig
from pipeline.data import rollouts as rollouts_lib
from pipeline.data import shards
from pipeline.data.buffer import iter_buffer_samples, read_buffer
from pipeline.data.buffer_record import BufferEntry, composition
from pipeline.data.keys import step_key, training_origin_key, training_prefix
from pipeline.data.rollouts import PolicyPointer
from pipeline.data.shard_format import HiddenSample
from pipeline.data.store import ObjectStore, open_store
from pipeline.models import drafter as drafters
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.models.checkpoint import load_drafter, save_drafter, target_fields
from pipeline.registry import DrafterRegistry, MetricsBatcher, open_registry
from pipeline.training.dataset import BufferDataset
from pipeline.training.distributed import DistContext, broadcast_state, rank_device
from pipeline.training.loop import MetricsSink, NullSink, TrainResult, train_drafter
from pipeline.training.outcome import TrainOutcome, write_outcome
from pipeline.training.plan import TrainJob, plan_training, publish_challenger, settle_plan
from pipeline.training.state import ResumeState, TrainingCheckpoints


def _token_counts(hidden: Iterable[HiddenSample], vocab_size: int) -> torch.Tensor:
    """How often each token is a response token: EAGLE-3's draft vocabulary is the most frequent."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in hidden:
        counts += torch.bincount(s.input_ids[s.loss_mask.bool()], minlength=vocab_size)
    return counts


def _initial_drafter(
    cfg: PipelineConfig, registry: DrafterRegistry, champion: str | None, target, hidden: Iterable[HiddenSample]
) -> tuple[drafters.Drafter, str | None]:
    """The champion if it can start the configured kind (its own, or EAGLE-3 for P-EAGLE), else
    `drafter.warm_start`, else a fresh drafter."""
    if champion:
        drafter = drafters.warm_start_from(registry.load(champion), cfg.drafter)
        if drafter is not None:
            return drafter, champion
    if cfg.drafter.warm_start:
        loaded = load_drafter(Path(cfg.drafter.warm_start), target.config.num_hidden_layers)
        drafter = drafters.warm_start_from(loaded, cfg.drafter)
        if drafter is None:
            raise ValueError(f"drafter.warm_start {cfg.drafter.warm_start} is a {loaded.kind} checkpoint, "
                             f"which cannot start a {cfg.drafter.kind} drafter")
        target_fields(drafter, target_forward.TargetMetadata.of(target.config))  # refused before training
        return drafter, f"file:{cfg.drafter.warm_start}"
    counts = _token_counts(hidden, target.config.vocab_size)
    return drafters.fresh_drafter(cfg.drafter, target, counts, cfg.train.seed), None


@dataclass(frozen=True)
class _Inputs:
    """What every rank of one training reads before it trains."""

    cfg: PipelineConfig
    store: ObjectStore
    entries: list[BufferEntry]
    pointer: PolicyPointer
    device: str
    data_run: str  # where the buffer and its hidden states are: the run's, or a refresh's own namespace


def _read_inputs(job: TrainJob, ctx: DistContext) -> _Inputs:
    cfg = job.pipeline_config
    store = open_store(cfg)
    if job.refresh:  # the step is not committed yet: its policy is the one its parts named
        spec = job.refresh
        pointer = PolicyPointer(spec.policy_version, spec.checkpoint_uri, spec.model_id)
        return _Inputs(cfg, store, list(read_buffer(store, spec.data_run, job.step).entries), pointer,
                       rank_device(ctx, cfg.device), spec.data_run)
    return _Inputs(cfg, store, list(read_buffer(store, cfg.run, job.step).entries),
                   rollouts_lib.read_policy_pointer(store, cfg.run, job.step), rank_device(ctx, cfg.device), cfg.run)


def _warm_started_drafter(
    job: TrainJob, inputs: _Inputs, registry: DrafterRegistry, target, ctx: DistContext
) -> tuple[drafters.Drafter, str | None]:
    """The drafter a training starts from; a resumed training keeps the warm start it began with
    (its vocabulary maps are in the checkpoint), recorded by rank 0 in the training's origin."""
    cfg, store = inputs.cfg, inputs.store
    origin_key = training_origin_key(cfg.run, job.input_id)
    champion = job.warm_start_version
    if store.exists(origin_key):
        # Read back as any stored record: what it names is looked up in the registry and loaded as the start.
        origin = store.read_json(origin_key)
        champion = origin.get("champion") if isinstance(origin, dict) else ""
        if champion is not None and not (isinstance(champion, str) and champion.isdigit()):
            raise ValueError(f"{store.uri(origin_key)}: field champion must be a registered version number or null")
    # A generator: only a fresh drafter reads the buffer (once, streamed) for its token counts, and
    # only on rank 0: the other ranks get rank 0's weights and vocabulary later.
    hidden = iter_buffer_samples(store, inputs.data_run, inputs.entries) if ctx.is_main else iter(())
    drafter, warm_start = _initial_drafter(cfg, registry, champion, target, hidden)
    if ctx.is_main and not store.exists(origin_key):
        store.write_json(origin_key, {"champion": champion, "warm_start": warm_start})
    return drafter, warm_start


def _check_buffer_layers(drafter: drafters.Drafter, inputs: _Inputs, num_layers: int) -> None:
    """Every step in the buffer stored the target layers this drafter reads."""
    for step_in_buffer in sorted({e.step for e in inputs.entries}):
        manifest = shards.read_manifest(inputs.store, inputs.data_run, step_in_buffer)
        drafters.check_layers(drafter, manifest.layer_ids, num_layers, f"hidden states of step {step_in_buffer}")


def _run_params(inputs: _Inputs, warm_start: str | None, ctx: DistContext) -> dict[str, object]:
    cfg = inputs.cfg
    return {
        **cfg.train.model_dump(exclude={"optim", "k8s"}),
        **{f"optim.{k}": v for k, v in cfg.train.optim.model_dump().items()},
        **{f"drafter.{k}": v for k, v in cfg.drafter.model_dump().items()},
        "warm_start_version": warm_start or "none", "world_size": ctx.world_size,
        "policy_version": inputs.pointer.policy_version, "buffer_samples": len(inputs.entries),
    }


def training_settings(cfg: TrainConfig, warm_start: str | None) -> TrainConfig:
    """A drafter that starts from another catches up in `train.warm_start_epochs` epochs at most, at the peak
    rate `train.optim.warm_start_lr`; a fresh one trains `train.epochs` at `train.optim.lr`. The budget
    (`train.max_tokens`) bounds both, and the learning-rate schedule is fitted to the run it gets."""
    if warm_start is None:
        return cfg
    epochs = min(cfg.epochs, cfg.warm_start_epochs) if cfg.warm_start_epochs else cfg.epochs
    lr = cfg.optim.warm_start_lr or cfg.optim.lr
    return cfg.model_copy(update={"epochs": epochs, "optim": cfg.optim.model_copy(update={"lr": lr})})


def run_training(
    job: TrainJob, ctx: DistContext | None = None, progress: Callable[[str], None] | None = None
) -> TrainOutcome | None:
    """The training process's half, on every rank: warm-start, train (resuming from the last
    checkpoint), and on rank 0 register the drafter, write the outcome and end the run.
    Returns the outcome on rank 0, None on the others."""
    ctx, progress = ctx or DistContext(), progress or (lambda _: None)
    inputs = _read_inputs(job, ctx)
    cfg, store = inputs.cfg, inputs.store
    registry = open_registry(cfg)
    checkpoints = TrainingCheckpoints(store, training_prefix(cfg.run, job.input_id))
    target = target_lib.load_policy(store, inputs.pointer.checkpoint_uri, inputs.device, target_lib.load_settings(cfg))
    drafter, warm_start = _warm_started_drafter(job, inputs, registry, target, ctx)
    found = checkpoints.latest() if cfg.train.checkpoint_every else None
    if found:
        # The checkpoint's vocabulary maps decide the teacher's rows, so they are in place before it is built.
        drafter.load_state_dict(checkpoints.model_weights(found.directory), strict=False)
        progress(f"resuming from the checkpoint at iteration {found.state.iteration} of "
                 f"{found.state.total_iterations}")
    drafter.attach(target)
    broadcast_state(drafter.to(inputs.device).trainable_state_dict(), ctx)  # before the teacher reads the vocabulary
    num_layers = target.config.num_hidden_layers
    _check_buffer_layers(drafter, inputs, num_layers)
    data = BufferDataset(store, inputs.data_run, inputs.entries, lambda s: drafter.training_sample(s, num_layers),
                         cfg.train.max_unreadable_share)

    run_id = job.run_id
    if ctx.is_main and run_id is None:
        name = f"drafter-{step_key(job.step)}" + (f"-refresh-part-{job.refresh.part}" if job.refresh else "")
        run_id = registry.start_run(name, {**job.tags, "input_id": job.input_id})
    try:
        sink: MetricsSink = NullSink()
        if ctx.is_main:
            registry.log_params(run_id, _run_params(inputs, warm_start, ctx))  # a continued run keeps its first
            # Metrics reach MLflow when a checkpoint commits: a resumed run never logs an iteration twice,
            # and sends first those its checkpoint committed but a killed process never sent.
            held = 1 << 62 if cfg.train.checkpoint_every else 200
            batcher = MetricsBatcher(registry.client, run_id, flush_every=held)
            if found:
                batcher.log_missing(found.state.unlogged)
            sink = batcher

        def committed(state: ResumeState) -> None:
            sink.flush()
            progress(f"checkpoint at iteration {state.iteration} of {state.total_iterations}, "
                     f"loss {state.loss_history[-1]:.4f}")

        result = train_drafter(
            drafter, data, training_settings(cfg.train, warm_start), sink, inputs.device, drafter.teacher(target),
            ctx=ctx,
            checkpoints=checkpoints if cfg.train.checkpoint_every else None, on_checkpoint=committed,
        )
        if not ctx.is_main:
            return None
        result = replace(result, samples=data.samples_read)  # what was read, not what the buffer lists
        registry.log_params(run_id, {"samples_read": data.samples_read, "samples_unreadable": data.unreadable_samples,
                                     **(result.parallelism.metadata() if result.parallelism else {})})
        sink.flush()
        version = _register(registry, job, run_id, cfg, inputs.entries, drafter, warm_start,
                            target_forward.TargetMetadata.of(target.config), result.samples)
        registry.end_run(run_id, ok=True)
    except BaseException:
        if ctx.is_main:
            registry.end_run(run_id, ok=False)
        raise
    checkpoints.clear()  # the registered version is the result now
    return _finish(store, job, inputs, run_id, version, warm_start, result)


def _finish(
    store: ObjectStore, job: TrainJob, inputs: _Inputs, run_id: str, version: str, warm_start: str | None,
    result: TrainResult,
) -> TrainOutcome:
    outcome = TrainOutcome(True, job.reason, len(inputs.entries), run_id, version, warm_start, result,
                           tuple(composition(inputs.entries)), job.requested_by)
    if job.refresh is None:  # a refresh never stands in for the step's own training record
        write_outcome(store, inputs.cfg.run, job.step, outcome)
    return outcome


def _register(
    registry: DrafterRegistry, job: TrainJob, run_id: str, cfg: PipelineConfig, entries: list[BufferEntry],
    drafter: drafters.Drafter, warm_start: str | None, target: target_forward.TargetMetadata, samples_read: int,
) -> str:
    """One version per input identity, even when a process died between registering and finishing, or two
    processes (two Dagster instances, a retried run beside a stuck one) train the same inputs at once."""
    version = registry.find_version({"input_id": job.input_id})
    if version is None:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = save_drafter(drafter, Path(tmp) / "drafter", target)
            steps = list(composition(entries))
            tags = {
                "rl_step": str(job.step), "pipeline_run": cfg.run, "trained_on_steps": json.dumps(steps),
                "train_samples": str(samples_read), "warm_start_version": warm_start or "none",
                "input_id": job.input_id, "drafter_kind": cfg.drafter.kind,
            }
            if job.requested_by:
                tags["retrain_requested_by"] = job.requested_by
            what = f"trained at RL step {job.step}"
            if job.refresh:
                tags.update({"refresh_step": str(job.step), "refresh_part": str(job.refresh.part)})
                what = f"refreshed on RL step {job.step}'s parts up to part {job.refresh.part}"
            version = registry.register(run_id, checkpoint, tags, identity="input_id", description=(
                f"{cfg.drafter.kind} drafter {what} of run {cfg.run} on "
                f"{samples_read} samples of steps {steps}, warm-started from "
                f"{f'version {warm_start}' if warm_start else 'a fresh initialisation'}."))
    if job.refresh is None:  # a refresh goes to the fleet by itself; the step's training keeps the aliases
        publish_challenger(registry, version)
    return version


def train_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, tags: dict[str, str],
    requested_by: str | None = None,
) -> TrainOutcome:
    """Decide and train in this process (notebooks, tests of a killed training); the drafter asset
    launches `run_training` as its own process instead."""
    planned = settle_plan(plan_training(store, cfg, step, registry, requested_by), cfg, registry, tags)
    if isinstance(planned, TrainOutcome):
        write_outcome(store, cfg.run, step, planned)
        return planned
    outcome = run_training(planned)
    if outcome is None:
        raise RuntimeError("train_step runs one process, which is rank 0: set no RANK in its environment")
    return outcome
