"""The drafter training process, launched by the `drafter` asset through Dagster Pipes.

    torchrun --standalone --nproc-per-node=N -m pipeline.training.worker   (N ranks: data parallel or FSDP2)
    torchrun --nnodes=K --rdzv-backend=c10d ... -m pipeline.training.worker  (K nodes, one agent per node)
    python -m pipeline.training.worker --job job.json                      (by hand, without Dagster)

The job (`plan.TrainJob`: config, RL step, MLflow run, input identity, warm start)
arrives as the Pipes extra `job`. Every rank reads it from the Pipes context; only rank 0
opens the message channel, so Dagster sees one process: rank 0 sends progress logs and the
materialization (its metadata sums all ranks' work, and says how they held the drafter), and
is the only rank that writes to MLflow (one run) and to the store. On several nodes rank 0 runs
on node 0, whose log is the Pipes channel of an indexed Job.

The launched workers (this one, `pipeline.sources.worker`, `pipeline.evaluation.worker`, with
`pipeline.launch.worker`) are the only places in `pipeline/` that know Dagster Pipes (`dagster_pipes`, a
dependency-free protocol library); the training itself is `cotrain.run_training`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dagster_pipes import PipesContext, open_dagster_pipes

from pipeline.accounting import plots
from pipeline.data.keys import placement_key
from pipeline.data.records import write_record
from pipeline.data.stage_placement import StagePlacement
from pipeline.data.store import open_store
from pipeline.launch.placement import measure_placement
from pipeline.launch.worker import exit_with_launcher, is_pipes_process, job_extra, pipes_extras
from pipeline.ranks import SINGLE
from pipeline.registry import open_registry
from pipeline.stages import TRAINING
from pipeline.training.cotrain import run_training
from pipeline.training.distributed import (
    DistContext,
    context_from_env,
    destroy_process_group,
    init_process_group,
    rank_device,
)
from pipeline.training.outcome import TrainOutcome, outcome_metadata
from pipeline.training.plan import TrainJob


def _train(
    job: TrainJob, ctx: DistContext, progress: Callable[[str], None] | None = None, where: str = "process"
) -> tuple[TrainOutcome | None, StagePlacement]:
    """The training on this rank; its outcome (rank 0) and where the training ran (every rank measures,
    the peak memory is the largest rank's)."""
    started = time.perf_counter()
    device = rank_device(ctx, job.pipeline_config.device)
    init_process_group(ctx, device)
    try:
        outcome = run_training(job, ctx, progress)
        return outcome, measure_placement(TRAINING, where, ctx, device, started)
    finally:
        destroy_process_group()


def run_pipes(pipes: PipesContext, ctx: DistContext = SINGLE) -> None:
    """Rank 0's work over an open Pipes channel: the training, its placement record and the materialization
    (a launched process's and a warm worker's, `pipeline.launch.warm`)."""
    job = TrainJob.from_dict(job_extra(pipes))
    continued = f", continuing MLflow run {job.run_id}" if job.run_id else ""
    pipes.log.info(f"training RL step {job.step} on {ctx.world_size} rank(s){continued}")
    outcome, where = _train(job, ctx, pipes.log.info, str(job_extra(pipes, "where")))
    cfg = job.pipeline_config
    write_record(open_store(cfg), placement_key(cfg.run, job.step, TRAINING), where)
    metadata = _materialization(job, outcome, ctx, str(job_extra(pipes, "mlflow_ui_url")))
    pipes.report_asset_materialization(metadata={**metadata, **where.metadata()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.training.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--job", type=Path, help="a training job as JSON (without Dagster Pipes)")
    args = parser.parse_args(argv)
    ctx = context_from_env()
    exit_with_launcher()
    if args.job:
        outcome, _ = _train(TrainJob.from_dict(json.loads(args.job.read_text())), ctx)
        if outcome:
            sys.stdout.write(json.dumps(outcome_metadata(outcome), default=str) + "\n")
        return
    if not is_pipes_process():
        raise SystemExit("pipeline.training.worker: no job; launch it from the drafter asset (Dagster Pipes) "
                         "or pass --job FILE")
    if not ctx.is_main:
        _train(TrainJob.from_dict(pipes_extras()["job"]), ctx)
        return
    with open_dagster_pipes() as pipes:
        run_pipes(pipes, ctx)


def _materialization(job: TrainJob, outcome: TrainOutcome, ctx: DistContext, ui_url: str | None) -> dict:
    """The drafter asset's metadata as rank 0 reports it: the outcome, links into MLflow, the loss curve."""
    metadata: dict = outcome_metadata(outcome)
    if ui_url:
        registry = open_registry(job.pipeline_config)
        metadata["mlflow_run"] = {"raw_value": registry.run_url(outcome.run_id, ui_url), "type": "url"}
        metadata["mlflow_model_version"] = {"raw_value": registry.version_url(outcome.version, ui_url), "type": "url"}
    curve = plots.loss_png(outcome.result.loss_history, f"drafter training, RL step {job.step}")
    metadata["loss_curve"] = {"raw_value": plots.png_markdown(curve, "training loss per iteration"), "type": "md"}
    metadata["world_size"] = ctx.world_size
    if outcome.result.parallelism:  # how the ranks held the drafter, and the figures `auto` decided on
        metadata.update(outcome.result.parallelism.metadata())
        metadata["rank_training_state_gb"] = round(outcome.result.rank_state_bytes / 1e9, 4)
    return metadata


if __name__ == "__main__":
    main()
