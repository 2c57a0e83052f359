"""demo/daemon.py's SensorTicks: what the Dagster daemon does with a sensor, done in-process against a real Dagster
instance: the partitions a tick asks for added, each run key run once, the cursor kept between ticks."""

# No `from __future__ import annotations`: Dagster reads the op's context annotation at definition.
import json

import dagster as dg
from dagster import OpExecutionContext

from demo.daemon import RUN_KEY_TAG, SensorTicks

STEPS = dg.DynamicPartitionsDefinition(name="test_steps")


@dg.op
def note_step(context: OpExecutionContext) -> str:
    return context.partition_key


@dg.job(partitions_def=STEPS)
def step_job() -> None:
    note_step()


@dg.sensor(job=step_job)
def step_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
    """Requests step n + 1 after the cursor's step n, up to step 2 (a stand-in for newly committed RL steps); the
    run key is the step's, so a tick without the cursor requests the same key again."""
    seen = json.loads(context.cursor)["step"] if context.cursor else 0
    step = seen + 1
    if step > 2:
        return dg.SkipReason("no new step")
    key = f"step-{step:06d}"
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=key, partition_key=key, tags={"test/step": str(step)})],
        dynamic_partitions_requests=[STEPS.build_add_request([key])],
        cursor=json.dumps({"step": step}))


DEFS = dg.Definitions(jobs=[step_job], sensors=[step_sensor])


def _runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    return sorted(instance.get_runs(), key=lambda r: r.tags[RUN_KEY_TAG])


def test_a_tick_adds_its_partitions_runs_its_request_and_keeps_the_cursor() -> None:
    progress: list[str] = []
    with dg.instance_for_test() as instance:
        ticks = SensorTicks(instance, DEFS)
        assert ticks.tick(step_sensor, "step_job", progress.append)
        assert instance.get_dynamic_partitions("test_steps") == ["step-000001"]
        [run] = _runs(instance)
        assert run.status == dg.DagsterRunStatus.SUCCESS
        assert run.job_name == "step_job"
        assert run.tags[RUN_KEY_TAG] == "step-000001"
        assert run.tags["dagster/partition"] == "step-000001"
        assert run.tags["test/step"] == "1"  # the request's own tags travel with the run
        assert progress == ["step-000001 running in Dagster"]
        assert ticks.cursors["step_sensor"] == json.dumps({"step": 1})

        # the next tick evaluates from the kept cursor: the next step
        assert ticks.tick(step_sensor, "step_job", progress.append)
        assert [r.tags[RUN_KEY_TAG] for r in _runs(instance)] == ["step-000001", "step-000002"]
        assert instance.get_dynamic_partitions("test_steps") == ["step-000001", "step-000002"]


def test_a_run_key_already_run_runs_nothing_again() -> None:
    """Another process's ticks (the demo's restart: a fresh SensorTicks, no cursor) over the same instance."""
    with dg.instance_for_test() as instance:
        assert SensorTicks(instance, DEFS).tick(step_sensor, "step_job", lambda _: None)
        progress: list[str] = []
        again = SensorTicks(instance, DEFS)
        assert again.tick(step_sensor, "step_job", progress.append)  # evaluated: same request, same key
        assert [r.tags[RUN_KEY_TAG] for r in _runs(instance)] == ["step-000001"]
        assert progress == []
        assert again.cursors["step_sensor"] == json.dumps({"step": 1})  # the cursor moves on all the same


def test_a_skipping_sensor_runs_nothing_and_keeps_its_cursor() -> None:
    with dg.instance_for_test() as instance:
        ticks = SensorTicks(instance, DEFS)
        ticks.cursors["step_sensor"] = json.dumps({"step": 2})
        assert not ticks.tick(step_sensor, "step_job", lambda _: None)
        assert instance.get_runs() == []
        assert instance.get_dynamic_partitions("test_steps") == []
        assert ticks.cursors["step_sensor"] == json.dumps({"step": 2})
