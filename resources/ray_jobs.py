"""The launcher's Pipes client of a stage's Ray job (`launch.launcher: ray`): dagster-ray's `PipesRayJobClient`
(submission through Ray's job API, the job stopped when the Dagster step is interrupted), its Pipes context in the
job's environment and its messages read from the job's log, by whole lines, every one of them.

dagster-ray's reader splits each chunk of the log tail at newlines, but Ray's tail cuts a chunk at 20,000
characters or at the end of what is written so far, which may fall inside a line: a long message (a
materialization with a loss curve in its metadata) read in two pieces parses as neither and is lost. This reader
holds a partial line until its newline arrives, and, as `resources.pipes_messages` does for a launched process,
fails the step when the worker's `closed` message (its last) never arrives.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator

from dagster_ray import PipesRayJobClient
from dagster_ray.core.pipes import PipesRayJobMessageReader, tail_logs

from pipeline.launch.placement import SUBMITTED_AT_ENV
from resources.pipes_messages import CountedMessages, forward_line

POLL_S = 0.1  # the job's status: a stage's end reaches Dagster this soon (dagster-ray's default: 1 s)


def log_lines(chunks: Iterable[str | None]) -> Iterator[str]:
    """The lines of a log read in chunks (None: nothing new yet), each whole: a chunk may end inside a line,
    whose rest comes in the next. A last line without its newline is handed on too."""
    pending = ""
    for chunk in chunks:
        *lines, pending = (pending + (chunk or "")).split("\n")
        yield from lines
    if pending:
        yield pending


class PipesRayJobWholeLineMessageReader(CountedMessages, PipesRayJobMessageReader):
    """dagster-ray's reader of a Ray job's log, taking whole lines and failing a session that lost its end."""

    def handle_job_logs(self, handler) -> None:  # noqa: ANN001 (Dagster's handler)
        try:
            while self._job_id is None and not self.session_closed.is_set():
                time.sleep(0.05)
            self.thread_ready.set()
            if self._job_id is None:
                return  # never submitted: the session's own error says why
            for line in log_lines(tail_logs(self.client.tail_job_logs(job_id=self.job_id))):  # ends with the job
                self._handle(handler, line)
        except:  # noqa: E722 - Dagster's reader reports every failure of its thread, then ends it
            handler.report_pipes_framework_exception(f"{self.__class__.__name__} reader thread", sys.exc_info())
            raise
        finally:
            self.completed.set()

    def _handle(self, handler, line: str) -> None:  # noqa: ANN001 (Dagster's handler)
        if not line:
            return
        message = forward_line(handler, line)
        if message is not None:
            self.counted(message)


class PipesRayStageClient(PipesRayJobClient):
    """dagster-ray's Ray job client with the whole-line reader; the job's environment carries its submission
    time (`SUBMITTED_AT_ENV`), from which the worker records how long the job waited for its resources. Every
    request, the submission's and the log reader's, carries the cluster's token (`rayjob.cluster_token`)."""

    def __init__(self, address: str | None, token: str) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        super().__init__(address=address or None, headers=headers, poll_interval=POLL_S,
                         message_reader=PipesRayJobWholeLineMessageReader({"headers": headers}))

    def _start(self, context, session, submit_job_params) -> str:  # noqa: ANN001 (dagster-ray's types)
        submit_job_params["runtime_env"]["env_vars"][SUBMITTED_AT_ENV] = repr(time.time())
        return super()._start(context, session, submit_job_params)
