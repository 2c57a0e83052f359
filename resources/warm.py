"""The launcher's Pipes client of a warm stage worker (`launch.launcher: warm`): a one-rank stage's job handed to
its stage's long-lived worker (`pipeline.launch.warm`, which starts the worker when none listens) over a Pipes
session of a launched process's kind: the context in a temp file, the messages read from a temp file by whole
lines (`resources.pipes_messages`).
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from pipeline.launch.rendezvous import Peer
from pipeline.launch.warm import Request, WarmWorker, WarmWorkerError
from pipeline.stages import Stage
from resources.pipes_messages import PipesWholeLineTempFileMessageReader


class PipesWarmClient(dg.PipesClient):
    """One job on the stage's warm worker: its Pipes session, the request, the worker's answer."""

    def __init__(self, stage: Stage, folder: Path, working_dir: Path, idle_s: float) -> None:
        self.worker = WarmWorker(stage, folder, working_dir, idle_s)

    def run(self, *, context: dg.AssetExecutionContext, extras: dict,
            announce: str = "") -> dg.PipesClientCompletedInvocation:
        """The job on the worker; `announce` begins the line logged once the worker has it."""
        worker = self.worker

        def handed(peer: Peer) -> None:
            # Logged while the worker works: an event written before the hand-off or after the answer would
            # lengthen the step.
            context.log.info(f"{announce + ': ' if announce else ''}job handed to the warm {worker.stage} worker "
                             f"(pid {peer.pid}; its log {worker.files.log})")

        with dg.open_pipes_session(context=context, context_injector=dg.PipesTempFileContextInjector(),
                                   message_reader=PipesWholeLineTempFileMessageReader(), extras=extras) as session:
            try:
                worker.run(Request(session.get_bootstrap_env_vars()), handed)
            except WarmWorkerError as exc:
                raise dg.Failure(str(exc)) from None
        return dg.PipesClientCompletedInvocation(session)

