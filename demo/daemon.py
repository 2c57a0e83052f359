"""What the Dagster daemon does for the demo, done in the demo's processes against the persisted instance: sensor
ticks and the runs they request, the refresh sensor's runs in a process beside the step runs, and the stages' warm
workers started ahead of the first step."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ops.console import out, quiet_libraries
from pipeline.config import PROJECT_ROOT
from pipeline.stages import REFRESH, Stage

if TYPE_CHECKING:
    import dagster as dg

    from pipeline.data.store import ObjectStore
    from pipeline.registry import DrafterRegistry


# The tag under which Dagster records the run key of a sensor's run request (the daemon skips a
# request whose key a run already carries; the demo does the same).
RUN_KEY_TAG = "dagster/run_key"


class SensorTicks:
    """What the Dagster daemon does with a sensor, done in this process against the persisted
    instance: evaluate it with its cursor, add the partitions it asks for, and run each of its
    requests once per run key."""

    def __init__(self, instance: dg.DagsterInstance, defs: dg.Definitions) -> None:
        self.instance, self.defs, self.cursors = instance, defs, {}

    def tick(self, sensor: dg.SensorDefinition, job_name: str, progress: Callable[[str], None]) -> bool:
        """One evaluation of `sensor`; False when it skipped."""
        import dagster as dg

        result = sensor(dg.build_sensor_context(
            instance=self.instance, cursor=self.cursors.get(sensor.name), sensor_name=sensor.name,
            resources=self.defs.resources, definitions=self.defs))
        if isinstance(result, dg.SkipReason):
            return False
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        for request in result.run_requests:
            if self.instance.get_runs(dg.RunsFilter(tags={RUN_KEY_TAG: request.run_key}), limit=1):
                continue
            progress(f"{request.partition_key or request.run_key} running in Dagster")
            # The run's full event log is in the instance (`make ui`); the terminal shows progress only.
            self.defs.resolve_job_def(job_name).execute_in_process(
                instance=self.instance, partition_key=request.partition_key,
                run_config={**(request.run_config or {}), **QUIET_RUN},
                tags={**request.tags, RUN_KEY_TAG: request.run_key})
        self.cursors[sensor.name] = result.cursor
        return True


QUIET_RUN = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


REFRESH_TICK_S = 0.5  # the demo's refresh sensor interval: its wait is part of the refresh's latency


PIPELINE_TICK_S = 0.5  # the demo's step sensor interval when nothing is new (a tick costs CPU the stages share)


FLEET_WAIT_S = 300.0  # the last champion's deploy, at the demo's end


def pipeline_tick(ticks: SensorTicks, with_fleet: bool, progress: Callable[[str], None]) -> bool:
    """One tick of what the daemon runs: the rl_step sensor's runs for newly committed steps, then the
    champion sensor's deploy of a promotion. False when there was nothing new."""
    from jobs.sensors import champion_sensor, rl_step_sensor

    ran = ticks.tick(rl_step_sensor, "rl_step_job", progress)
    if with_fleet:
        ran = ticks.tick(champion_sensor, "deploy_job", lambda m: progress(f"deploy, {m}")) or ran
    return ran


def prestart_workers(config_path: str | None, overrides: dict | None, stages: list[Stage]) -> threading.Thread:
    """The warm workers of `stages` started in a background thread, one after the other, off any step's clock:
    what this process's runs launch then finds them listening. A worker that fails to start is started again
    by its stage's first job, whose error then says why."""
    from resources import pipeline_resource

    def start() -> None:
        with contextlib.suppress(Exception):
            pipeline_resource(config_path, overrides).launcher().prestart(stages)

    thread = threading.Thread(target=start, name="prestart-workers", daemon=True)
    thread.start()
    return thread


def refresh_ticks(config_path: str | None, overrides: dict | None, every_s: float = REFRESH_TICK_S,
                  deploys: bool = False) -> None:
    """The refresh sensor and the runs it requests (with `deploys`, first the champion sensor's deploys), in this
    process, until its standard input closes: what the Dagster daemon runs beside the step runs. A process of its
    own (the demo starts one): Dagster configures the logging of a run as it starts it, which two runs in one
    process's threads would do at once. The refresh's warm worker starts with it, before the first step's parts
    arrive."""
    import dagster as dg

    from definitions import build_definitions
    from jobs.sensors import champion_sensor, refresh_sensor

    quiet_libraries()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), name="stdin-watch", daemon=True).start()
    instance = dg.DagsterInstance.get()
    ticks = SensorTicks(instance, build_definitions(config_path, overrides))
    prestart_workers(config_path, overrides, [REFRESH])
    while not stop.is_set():
        if deploys:
            ticks.tick(champion_sensor, "deploy_job", lambda line: out(f"deploy, {line}"))
        ticks.tick(refresh_sensor, "refresh_job", lambda line: out(line))
        stop.wait(every_s)


class RefreshProcess:
    """`cli.py refresh-ticks --deploys` beside the demo's loop, so that no step run waits for a deploy (the daemon
    runs them side by side too); it ends when the demo closes its standard input."""

    def __init__(self, config_path: str | None, overrides: dict | None, log: Path) -> None:
        argv = [sys.executable, str(PROJECT_ROOT / "cli.py"), *(["--config", config_path] if config_path else []),
                "refresh-ticks", "--deploys", *(["--overrides", json.dumps(overrides)] if overrides else [])]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with log.open("w") as sink:
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT,
                                            cwd=PROJECT_ROOT)

    def raise_if_failed(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the refresh process exited with {self.process.returncode}; see {self.log}")

    def wait_for_champion(self, store: ObjectStore, run: str, registry: DrafterRegistry,
                          timeout_s: float = FLEET_WAIT_S) -> None:
        """Until the fleet runs the champion (its deploy is this process's) or a refreshed drafter newer than it
        (which the champion does not replace), or the process has failed."""
        from pipeline.refresh.plan import newer_live_refresh

        deadline = time.monotonic() + timeout_s
        while (champion := registry.alias_version("champion")) and champion != registry.alias_version("live") \
                and not newer_live_refresh(store, run, registry, champion):
            self.raise_if_failed()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not run the champion within {timeout_s:.0f} s; see {self.log}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # its loop ends after the run in progress
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                self.process.wait()
