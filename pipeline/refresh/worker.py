"""The same-step refresh's process, launched by the `refreshed_drafter` asset through Dagster Pipes.

    python -m pipeline.refresh.worker

One process does a refresh's model work, in order (`pipeline.refresh.plan` says what a refresh is):

    extract   the qualifying parts' captured rollouts through the step's policy, into the refresh's
              own namespace (keys.refresh_data_run)
    train     the champion fine-tuned on them (`refresh.starting_version`; before any drafter, a fresh
              one): `cotrain.run_training`, as every training, on one rank
    check     it and the drafter it started from on the parts' held-out rollouts, against the step's policy

It writes the refresh's record (not yet deployed) and reports the materialization over Pipes; the
asset then deploys it, fenced, from the run process, which runs no model. One rank: a refresh
trains for seconds, where more ranks would cost more to start than they save.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from dagster_pipes import PipesContext, open_dagster_pipes

from pipeline.config import PipelineConfig
from pipeline.data import capture, shards
from pipeline.data.buffer import select_buffer, write_buffer
from pipeline.data.held_out import held_out_rollouts
from pipeline.data.keys import refresh_data_run, refresh_key, step_key
from pipeline.data.parts import Qualified
from pipeline.data.records import write_record
from pipeline.data.refresh_record import RefreshRecord, RefreshTimes
from pipeline.data.run_layout import TargetLayout
from pipeline.data.stage_placement import StagePlacement
from pipeline.data.store import ObjectStore, open_store
from pipeline.evaluation import tail as tail_lib
from pipeline.launch.placement import measure_placement
from pipeline.launch.process import StageJob
from pipeline.launch.worker import exit_with_launcher, is_pipes_process, stage_job
from pipeline.models import target as target_lib
from pipeline.models.layers import stored_layer_ids
from pipeline.ranks import Ranks
from pipeline.refresh import plan as refresh_lib
from pipeline.registry import DrafterRegistry, open_registry
from pipeline.sources.extract import iter_hidden_states
from pipeline.stages import REFRESH
from pipeline.training.cotrain import run_training
from pipeline.training.distributed import DistContext


def extract(store: ObjectStore, cfg: PipelineConfig, q: Qualified) -> int:
    """The hidden states of the qualifying parts' captured rollouts and their buffer, in the refresh's
    namespace; returns the buffer's samples."""
    data_run = refresh_data_run(cfg.run, q.step, q.part)
    model = target_lib.load_policy(store, q.pointer.checkpoint_uri, cfg.device, target_lib.load_settings(cfg))
    rollouts = refresh_lib.part_rollouts(store, cfg.run, q.step, q.parts, q.step_parts)
    plan = capture.plan_capture(rollouts, q.step, held_out_fraction=cfg.eval.held_out_fraction,
                                window_tokens=cfg.train.window_tokens, max_samples=cfg.capture.max_samples,
                                max_tokens=cfg.capture.max_tokens)
    windows = plan.bounds()
    num_layers = model.config.num_hidden_layers
    layer_ids = stored_layer_ids(cfg.drafter, num_layers)
    samples = iter_hidden_states(model, [r for r in rollouts if r.sample_id in windows], q.step,
                                 tokens_per_batch=cfg.hidden_states.tokens_per_batch, device=cfg.device,
                                 layer_ids=layer_ids, windows=windows)
    manifest = shards.write_hidden_states(
        store, data_run, q.step, samples, hidden_size=model.config.hidden_size, layer_ids=layer_ids or [num_layers],
        compression=cfg.shard_compression,
        target={"model_id": q.pointer.model_id, "policy_version": str(q.pointer.policy_version),
                "checkpoint_uri": q.pointer.checkpoint_uri, "source": "forward",
                "final_norm": "applied" if layer_ids is None else "not applied"},
        layout=TargetLayout.from_config(model.config.to_dict(), layer_ids or [num_layers]),
        lease_s=cfg.storage.step_lease_s, lease_wait_s=cfg.storage.step_lease_wait_s)
    entries = select_buffer([manifest], q.step, 1, cfg.train.data_buffer_max_size)
    return write_buffer(store, data_run, q.step, entries).num_samples


@dataclass(frozen=True)
class RefreshCheck:
    tau_refreshed: float
    tau_champion: float | None
    prompts: int
    deploy: bool
    reason: str


def check(store: ObjectStore, cfg: PipelineConfig, q: Qualified, registry: DrafterRegistry, version: str,
          champion: str | None) -> RefreshCheck:
    """Tau of the refreshed drafter and of `champion`, the drafter it started from (None: it started fresh), on
    the held-out rollouts of the qualifying parts."""
    rollouts = held_out_rollouts(refresh_lib.part_rollouts(store, cfg.run, q.step, q.parts, q.step_parts),
                                 cfg.eval.held_out_fraction)[: min(cfg.eval.num_prompts, cfg.refresh.check_prompts)]
    if not rollouts:
        return RefreshCheck(0.0, None, 0, False, "no held-out rollout in the qualifying parts")
    prompts = [torch.tensor(r.input_ids[: max(1, r.prompt_len)]) for r in rollouts]
    taus = tail_lib.measure_taus(store, cfg, q.pointer, registry, [version, champion], prompts, seed=q.step)
    new, old = taus[version], taus.get(champion) if champion else None
    margin = cfg.refresh.margin
    if old is None:
        return RefreshCheck(new, None, len(prompts), True, f"started fresh; refreshed tau {new:.3f}")
    if new > old + margin:
        return RefreshCheck(new, old, len(prompts), True,
                            f"refreshed tau {new:.3f} > v{champion}'s tau {old:.3f} + refresh.margin {margin}")
    return RefreshCheck(new, old, len(prompts), False,
                        f"refreshed tau {new:.3f} <= v{champion}'s tau {old:.3f} + refresh.margin {margin}")


def run_refresh(job: StageJob, progress: Callable[[str], None]) -> tuple[RefreshRecord, int, StagePlacement]:
    """Extract, train and check the refresh of `job.step` at `job.part`: its record (written, not deployed),
    the samples it trained on and where it ran."""
    cfg = job.pipeline_config
    worker_started_at = time.time()
    store, registry, started = open_store(cfg), open_registry(cfg), time.perf_counter()
    q = refresh_lib.qualified_parts(store, cfg, job.step)
    if q is None or q.part != job.part:
        raise ValueError(f"{step_key(job.step)}: its parts do not qualify at part {job.part}")
    samples = extract(store, cfg, q)
    extracted_at = time.time()
    train_job = refresh_lib.training_job(store, cfg, q, registry, job.tags)
    start = train_job.warm_start_version
    progress(f"{f'fine-tuning v{start}' if start else 'training a fresh drafter'} on {samples} samples of parts "
             f"{list(q.parts)}")
    outcome = run_training(train_job, DistContext(), progress)
    trained_at = time.time()
    version = registry.find_version({"input_id": train_job.input_id})
    if version is None:
        raise RuntimeError(f"the refresh of step {q.step} part {q.part} registered no version")
    checked = check(store, cfg, q, registry, version, train_job.warm_start_version)
    fine_tune_s = outcome.result.wall_s if outcome is not None and outcome.result is not None else 0.0
    # run_started_at is the run's to set (it reads the record back); until then the process's own start.
    times = RefreshTimes(worker_started_at, worker_started_at, extracted_at, trained_at, round(fine_tune_s, 3),
                         time.time())
    record = RefreshRecord(q.step, q.part, q.parts, q.rows, q.qualified_at, version, train_job.warm_start_version,
                           checked.tau_refreshed, checked.tau_champion, False, checked.reason, None,
                           round(trained_at - extracted_at, 3), checked.deploy, times)
    write_record(store, refresh_key(cfg.run, q.step), record)
    run_id = registry.client.get_model_version(registry.model_name, version).run_id
    registry.log_metrics(run_id, {"refresh_tau": checked.tau_refreshed, **(
        {"refresh_champion_tau": checked.tau_champion} if checked.tau_champion is not None else {})}, step=q.step)
    registry.set_version_tags(version, {"refresh_tau": f"{checked.tau_refreshed:.4f}", "refresh_deployed": "false"})
    return record, samples, measure_placement(REFRESH, job.where, Ranks(), cfg.device, started)


def run_pipes(pipes: PipesContext) -> None:
    """The refresh over an open Pipes channel, and its report (a launched process's and a warm worker's,
    `pipeline.launch.warm`)."""
    job = stage_job(pipes, REFRESH)
    record, samples, where = run_refresh(job, pipes.log.info)
    pipes.log.info(f"{step_key(record.step)} refresh on parts {list(record.parts)}: {record.decision}")
    pipes.report_asset_materialization(metadata={
        "step": record.step, "part": record.part, "parts": str(list(record.parts)), "rollouts": record.rollouts,
        "samples": samples, "version": record.version or "none",
        "tau_refreshed": round(record.tau_refreshed or 0.0, 3),
        "tau_champion": round(record.tau_champion or 0.0, 3), **where.metadata()})


def main() -> None:
    exit_with_launcher()
    if not is_pipes_process():
        raise SystemExit("pipeline.refresh.worker: no job; launch it from the refreshed_drafter asset (Dagster Pipes)")
    with open_dagster_pipes() as pipes:
        run_pipes(pipes)


if __name__ == "__main__":
    main()
