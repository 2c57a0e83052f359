"""The evaluation process, launched by the `acceptance` asset through Dagster Pipes.

    python -m pipeline.evaluation.worker                                      one rank
    torchrun --standalone --nproc-per-node=N -m pipeline.evaluation.worker    N ranks (gloo on CPU, NCCL on GPUs)

The job (`pipeline.launch.process.StageJob`: config, RL step, the step's new drafter version, the
device-seconds of the stages before) arrives as the Pipes extra `job`. One process (or one set of
ranks) measures every drafter of the step, so the policy is loaded once per step; the ranks share
the prompt batches and sum their counts (`acceptance.measure_step`). Rank 0 decides the promotion,
writes the step's records, measures tau on the tail of a step published in parts (`tail`),
and reports the materialization, the `tau_in_range` check and its logs
over Pipes.
"""

from __future__ import annotations

import time

from dagster_pipes import PipesContext

from pipeline.data.acceptance_record import AcceptanceRecord
from pipeline.data.keys import placement_key
from pipeline.data.records import read_record
from pipeline.data.stage_placement import StagePlacement
from pipeline.data.store import open_store
from pipeline.evaluation import acceptance
from pipeline.evaluation import tail as tail_lib
from pipeline.launch.process import StageJob
from pipeline.launch.worker import run_stage_worker, stage_job
from pipeline.ranks import SINGLE, Ranks, join, leave
from pipeline.registry import open_registry
from pipeline.stages import EVALUATION


def run_evaluation(job: StageJob, ranks: Ranks) -> AcceptanceRecord | None:
    """The step's acceptance on `ranks`; its record on rank 0, None on the others."""
    cfg = job.pipeline_config
    join(ranks, ranks.device(cfg.device, cfg.target.gpus_per_process))
    try:
        return acceptance.evaluate_step(open_store(cfg), cfg, job.step, open_registry(cfg), job.new_version,
                                        job.spent_s, ranks, job.where)
    finally:
        leave()


def acceptance_metadata(record: AcceptanceRecord) -> dict:
    """Tau and version per drafter role, and the promotion decision."""
    measured = record.measured()
    metadata: dict = {f"tau_{role}": round(d.tau, 3) for role, d in measured.items()}
    metadata.update({f"greedy_tau_{role}": round(d.greedy_tau, 3) for role, d in measured.items()
                     if d.greedy_tau is not None})
    metadata.update({f"version_{role}": d.version for role, d in measured.items()})
    metadata.update({"promoted": record.promoted, "decision": record.decision,
                     "champion_after": record.champion_after or "none", "sampling": record.sampling.label,
                     "draft_sample_method": record.draft_sample_method})
    if cotrained := record.cotrained:
        metadata["acceptance_rate_cotrained"] = round(cotrained.acceptance_rate, 3)
        metadata["per_position_cotrained"] = str([round(p, 3) for p in cotrained.per_position])
    return metadata


def run_pipes(pipes: PipesContext, ranks: Ranks = SINGLE) -> None:
    """Rank 0's work over an open Pipes channel: the measurements, the promotion, the tail, the report (a
    launched process's and a warm worker's, `pipeline.launch.warm`)."""
    started = time.perf_counter()
    job = stage_job(pipes, EVALUATION)
    pipes.log.info(f"measuring the drafters of RL step {job.step} on {ranks.world_size} rank(s) ({job.where})")
    record = run_evaluation(job, ranks)
    cfg = job.pipeline_config
    where = read_record(open_store(cfg), placement_key(cfg.run, job.step, EVALUATION), StagePlacement)
    pipes.log.info(f"evaluation done in {time.perf_counter() - started:.1f} s: {record.decision}")
    ceiling = cfg.eval.num_speculative_tokens + 1
    metadata = {**acceptance_metadata(record), **where.metadata()}
    registry = open_registry(cfg)
    if tail := tail_lib.measure_tail(open_store(cfg), cfg, job.step, registry):  # a step published in parts
        metadata.update(tail.metadata())
        tail_lib.log_tail(registry, tail)
    pipes.report_asset_materialization(metadata=metadata)
    pipes.report_asset_check(
        "tau_in_range", passed=all(1.0 <= d.tau <= ceiling for d in record.measured().values()),
        severity="ERROR", metadata={"ceiling": ceiling})


def main() -> None:
    run_stage_worker(EVALUATION, run_evaluation, run_pipes)


if __name__ == "__main__":
    main()
