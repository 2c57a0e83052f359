"""Fault injection into launched stage workers, for the tests that put this folder on PYTHONPATH (and only
them): Python imports `sitecustomize` at start-up, so a worker process picks these up from its environment.
Nothing in the pipeline knows of them.

    DRAFTER_TEST_KILL_RANK=r        torchrun rank r SIGKILLs itself as it starts writing its second shard
    DRAFTER_TEST_SHARD_PROBLEM=msg  the shards check finds `msg` (a stand-in for a corrupted shard)
"""

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

if os.environ.get("DRAFTER_TEST_SHARD_PROBLEM"):
    from pipeline.data import shard_checks

    shard_checks.check_shards = lambda *args: [os.environ["DRAFTER_TEST_SHARD_PROBLEM"]]
