"""What every launched stage worker shares (`pipeline.{sources,training,evaluation}.worker`): staying no
longer than its launcher, the Pipes extras on ranks other than 0, and the entry of extraction and evaluation.

Only rank 0 opens Dagster Pipes' message channel, so Dagster sees one process per stage; the
other ranks read the job from the Pipes context alone. Only workers import this module and
`dagster_pipes` (a dependency-free protocol library); the orchestrator imports neither.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from dagster_pipes import PipesContext, PipesDefaultContextLoader, PipesEnvVarParamsLoader, open_dagster_pipes

from pipeline.launch.process import JobError, StageJob
from pipeline.ranks import Ranks, ranks_from_env
from pipeline.stages import Stage


def exit_with_launcher(poll_s: float = 1.0) -> None:
    """Exit when the launching process (torchrun's agent, or the Dagster step) is gone: a killed launcher
    must not leave ranks working, and writing, behind it."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def is_pipes_process() -> bool:
    return PipesEnvVarParamsLoader().is_dagster_pipes_process()


def job_extra(pipes: PipesContext, name: str = "job") -> object:
    """The Pipes extra `name` of an open channel; JobError when there is no channel (`open_dagster_pipes`
    without its bootstrap parameters hands back a stand-in that accepts everything) or no such extra: a stage
    never runs on a job it was not given."""
    if not isinstance(pipes, PipesContext):
        raise JobError("no Dagster Pipes context: the request carried no job (a launcher's Pipes bootstrap "
                       "parameters), so there is nothing to run")
    if name not in pipes.extras:
        raise JobError(f"the Pipes context carries no `{name}`: there is nothing to run")
    return pipes.extras[name]


def stage_job(pipes: PipesContext, stage: Stage) -> StageJob:
    """The `stage` job the channel carries, every field present (StageJob.from_dict); JobError otherwise."""
    return StageJob.from_dict(job_extra(pipes), stage)


def pipes_extras() -> dict:
    """The Pipes context's extras, read without opening the message channel (ranks other than 0)."""
    params = PipesEnvVarParamsLoader().load_context_params()
    with PipesDefaultContextLoader().load_context(params) as data:
        return dict(data["extras"])


def run_stage_worker(stage: Stage, run_share: Callable[[StageJob, Ranks], object],
                     run_pipes: Callable[[PipesContext, Ranks], None]) -> None:
    """A launched extraction or evaluation: ranks other than 0 do their share of the job from the Pipes
    context; rank 0 runs the stage's body (`run_pipes`, also a warm worker's) over Pipes' channel."""
    ranks = ranks_from_env()
    exit_with_launcher()
    if not is_pipes_process():
        raise SystemExit(f"{stage.worker}: no job; launch it from the {stage.asset} asset (Dagster Pipes)")
    if not ranks.is_main:
        run_share(StageJob.from_dict(pipes_extras().get("job"), stage), ranks)
        return
    with open_dagster_pipes() as pipes:
        run_pipes(pipes, ranks)
