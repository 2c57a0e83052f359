"""The same-step refresh as an asset: materialized once per refreshed step, by the refresh job."""

import time
import uuid
from dataclasses import replace

import dagster as dg
from pydantic import Field

from pipeline.data.keys import refresh_key, refresh_lock_prefix, step_key
from pipeline.data.lease import hold
from pipeline.data.parts import Qualified
from pipeline.data.refresh_record import read_refresh
from pipeline.refresh import plan as refresh_lib
from pipeline.stages import REFRESH
from resources import PipelineResource


class RefreshRunConfig(dg.Config):
    step: int = Field(ge=0, description="The RL step whose first parts the refresh trains on.")
    part: int = Field(ge=0, description="The qualifying part: the parts published up to it are read.")


@dg.asset(
    group_name="refresh",
    kinds={"pytorch", "mlflow", "vllm"},
    pool="refresh",  # not `gpu`: the refresh never queues behind, nor holds up, a step's own training
    description="The champion fine-tuned for `refresh.max_tokens` positions on a step's first parts (once they "
    "hold `refresh.min_share` of its rollouts), checked on their held-out rollouts and, when it beats the champion "
    "by `refresh.margin`, deployed so that it serves the step's tail. Registered in MLflow, tagged with its step "
    "and part; the step's own training supersedes it.",
)
def refreshed_drafter(context: dg.AssetExecutionContext, config: RefreshRunConfig,
                      pipeline: PipelineResource) -> dg.MaterializeResult:
    """Extract, train and check in the refresh's own process (the stages' launcher), then deploy it from here."""
    run_started_at = time.time()
    cfg, store = pipeline.config, pipeline.store()
    q = refresh_lib.qualified_parts(store, cfg, config.step)
    if q is None or q.part != config.part:
        raise ValueError(f"{step_key(config.step)}: its parts do not qualify at part {config.part} "
                         f"(refresh.min_share {cfg.refresh.min_share})")
    # One refresh at a time per run, whoever launched it (sensor, UI, backfill): a second waits for the first.
    with hold(store, refresh_lock_prefix(cfg.run), f"refresh-{step_key(q.step)}-{uuid.uuid4().hex[:8]}",
              cfg.storage.step_lease_s, cfg.storage.step_lease_wait_s):
        return _refresh(context, pipeline, q, run_started_at)


def _refresh(context: dg.AssetExecutionContext, pipeline: PipelineResource, q: Qualified,
             run_started_at: float) -> dg.MaterializeResult:
    cfg, store, registry = pipeline.config, pipeline.store(), pipeline.registry()
    tags = {"dagster_run_id": context.run.run_id, "dagster_asset": "refreshed_drafter",
            "rl_step": step_key(q.step), "refresh_part": str(q.part), "pipeline_run": cfg.run}
    launcher = pipeline.launcher()
    checked = launcher.run_stage(context, launcher.stage_job(REFRESH, q.step, part=q.part, tags=tags))
    record = read_refresh(store, cfg.run, q.step)
    if record.times is not None:  # the run's own start: the wait before it and the process's launch after it
        record = replace(record, times=replace(record.times, run_started_at=run_started_at))
    record = refresh_lib.deploy_refreshed(store, cfg, registry, record, q)
    breakdown = record.breakdown
    context.log.info(f"{step_key(q.step)} refresh on parts {list(q.parts)}: {record.decision}"
                     + (f"; latency {breakdown.to_json()}" if breakdown else ""))
    return dg.MaterializeResult(metadata={
        **(checked.get_materialize_result().metadata or {}),
        "deployed": record.deployed, "decision": record.decision,
        "refresh_latency_s": record.latency_s if record.latency_s is not None else -1.0,  # -1: not deployed
        **(breakdown.metadata() if breakdown else {}),
        "uri": dg.MetadataValue.path(store.uri(refresh_key(cfg.run, q.step))),
    })
