"""The extraction process, launched by the `hidden_states` asset through Dagster Pipes.

    python -m pipeline.sources.worker                                       one rank
    torchrun --standalone --nproc-per-node=N -m pipeline.sources.worker     N ranks (gloo on CPU, NCCL on GPUs)

The job (`pipeline.launch.process.StageJob`: config, RL step) arrives as the Pipes extra `job`. Every
rank loads the step's policy and forwards its share of the step's shards (`extract.extract_hidden_states`);
rank 0 commits the manifest, checks the committed shards as a reader sees them, records where the
stage ran, and reports the materialization, the `shards_valid` check and its logs over Pipes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dagster_pipes import PipesContext

from pipeline.data import capture
from pipeline.data import shard_checks as checks
from pipeline.data.keys import hidden_states_prefix, placement_key
from pipeline.data.records import write_record
from pipeline.data.shard_format import Manifest
from pipeline.data.stage_placement import StagePlacement
from pipeline.data.store import ObjectStore, open_store
from pipeline.launch.placement import measure_placement
from pipeline.launch.process import StageJob
from pipeline.launch.worker import run_stage_worker, stage_job
from pipeline.ranks import SINGLE, Ranks, join, leave
from pipeline.sources import extract
from pipeline.stages import EXTRACTION


def run_extraction(job: StageJob, ranks: Ranks) -> tuple[Manifest | None, StagePlacement]:
    """The step's hidden states on `ranks`; the manifest (rank 0) and where the stage ran (every rank)."""
    started = time.perf_counter()
    cfg = job.pipeline_config
    device = ranks.device(cfg.device, cfg.target.gpus_per_process)
    join(ranks, device)
    try:
        manifest = extract.extract_hidden_states(open_store(cfg), cfg, job.step, ranks)
        return manifest, measure_placement(EXTRACTION, job.where, ranks, device, started)
    finally:
        leave()


@dataclass(frozen=True)
class ExtractionReport:
    """What rank 0 reports of a committed extraction: the materialization's metadata and the problems the
    `shards_valid` check found in the shards read back."""

    metadata: dict
    problems: list[str]

    def check_metadata(self) -> dict:
        """The `shards_valid` check's metadata, as Pipes reports it."""
        return {"problems": {"raw_value": "\n".join(f"* {p}" for p in self.problems) or "none", "type": "md"}}


def report_extraction(job: StageJob, manifest: Manifest, where: StagePlacement) -> ExtractionReport:
    """Rank 0's work after the commit: the placement record stored, the committed shards checked as a reader
    sees them, the materialization's metadata."""
    cfg = job.pipeline_config
    store = open_store(cfg)
    write_record(store, placement_key(cfg.run, job.step, EXTRACTION), where)
    problems = checks.check_shards(store, cfg.run, job.step)
    return ExtractionReport(_metadata(store, job, manifest, where), problems)


def _metadata(store: ObjectStore, job: StageJob, manifest: Manifest, where: StagePlacement) -> dict:
    cfg = job.pipeline_config
    plan = capture.read_plan(store, cfg.run, job.step)
    return {
        "samples": manifest.num_samples,
        "tokens": manifest.num_tokens,
        "bytes": manifest.total_bytes,
        **(plan.summary() if plan else {}),  # rollouts captured of published, tokens stored of forwarded
        "shards": len(manifest.shards),
        "hidden_size": manifest.hidden_size,
        "layer_ids": str(manifest.layer_ids),
        "compression": manifest.compression,
        "target": manifest.target["model_id"],
        "content_digest": manifest.content_digest(),
        **manifest.ingest,  # vLLM connector files: read, unmatched, refused; rollouts without a file
        **where.metadata(),
        "tokens_per_s": round(manifest.num_tokens / max(where.seconds, 1e-9), 1),
        "uri": {"raw_value": store.uri(hidden_states_prefix(cfg.run, job.step)), "type": "path"},
    }


def run_pipes(pipes: PipesContext, ranks: Ranks = SINGLE) -> None:
    """Rank 0's work over an open Pipes channel: the extraction, its commit, check and report (a launched
    process's and a warm worker's, `pipeline.launch.warm`)."""
    job = stage_job(pipes, EXTRACTION)
    pipes.log.info(f"extracting hidden states of RL step {job.step} on {ranks.world_size} rank(s) "
                   f"({job.where})")
    manifest, where = run_extraction(job, ranks)
    report = report_extraction(job, manifest, where)
    pipes.report_asset_materialization(metadata=report.metadata)
    pipes.report_asset_check("shards_valid", passed=not report.problems, severity="ERROR",
                             metadata=report.check_metadata())


def main() -> None:
    run_stage_worker(EXTRACTION, run_extraction, run_pipes)


if __name__ == "__main__":
    main()
