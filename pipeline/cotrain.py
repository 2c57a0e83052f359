"""One drafter training of the co-training loop: decide, warm-start, train, register."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import drafters, shards
from pipeline import rollouts as rollouts_lib
from pipeline import target as target_lib
from pipeline.buffer import BufferEntry, composition, iter_buffer_samples, read_buffer
from pipeline.checkpoint import load_drafter, save_drafter
from pipeline.config import PipelineConfig, TrainConfig
from pipeline.dataset import BufferDataset
from pipeline.eagle import EagleDrafter
from pipeline.eagle3 import Eagle3Drafter
from pipeline.registry import DrafterRegistry, MetricsBatcher
from pipeline.shards import HiddenSample
from pipeline.steps import drafter_key
from pipeline.store import ObjectStore
from pipeline.train import TrainResult, train_drafter


@dataclass(frozen=True)
class TrainOutcome:
    trained: bool
    reason: str
    buffer_samples: int
    run_id: str | None = None
    version: str | None = None
    warm_start_version: str | None = None
    result: TrainResult | None = None

    def record(self, step: int) -> dict:
        """What later stages (and people) need to know about this step's training."""
        out = {"step": step, "trained": self.trained, "reason": self.reason, "buffer_samples": self.buffer_samples,
               "run_id": self.run_id, "version": self.version, "warm_start_version": self.warm_start_version}
        if self.result:
            out.update(iterations=self.result.iterations, loss=self.result.loss, vloss=self.result.vloss,
                       ploss=self.result.ploss, accuracy=self.result.accuracy, wall_s=self.result.wall_s,
                       tokens_per_s=self.result.tokens_per_s, loss_history=self.result.loss_history)
        return out


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


def input_identity(cfg: PipelineConfig, entries: list[BufferEntry], policy_uri: str) -> str:
    """The data and settings a training depends on. The warm start is left out on purpose: a
    rerun of a step finds the champion that step itself promoted, yet trains on the same data."""
    doc = {
        "run": cfg.run, "train": cfg.train.model_dump(), "drafter": cfg.drafter.model_dump(),
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
    wanted = Eagle3Drafter if cfg.drafter.kind == "eagle3" else EagleDrafter
    if champion:
        drafter = registry.load(champion)
        if isinstance(drafter, wanted):
            return drafter, champion
    if cfg.drafter.warm_start:
        drafter = load_drafter(Path(cfg.drafter.warm_start), target.config.num_hidden_layers)
        if not isinstance(drafter, wanted):
            raise ValueError(f"drafter.warm_start {cfg.drafter.warm_start} is not a {cfg.drafter.kind} checkpoint")
        return drafter, f"file:{cfg.drafter.warm_start}"
    counts = _token_counts(hidden, target.config.vocab_size)
    return drafters.fresh_drafter(cfg.drafter, target, counts, cfg.train.seed), None


def train_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, tags: dict[str, str],
    requested_by: str | None = None,
) -> TrainOutcome:
    entries = read_buffer(store, cfg.run, step)
    trained, reason = training_decision(step, len(entries), cfg.train, requested_by)
    if not trained:
        return TrainOutcome(False, reason, len(entries))

    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    warm_start = registry.alias_version("champion")
    identity = input_identity(cfg, entries, pointer.checkpoint_uri)
    existing = registry.find_version({"input_id": identity})
    if existing:  # a rerun of the same partition on the same inputs: no second run, no second version
        run_id = registry.client.get_model_version(registry.model_name, existing).run_id
        return TrainOutcome(True, f"reused version {existing}, trained on identical inputs", len(entries),
                            run_id, existing, warm_start)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, cfg.device)
    # A generator: only a fresh drafter reads the buffer (once, streamed) for its token counts.
    hidden = iter_buffer_samples(store, cfg.run, entries)
    drafter, warm_start = _initial_drafter(cfg, registry, warm_start, target, hidden)
    drafters.attach_target(drafter, target)
    num_layers = target.config.num_hidden_layers
    for step_in_buffer in sorted({e.step for e in entries}):
        manifest = shards.read_manifest(store, cfg.run, step_in_buffer)
        drafters.check_layers(drafter, manifest.layer_ids, num_layers, f"hidden states of step {step_in_buffer}")
    data = BufferDataset(store, cfg.run, entries, lambda s: drafters.training_sample(drafter, s))

    steps_in_buffer = composition(entries)
    run_id = registry.start_run(f"drafter-step-{step:06d}", tags)
    try:
        registry.log_params(run_id, {
            **cfg.train.model_dump(exclude={"optim"}),
            **{f"optim.{k}": v for k, v in cfg.train.optim.model_dump().items()},
            **{f"drafter.{k}": v for k, v in cfg.drafter.model_dump().items()},
            "warm_start_version": warm_start or "none",
            "policy_version": pointer.policy_version, "buffer_samples": len(entries),
        })
        sink = MetricsBatcher(registry.client, run_id)
        result = train_drafter(drafter, data, cfg.train, sink, cfg.device, drafters.teacher(drafter, target))
        sink.flush()
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = save_drafter(drafter, Path(tmp) / "drafter")
            version = registry.register(run_id, checkpoint, {
                "rl_step": str(step), "pipeline_run": cfg.run, "trained_on_steps": json.dumps(list(steps_in_buffer)),
                "train_samples": str(len(entries)), "warm_start_version": warm_start or "none",
                "input_id": identity,
            })
        registry.set_alias("challenger", version)
        if registry.alias_version("baseline") is None:
            registry.set_alias("baseline", version)
        registry.end_run(run_id, ok=True)
    except BaseException:
        registry.end_run(run_id, ok=False)
        raise
    return TrainOutcome(True, reason, len(entries), run_id, version, warm_start, result)
