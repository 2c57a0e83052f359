"""Fault injection for tests/integration/test_stages.py (on PYTHONPATH only there): in the process of torchrun
rank `DRAFTER_TEST_KILL_RANK`, SIGKILL itself when it starts writing its second shard, its first one
written. A real kill of a real rank; nothing in the pipeline knows of it."""

import os
import signal

if os.environ.get("DRAFTER_TEST_KILL_RANK") and os.environ.get("RANK") == os.environ["DRAFTER_TEST_KILL_RANK"]:
    from pipeline.data import shards

    _write_shard = shards._write_shard
    _written = []

    def _dies_on_its_second_shard(*args, **kwargs):
        if _written:
            os.kill(os.getpid(), signal.SIGKILL)
        _written.append(1)
        return _write_shard(*args, **kwargs)

    shards._write_shard = _dies_on_its_second_shard
