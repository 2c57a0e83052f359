"""The Dagster code location: assets, checks, jobs, sensors and resources of the pipeline.

The pipeline config comes from $DRAFTER_PIPELINE_CONFIG (embedded defaults when unset).
"""

from __future__ import annotations

import dagster as dg

from assets.cotraining import acceptance, drafter, drafter_buffer, hidden_states, rollouts
from assets.fleet import fleet
from jobs import champion_sensor, deploy_job, live_tau_sensor, rl_step_job, rl_step_sensor, simulate_rl_job
from resources import build_resources


def build_definitions(config_path: str | None = None, overrides: dict | None = None) -> dg.Definitions:
    return dg.Definitions(
        assets=[rollouts, hidden_states, drafter_buffer, drafter, acceptance, fleet],
        jobs=[rl_step_job, simulate_rl_job, deploy_job],
        sensors=[rl_step_sensor, champion_sensor, live_tau_sensor],
        resources=build_resources(config_path, overrides),
        # A step's assets form a chain, so a process per asset (the multiprocess default) would only add
        # start-up: five imports of torch, transformers and MLflow per step. Pools are honoured in-process.
        executor=dg.in_process_executor,
    )


defs = build_definitions()
