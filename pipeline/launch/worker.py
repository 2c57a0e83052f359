"""What every launched stage worker shares (`pipeline.{sources,training,evaluation,refresh}.worker`): staying no
longer than its launcher, the Pipes extras on ranks other than 0, the entry of extraction and evaluation, and a
warm worker's jobs (`pipeline.launch.warm`), each run as a fresh process runs it.

Only rank 0 opens Dagster Pipes' message channel, so Dagster sees one process per stage; the
other ranks read the job from the Pipes context alone. Only workers import this module and
`dagster_pipes` (a dependency-free protocol library); the orchestrator imports neither.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from dagster_pipes import (
    PipesContext,
    PipesDefaultContextLoader,
    PipesEnvVarParamsLoader,
    PipesMappingParamsLoader,
    open_dagster_pipes,
)

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


# --- a warm worker's jobs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessState:
    """The process-wide state a job may change, as the worker found it at start (a fresh process's)."""

    rng: torch.Tensor
    seed: int
    dtype: torch.dtype
    threads: int
    grad: bool
    deterministic: bool
    environ: dict[str, str]
    cwd: Path

    @classmethod
    def capture(cls) -> ProcessState:
        return cls(torch.get_rng_state(), torch.initial_seed(), torch.get_default_dtype(), torch.get_num_threads(),
                   torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(), dict(os.environ),
                   Path.cwd())

    def restore(self) -> None:
        torch.set_rng_state(self.rng)
        if torch.cuda.is_initialized():  # a fresh process's CUDA generators start from the default seed
            torch.cuda.manual_seed_all(self.seed)
            torch.cuda.empty_cache()
            for device in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(device)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(self.grad)
        torch.use_deterministic_algorithms(self.deterministic)
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        if "mlflow" in sys.modules:  # the registry uses MlflowClient; a fluent run left open would leak on
            import mlflow

            while mlflow.active_run():
                mlflow.end_run()
        PipesContext._instance = None  # noqa: SLF001  open_dagster_pipes returns an open singleton otherwise
        gc.collect()
        _reset_peak_rss()


def _reset_peak_rss() -> None:
    """The next job's peak resident set (its placement record) is its own, from what the process holds now, as
    a fresh process's counts from its imports (Linux: the high-water mark reset through /proc)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the peak stays the worker's: an upper bound


class WarmJobs:
    """A warm worker's jobs: the stage's rank-0 body over each request's Pipes channel, and between jobs the
    process as a fresh one finds it: torch's RNG state, default dtype, thread count, grad mode and deterministic
    flag, the environment and the working directory restored, an MLflow run left active ended, the peak memory
    (the next job's placement record) reset. Nothing else is kept between jobs: every job loads its policy and
    drafters from the store, so its output is bit for bit a fresh process's."""

    def __init__(self, stage: Stage) -> None:
        self.body = importlib.import_module(stage.worker)  # the imports a fresh process pays for every job
        gc.freeze()  # the imports' objects are never garbage: no collection scans them again (a full one takes 0.5 s)
        self.fresh = ProcessState.capture()

    def run(self, pipes: dict[str, str]) -> None:
        with open_dagster_pipes(params_loader=PipesMappingParamsLoader(pipes)) as context:
            self.body.run_pipes(context)

    def reset(self) -> None:
        self.fresh.restore()
