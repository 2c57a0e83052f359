"""A Ray job's log, read in chunks, is handed to Pipes by whole lines: a message cut between two chunks (Ray's
tail cuts at 20,000 characters, or where the writer has got to) arrives whole."""

from __future__ import annotations

import json

from resources.ray_jobs import log_lines


def test_a_message_cut_between_chunks_is_handed_on_whole() -> None:
    message = json.dumps({"method": "report_asset_materialization", "params": {"loss_curve": list(range(9000))}})
    chunks = ["Running entrypoint\n" + message[:20000], None, message[20000:40000], message[40000:] + "\n",
              '{"method": "closed"}\nlast words']
    assert list(log_lines(chunks)) == ["Running entrypoint", message, '{"method": "closed"}', "last words"]


def test_a_log_that_ends_on_its_newline_hands_on_nothing_more() -> None:
    assert list(log_lines(["a\nb\n", None, ""])) == ["a", "b"]
