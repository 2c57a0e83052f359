"""The Pipes message channel of a launched stage: a temp file the worker appends JSON lines to, read by
whole lines, every one of them, or the step fails naming what did not arrive.

Dagster's `PipesFileMessageReader` tails the file with `readline()` and parses whatever it returns.
At the end of the file that is the part of a line the writer has put there so far: a message longer
than one write (a materialization with a loss curve in its metadata) read mid-write fails to parse,
the reader thread stops, and the step's materialization, checks and logs after it are lost. This
reader holds a partial line until its newline arrives.

Dagster's tail also asks whether the session closed only after a read found the file's end: lines the
worker appends between that read and the question (its last report, its `closed` message, written just
before it exits or answers) are never read. On a loaded machine the reader thread waits for the CPU
between the two, and the step lost its asset check that way. This reader takes the answer first and then
reads: once the session is closed the worker has written everything, so the read that follows sees it all.

A session that ends without the worker's `closed` message (the worker's last message, after its reports)
fails the step, naming how many messages arrived and the last one: what followed it is lost, and a step
must not pass with a report missing.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from threading import Event

import dagster as dg
from dagster_pipes import PIPES_PROTOCOL_VERSION_FIELD

POLL_S = 0.01  # Dagster's own tail interval


def forward_line(handler, line: str) -> dict | None:  # noqa: ANN001 (Dagster's handler)
    """A log line that is a Pipes message handed to Dagster's handler (and returned), any other line printed: a
    launched job's log holds both."""
    try:
        message = json.loads(line)
    except ValueError:
        message = None
    if isinstance(message, dict) and PIPES_PROTOCOL_VERSION_FIELD in message:
        handler.handle_message(message)
        return message
    sys.stdout.write(line + "\n")  # into the step's captured stdout, as Dagster's own readers do
    return None


def whole_lines(path: str, should_stop: Callable[[], bool]) -> Iterator[str]:
    """The file's lines as they are appended, each once it ends in a newline, until `should_stop` and the file
    read to its end after it said so; what is left of an unfinished line is then handed on too (its parse
    fails loudly rather than vanishing)."""
    pending = ""
    with open(path, encoding="utf-8") as stream:
        while True:
            stopping = should_stop()  # before the read: a line written before the stop is read below
            pending += stream.readline()
            if pending.endswith("\n"):
                yield pending
                pending = ""
            elif stopping:
                if pending:
                    yield pending
                return
            else:
                time.sleep(POLL_S)


class CountedMessages:
    """A Pipes message reader's count of what arrived (`counted` each message), and the end of its session: a
    session without the worker's `closed` message fails the step, naming what arrived last. Mixed in ahead of the
    Dagster reader it checks."""

    _received, _last = 0, "none"

    def counted(self, message: object) -> None:
        self._received += 1
        self._last = str(message.get("method", "?")) if isinstance(message, dict) else "?"

    @contextmanager
    def read_messages(self, handler) -> Iterator[dg.PipesParams]:  # noqa: ANN001 (Dagster's handler)
        with super().read_messages(handler) as params:  # its exit joins the reader thread
            yield params
        if not handler.received_closed_message:
            raise dg.Failure(
                f"the stage's Pipes messages did not all reach Dagster: {self._received} arrived (the last: "
                f"{self._last}), not its `closed` message; what the worker reported after that (its materialization, "
                "asset check results, logs) is lost, so the step fails rather than pass without them")


class PipesWholeLineFileMessageReader(CountedMessages, dg.PipesFileMessageReader):
    """`PipesFileMessageReader` reading every whole line, and failing a session that lost its end."""

    def _reader_thread(self, handler, is_resource_complete: Event) -> None:  # noqa: ANN001 (Dagster's handler)
        try:
            for line in whole_lines(self._path, is_resource_complete.is_set):
                message = json.loads(line)
                handler.handle_message(message)
                self.counted(message)
        except:  # noqa: E722 - Dagster's reader reports every failure of its thread, then ends it
            handler.report_pipes_framework_exception(f"{self.__class__.__name__} reader thread", sys.exc_info())
            raise


class PipesWholeLineTempFileMessageReader(dg.PipesTempFileMessageReader):
    """`PipesTempFileMessageReader` whose thread reads whole lines."""

    @contextmanager
    def read_messages(self, handler) -> Iterator[dg.PipesParams]:  # noqa: ANN001 (Dagster's handler)
        with tempfile.TemporaryDirectory() as folder:
            reader = PipesWholeLineFileMessageReader(str(Path(folder) / "messages"),
                                                     include_stdio_in_messages=self._include_stdio_in_messages)
            with reader.read_messages(handler) as params:
                yield params
