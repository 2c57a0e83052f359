"""Fault injection into launched stage workers, for the tests that put this folder on PYTHONPATH (and only
them): Python imports `sitecustomize` at start-up, so a worker process picks these up from its environment.
Nothing in the pipeline knows of them.

    DRAFTER_TEST_KILL_RANK=r           torchrun rank r SIGKILLs itself as it starts writing its second shard
    DRAFTER_TEST_KILL_TRAINING_RANK=r  torchrun rank r of a training SIGKILLs itself as it applies its second optimizer
                                       step: mid-training, one step in
    DRAFTER_TEST_KILL_SHARD=1          the process (a warm stage worker) SIGKILLs itself as it starts its second shard
    DRAFTER_TEST_SLOW_SHARDS=s         every shard write after the first waits s seconds first
    DRAFTER_TEST_SHARD_PROBLEM=msg     the shards check finds `msg` (a stand-in for a corrupted shard)
    DRAFTER_TEST_FAULT_ONCE=path       a kill above fires only in the first process to create `path`: the first
                                       attempt dies, a retry runs clean
"""

import os
import signal


def _first_fault() -> bool:
    once = os.environ.get("DRAFTER_TEST_FAULT_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True

if os.environ.get("DRAFTER_TEST_KILL_RANK") and os.environ.get("RANK") == os.environ["DRAFTER_TEST_KILL_RANK"]:
    from pipeline.data import shard_file

    _write_shard = shard_file.write_shard
    _written = []

    def _dies_on_its_second_shard(*args, **kwargs):
        if _written:
            os.kill(os.getpid(), signal.SIGKILL)
        _written.append(1)
        return _write_shard(*args, **kwargs)

    shard_file.write_shard = _dies_on_its_second_shard

if os.environ.get("RANK") == os.environ.get("DRAFTER_TEST_KILL_TRAINING_RANK", "none"):
    from pipeline.training import loop

    _apply_gradients = loop.apply_gradients
    _applied = []

    def _dies_on_its_second_step(*args, **kwargs):
        if _applied and _first_fault():
            os.kill(os.getpid(), signal.SIGKILL)
        _applied.append(1)
        return _apply_gradients(*args, **kwargs)

    loop.apply_gradients = _dies_on_its_second_step

if os.environ.get("DRAFTER_TEST_KILL_SHARD") or os.environ.get("DRAFTER_TEST_SLOW_SHARDS"):
    import time

    from pipeline.data import shard_file

    _write = shard_file.write_shard
    _started = []

    def _faulty_shard_write(*args, **kwargs):
        if _started and os.environ.get("DRAFTER_TEST_KILL_SHARD"):
            os.kill(os.getpid(), signal.SIGKILL)
        if _started:
            time.sleep(float(os.environ.get("DRAFTER_TEST_SLOW_SHARDS", 0)))
        _started.append(1)
        return _write(*args, **kwargs)

    shard_file.write_shard = _faulty_shard_write

if os.environ.get("DRAFTER_TEST_SHARD_PROBLEM"):
    from pipeline.data import shard_checks

    shard_checks.check_shards = lambda *args: [os.environ["DRAFTER_TEST_SHARD_PROBLEM"]]
