"""The Pipes message channel of a launched stage: a temp file the worker appends JSON lines to, read by
whole lines.

Dagster's `PipesFileMessageReader` tails the file with `readline()` and parses whatever it returns.
At the end of the file that is the part of a line the writer has put there so far: a message longer
than one write (a materialization with a loss curve in its metadata) read mid-write fails to parse,
the reader thread stops, and the step's materialization, checks and logs after it are lost. This
reader holds a partial line until its newline arrives.
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

POLL_S = 0.01  # Dagster's own tail interval


def whole_lines(path: str, should_stop: Callable[[], bool]) -> Iterator[str]:
    """The file's lines as they are appended, each once it ends in a newline; when `should_stop`, what is
    left of an unfinished line is handed on too (its parse then fails loudly rather than vanishing)."""
    pending = ""
    with open(path, encoding="utf-8") as stream:
        while True:
            pending += stream.readline()
            if pending.endswith("\n"):
                yield pending
                pending = ""
            elif should_stop():
                if pending:
                    yield pending
                return
            else:
                time.sleep(POLL_S)


class PipesWholeLineFileMessageReader(dg.PipesFileMessageReader):
    def _reader_thread(self, handler, is_resource_complete: Event) -> None:  # noqa: ANN001 (Dagster's handler)
        try:
            for line in whole_lines(self._path, is_resource_complete.is_set):
                handler.handle_message(json.loads(line))
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
