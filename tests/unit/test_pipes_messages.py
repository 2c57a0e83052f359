"""The Pipes message file is read by whole lines: a message read while its writer is mid-line is not lost."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from resources.pipes_messages import whole_lines


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
