"""The Pipes message file is read by whole lines, to its end: a message read while its writer is mid-line, or
written just before the session closes, is not lost, and a session that lost its end fails the step."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import dagster as dg
import pytest

from resources.pipes_messages import PipesWholeLineFileMessageReader, whole_lines


def test_a_line_read_mid_write_is_handed_on_whole(tmp_path: Path) -> None:
    path = tmp_path / "messages"
    message = json.dumps({"method": "report_asset_materialization", "params": {"loss_curve": list(range(3000))}})
    path.write_text("")
    stop, lines = threading.Event(), []
    reader = threading.Thread(target=lambda: lines.extend(whole_lines(str(path), stop.is_set)))
    reader.start()
    with path.open("a") as stream:  # the writer's two writes of one long message
        stream.write(message[:5000])
        stream.flush()
        time.sleep(0.2)  # the reader polls every 10 ms: it meets the file's end inside the line
        stream.write(message[5000:] + "\n")
        stream.write('{"method": "closed"}\n')
    time.sleep(0.1)
    stop.set()
    reader.join(timeout=10)

    assert [json.loads(line)["method"] for line in lines] == ["report_asset_materialization", "closed"]
    assert json.loads(lines[0]) == json.loads(message)


def test_an_unfinished_last_line_is_handed_on_when_the_session_closes(tmp_path: Path) -> None:
    path = tmp_path / "messages"
    path.write_text('{"method": "opened"}\n{"method": "repo')

    assert list(whole_lines(str(path), lambda: True)) == ['{"method": "opened"}\n', '{"method": "repo']


@pytest.mark.reliability("fault", "the worker's last Pipes messages written between the reader's last read and the "
                                  "session's close (a reader thread starved of CPU): read, not lost")
def test_lines_written_just_before_the_session_closes_are_read(tmp_path: Path) -> None:
    """The worker writes its last report and `closed`, then answers; the launcher closes the session. A reader
    that read the file's end just before, and is asked whether the session closed just after, reads on."""
    path = tmp_path / "messages"
    path.write_text('{"method": "opened"}\n')
    asked = []

    def should_stop() -> bool:  # the session closes between the reader's read of the end and its question
        if len(asked) == 1:
            with path.open("a") as stream:
                stream.write('{"method": "report_asset_check"}\n{"method": "closed"}\n')
        asked.append(True)
        return len(asked) > 1

    methods = [json.loads(line)["method"] for line in whole_lines(str(path), should_stop)]

    assert methods == ["opened", "report_asset_check", "closed"]


class _Handler:
    """What Dagster's message handler tells a reader: whether the worker's `closed` message arrived."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    def handle_message(self, message: dict) -> None:
        self.messages.append(message)

    @property
    def received_closed_message(self) -> bool:
        return any(m.get("method") == "closed" for m in self.messages)

    def report_pipes_framework_exception(self, origin: str, exc_info: object) -> None:
        pass


@pytest.mark.reliability("fault", "a Pipes session that ends without the worker's closed message: the step fails "
                                  "naming what arrived last, never passes without its reports")
def test_a_session_without_its_closed_message_fails_naming_what_arrived(tmp_path: Path) -> None:
    def session(path: Path, lines: str) -> _Handler:
        handler = _Handler()
        with PipesWholeLineFileMessageReader(str(path)).read_messages(handler) as params:
            with open(params["path"], "a") as stream:
                stream.write(lines)
        return handler

    with pytest.raises(dg.Failure) as failed:
        session(tmp_path / "messages", '{"method": "opened", "params": {}}\n{"method": "log", "params": {}}\n')

    assert "2 arrived (the last: log), not its `closed` message" in str(failed.value)
    assert "asset check results" in str(failed.value)

    closed = session(tmp_path / "complete", '{"method": "opened", "params": {}}\n{"method": "closed", "params": {}}\n')
    assert [m["method"] for m in closed.messages] == ["opened", "closed"]
