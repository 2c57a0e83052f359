"""The partitioning of the co-training assets: one partition per RL step, and the run tag that
asks for a retraining off the schedule."""

import dagster as dg

from pipeline.data.keys import parse_step_key

rl_step = dg.DynamicPartitionsDefinition(name="rl_step")

RETRAIN_TAG = "retrain_reason"  # set by live_tau_sensor: train even off the interval
BACKFILL_TAG = "dagster/backfill"  # Dagster's tag on every run of a backfill: those train every step, in order


def step_of(context: dg.AssetExecutionContext) -> int:
    return parse_step_key(context.partition_key)
