"""Tau on a step's tail: the rollouts a same-step refresh can serve, per drafter.

The tail of a step published in parts is its parts published after the qualifying one (the part
that brought the step to `refresh.min_share`, parts.qualify: the same parts the refresh trained on
before it): what a refreshed drafter, live by then, would generate. On the held-out prompts of the
tail's rollouts, against the step's policy:

    start       the drafter the fleet ran when the step's first part was published
    refreshed   the step's refreshed drafter (its RefreshRecord), whether or not it reached the fleet
    whole_step  the drafter trained on the whole step: the step's own training; None when it did not
                train (skipped, or superseded by a newer step)

    tail/<run>/step-000123.json     the TailTau record (data/refresh_record.py)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pipeline.config import PipelineConfig
from pipeline.data import parts as parts_lib
from pipeline.data import rollouts as rollouts_lib
from pipeline.data import run_layout
from pipeline.data.acceptance_record import NO_DRAFTER_TAU
from pipeline.data.fleet_state import FleetState, read_fleet_state, served_at
from pipeline.data.held_out import held_out_rollouts
from pipeline.data.keys import drafter_key, tail_key
from pipeline.data.records import write_record
from pipeline.data.refresh_record import RefreshRecord, TailTau, read_refresh
from pipeline.data.rollouts import PolicyPointer
from pipeline.data.store import ObjectStore
from pipeline.data.training_record import TrainingRecord, read_training
from pipeline.evaluation import speculative
from pipeline.models import target as target_lib
from pipeline.registry import DrafterRegistry


def measure_taus(store: ObjectStore, cfg: PipelineConfig, pointer: PolicyPointer, registry: DrafterRegistry,
                 versions: list[str | None], prompts: list[torch.Tensor], seed: int) -> dict[str, float]:
    """Tau of each registered version by speculative decoding of `prompts` against the pointer's policy, sampled as
    its rollouts were and drafted as the fleet drafts; every version from the same seeds."""
    target = target_lib.load_policy(store, pointer.checkpoint_uri, cfg.device, target_lib.load_settings(cfg))
    params = cfg.eval.rollout_sampling(pointer.sampling)
    taus = {}
    for version in sorted({v for v in versions if v}, key=int):
        drafter = registry.load(version)
        drafter.attach(target)
        taus[version] = speculative.evaluate(
            target, speculative.follow_target(drafter, target), prompts, cfg.eval.max_new_tokens,
            cfg.eval.num_speculative_tokens, params=params, draft_method=cfg.fleet.draft_sample_method, seed=seed).tau
    return taus


def tail_parts(manifests: list[parts_lib.PartManifest], step_parts: parts_lib.StepParts, min_share: float,
               min_tokens: int = 0) -> tuple[int, ...]:
    """The parts published after the qualifying one, in publication order; () when the step never qualified."""
    qualified = parts_lib.qualify(manifests, step_parts, min_share, min_tokens)
    if qualified is None:
        return ()
    return tuple(m.part for m in sorted(manifests, key=lambda m: (m.published_at, m.part))
                 if m.part not in qualified.parts)


def tail_versions(state: FleetState, started_at: float, refresh: RefreshRecord | None, training: TrainingRecord | None,
                  step: int) -> dict[str, str | None]:
    """The registered version of each tail role (see the module doc)."""
    whole = training.version if training and training.figures and step in training.trained_on_steps else None
    return {"start": served_at(state.history, started_at), "refreshed": refresh.version if refresh else None,
            "whole_step": whole}


def measure_tail(store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry) -> TailTau | None:
    """The step's TailTau, written; None for a step published whole, or whose tail holds no held-out rollout."""
    step_parts = parts_lib.read_step_parts(store, cfg.run, step)
    if step_parts is None or not rollouts_lib.is_committed(store, cfg.run, step):
        return None
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    # The committed policy's own limits, never the ones the step's record claims.
    step_parts = replace(step_parts, limits=run_layout.checkpoint_limits(store, pointer.checkpoint_uri))
    manifests = parts_lib.published_parts(store, cfg.run, step)  # the parts its commit lists
    tail = tail_parts(manifests, step_parts, cfg.refresh.min_share, cfg.refresh.min_tokens)
    by_part = {m.part: m for m in manifests}
    rows = [r for p in tail for r in parts_lib.read_part(store, cfg.run, step, by_part[p], step_parts.limits)]
    held_out = held_out_rollouts(rows, cfg.eval.held_out_fraction)[: cfg.eval.num_prompts]
    if not held_out:
        return None
    refresh = read_refresh(store, cfg.run, step)
    training = read_training(store, cfg.run, step) if store.exists(drafter_key(cfg.run, step)) else None
    versions = tail_versions(read_fleet_state(store, cfg.run), step_parts.started_at, refresh, training, step)
    prompts = [torch.tensor(r.input_ids[: max(1, r.prompt_len)]) for r in held_out]
    measured = measure_taus(store, cfg, pointer, registry, list(versions.values()), prompts, seed=step)
    taus: dict[str, float | None] = {role: measured[v] if v else None for role, v in versions.items()}
    if taus["start"] is None:
        taus["start"] = NO_DRAFTER_TAU  # no drafter served the step's start: one token per target forward
    period = rollouts_lib.published_at(store, cfg.run, step) - step_parts.started_at
    record = TailTau(step, tail, len(prompts), versions, taus,
                     refresh.latency_s if refresh and refresh.deployed else None, round(period, 3))
    write_record(store, tail_key(cfg.run, step), record)
    return record


def log_tail(registry: DrafterRegistry, record: TailTau) -> None:
    """The tail's figures as metrics, at the RL step, of the whole-step drafter's MLflow run (else the
    refreshed one's)."""
    version = record.versions.get("whole_step") or record.versions.get("refreshed")
    if version is None:
        return
    metrics = {f"tail_tau_{role}": tau for role, tau in record.taus.items() if tau is not None}
    if record.refresh_latency_s is not None:
        metrics["refresh_latency_s"] = record.refresh_latency_s
        metrics["refresh_latency_share"] = record.latency_share
    run_id = registry.client.get_model_version(registry.model_name, version).run_id
    registry.log_metrics(run_id, metrics, step=record.step)
