"""Jobs: one run per RL step through the co-training assets, a deploy per promotion, and
simulated RL steps on demand (the sensors that request them are in `jobs.sensors`)."""

import dagster as dg
from pydantic import Field

from assets.partitions import rl_step
from pipeline.data.keys import step_key
from pipeline.data.rollouts import committed_steps
from resources import PipelineResource

deploy_job = dg.define_asset_job(
    "deploy_job",
    selection=dg.AssetSelection.assets("fleet"),
    description="Roll the `champion` drafter out to the serving fleet.",
)

rl_step_job = dg.define_asset_job(
    "rl_step_job",
    selection=dg.AssetSelection.groups("cotraining"),
    partitions_def=rl_step,
    description="One RL step through the loop: rollouts, hidden states, buffer, drafter, acceptance.",
)


refresh_job = dg.define_asset_job(
    "refresh_job",
    selection=dg.AssetSelection.assets("refreshed_drafter"),
    description="Refresh the fleet's drafter from a step's first parts, while its tail is still generating.",
)


class SimulateConfig(dg.Config):
    steps: int = Field(default=1, ge=1, description="How many further RL steps to simulate.")


@dg.op(description="Run the built-in simulated RL trainer for the next step(s); the sensor picks them up.")
def simulate_rl_steps(
    context: dg.OpExecutionContext,
    config: SimulateConfig,
    pipeline: PipelineResource,
) -> None:
    simulator = pipeline.simulator()
    done = committed_steps(pipeline.store(), pipeline.config.run)
    for step in range(max(done, default=0) + 1, max(done, default=0) + 1 + config.steps):
        pointer = simulator.run_step(step)
        context.log.info(f"simulated {step_key(step)} (policy version {pointer.policy_version})")


@dg.job(description="Simulate further RL steps with the built-in RL stand-in (embedded default source).")
def simulate_rl_job() -> None:
    simulate_rl_steps()
