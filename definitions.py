"""The Dagster code location: assets, checks, jobs, sensors and the pipeline resource.

The pipeline config comes from $DRAFTER_PIPELINE_CONFIG (embedded defaults when unset); it is
read when a run or a sensor tick starts (see `resources`), not when this module loads.
"""

from __future__ import annotations

import dagster as dg

from assets.cotraining import acceptance, drafter, drafter_buffer, hidden_states, rollouts
from assets.fleet import fleet
from assets.refresh import refreshed_drafter
from jobs import deploy_job, refresh_job, rl_step_job, simulate_rl_job
from jobs.sensors import champion_sensor, live_tau_sensor, refresh_sensor, rl_step_sensor
from resources import pipeline_resource


def build_definitions(config_path: str | None = None, overrides: dict | None = None) -> dg.Definitions:
    return dg.Definitions(
        assets=[rollouts, hidden_states, drafter_buffer, drafter, acceptance, fleet, refreshed_drafter],
        jobs=[rl_step_job, simulate_rl_job, deploy_job, refresh_job],
        sensors=[rl_step_sensor, champion_sensor, live_tau_sensor, refresh_sensor],
        resources={"pipeline": pipeline_resource(config_path, overrides)},
        # A step's assets form a chain, so a process per asset (the multiprocess default) would only add
        # start-up: five imports of torch, transformers and MLflow per step. Pools are honoured in-process.
        executor=dg.in_process_executor,
    )


defs = build_definitions()
