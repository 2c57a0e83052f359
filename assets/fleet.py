"""The serving fleet as an asset: materialized by the deploy job, once per promotion."""

import time

import dagster as dg
from pydantic import Field

from pipeline.refresh import plan as refresh_lib
from pipeline.serving import deploy
from resources import PipelineResource

UPDATE_WORDS = {"hot": "hot (weights sent, no restart)", "restart": "restarted", "none": "none (already serving it)",
                "rolled back": "rolled back"}


def _cell(text: str) -> str:
    """Text in a Markdown table cell: a server's message may hold a pipe."""
    return text.replace("|", "\\|")


class DeployConfig(dg.Config):
    version: str = Field(description="Registered drafter version to roll out (the `champion`).")


@dg.asset(
    group_name="serving",
    kinds={"vllm"},
    description="The serving fleet: which drafter version runs on which replica, since when, how it got it, and "
    "its live acceptance over the canary window. One replica at a time gets the new drafter weights in place "
    "(vLLM's dev-mode weight-update routes, fleet.update hot) or is restarted with the new --speculative-config "
    "(no such routes, another policy, a failed hot update rolled back first), gated on /health, /v1/models, a "
    "smoke completion and live tau from /metrics; a failed replica is rolled back and the deploy stops. A replica "
    "already serving the version on the newest policy is only gated.",
)
def fleet(context: dg.AssetExecutionContext, config: DeployConfig, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Rolling update to `config.version`; the registry's `live` alias follows only a full success."""
    cfg, registry, store = pipeline.config, pipeline.registry(), pipeline.store()
    # A refreshed drafter of a newer step than the version is not replaced by it (the refresh serves that step).
    try:
        report = deploy.deploy(cfg, store, registry, config.version,
                               fence=lambda: refresh_lib.newer_live_refresh(store, cfg.run, registry, config.version))
    except deploy.DeploySuperseded as exc:  # nothing was touched: the fleet keeps the newer drafter
        context.log.info(f"version {config.version} not deployed: {exc}")
        return dg.MaterializeResult(metadata={"version": registry.alias_version("live") or "none",
                                              "skipped": f"version {config.version}: {exc}",
                                              "driver": cfg.fleet.driver})
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    header = "| replica | version | since (UTC) | live tau | deploy s | update | held s | note |\n" \
             "|---|---|---|---|---|---|---|---|\n"
    table = header + "".join(
        f"| {r.replica} | {r.version} | {since} | {r.live_tau:.2f} | {r.deploy_s:.1f} | "
        f"{UPDATE_WORDS[r.update]} | {r.paused_s:.2f} | {_cell(r.note)} |\n"
        for r in report.replicas
    )
    context.log.info(f"version {config.version} live on {len(report.replicas)} replicas")
    return dg.MaterializeResult(
        metadata={
            "version": config.version,
            "replicas": dg.MetadataValue.md(table),
            "mean_live_tau": sum(r.live_tau for r in report.replicas) / len(report.replicas),
            "driver": cfg.fleet.driver,
            "hot_updated": sum(r.update == "hot" for r in report.replicas),
            "restarted": sum(r.restarted for r in report.replicas),
        }
    )
