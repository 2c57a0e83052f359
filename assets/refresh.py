"""The same-step refresh as an asset: materialized once per refreshed step, by the refresh job."""

import time

import dagster as dg
from pydantic import Field

from pipeline import refresh as refresh_lib
from pipeline.data.keys import refresh_key, step_key
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
    """Extract the parts here, train through the training launcher, then check and deploy here."""
    cfg, store, registry = pipeline.config, pipeline.store(), pipeline.registry()
    q = refresh_lib.qualified_parts(store, cfg, config.step)
    if q is None or q.part != config.part:
        raise ValueError(f"{step_key(config.step)}: its parts do not qualify at part {config.part} "
                         f"(refresh.min_share {cfg.refresh.min_share})")
    samples = refresh_lib.extract(store, cfg, q)
    tags = {"dagster_run_id": context.run.run_id, "dagster_asset": "refreshed_drafter",
            "rl_step": step_key(q.step), "refresh_part": str(q.part), "pipeline_run": cfg.run}
    job = refresh_lib.training_job(store, cfg, q, registry, tags)
    started = time.perf_counter()
    trained = pipeline.launcher().launch(context, job).get_materialize_result()
    record = refresh_lib.finish(store, cfg, registry, q, job, time.perf_counter() - started)
    context.log.info(f"{step_key(q.step)} refresh on parts {list(q.parts)}: {record.decision}")
    return dg.MaterializeResult(metadata={
        **(trained.metadata or {}),
        "step": q.step, "part": q.part, "parts": str(list(q.parts)), "rollouts": q.rows, "samples": samples,
        "tau_refreshed": round(record.tau_refreshed or 0.0, 3), "tau_champion": round(record.tau_champion or 0.0, 3),
        "deployed": record.deployed, "decision": record.decision,
        "refresh_latency_s": record.latency_s if record.latency_s is not None else -1.0,  # -1: not deployed
        "uri": dg.MetadataValue.path(store.uri(refresh_key(cfg.run, q.step))),
    })
