"""One lifetime of Dagster's sensor daemon: iterations of its real sensor loop, then exit (or die).

    DAGSTER_HOME=... DRAFTER_PIPELINE_CONFIG=... \
        python -m tests.support.daemon_child <clock_s>[,<clock_s>...] [crash_point]

The iteration is Dagster's own (`execute_sensor_iteration`, what `dagster-daemon run` calls every few
seconds) against the instance in $DAGSTER_HOME, with the code location loaded in this process; one
iteration per clock value. The clock is set to each <clock_s> in turn (Dagster's test clock) so that
successive ticks are past the sensors' minimum interval without waiting for it. A crash point is one
of Dagster's own crash flags (TICK_CREATED, TICK_HELD, RUN_CREATED, RUN_LAUNCHED): the process
SIGKILLs itself there.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(clocks: list[float], crash_point: str = "") -> None:
    from dagster import DagsterInstance
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.test_utils import freeze_time
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget
    from dagster._daemon.sensor import execute_sensor_iteration

    from jobs.sensors import SENSOR_NAME

    origin = InProcessCodeLocationOrigin(
        LoadableTargetOrigin(executable_path=sys.executable, python_file=str(ROOT / "definitions.py"),
                             attribute="defs", working_directory=str(ROOT)),
        location_name="pipeline",
    )
    flags = {SENSOR_NAME: {crash_point: signal.SIGKILL}} if crash_point else None
    with DagsterInstance.get() as instance, \
            WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(origin)) as context:
        for clock_s in clocks:
            with freeze_time(clock_s):
                list(execute_sensor_iteration(context, logging.getLogger("daemon"), None, None,
                                              debug_crash_flags=flags))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main([float(c) for c in sys.argv[1].split(",")], *sys.argv[2:])
