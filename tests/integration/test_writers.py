"""Writers of one step are fenced (pipeline.data.lease): two processes materializing the same step at
once, many times over, on file:// and on S3 (moto on loopback), never lose committed data."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs
import torch
from moto.server import ThreadedMotoServer

from pipeline.data import lease, shard_format, shards
from pipeline.data.keys import hidden_states_prefix
from pipeline.data.shard_format import HiddenSample
from pipeline.data.store import ObjectStore, storage_options_for
from tests.integration.test_s3 import BUCKET, CREDENTIALS, _free_port

RUN, STEP, HIDDEN = "race", 1, 8
ROUNDS = {"file": 12, "s3": 6}  # moto answers slowly: fewer rounds keep the test to seconds
TARGET = {"model_id": "tiny"}


def _samples(writer: int, n: int = 6) -> list[HiddenSample]:
    g = torch.Generator().manual_seed(writer)
    return [HiddenSample(f"w{writer}-{i}", STEP, torch.arange(1, 9), torch.ones(8, dtype=torch.int64),
                         torch.randn(8, 1, HIDDEN, generator=g).to(torch.bfloat16)) for i in range(n)]


def _writer(root: str, endpoint: str, writer: int, rounds: int, start: mp.Barrier, done: mp.Barrier,
            errors: mp.Queue) -> None:
    """One racing writer: each round, waits at the start line, writes the step, reports, waits for the check."""
    os.environ.update(CREDENTIALS)
    store = ObjectStore(root, storage_options_for(root, endpoint))
    samples = _samples(writer)
    for _ in range(rounds):
        start.wait(timeout=30)
        try:
            shards.write_hidden_states(store, RUN, STEP, samples, hidden_size=HIDDEN, layer_ids=[1], target=TARGET,
                                       samples_per_shard=2, lease_wait_s=20)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test
            errors.put(f"writer {writer}: {type(exc).__name__}: {exc}")
        done.wait(timeout=30)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=(port := _free_port()), verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).makedirs(
            BUCKET, exist_ok=True)
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def _store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[ObjectStore, str]:
    if kind == "file":
        return ObjectStore((tmp_path / "store").as_uri()), ""
    endpoint = request.getfixturevalue("s3_endpoint")
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    return ObjectStore(root, storage_options_for(root, endpoint)), endpoint


def _check_committed(store: ObjectStore) -> None:
    """The committed manifest is one writer's whole step, every shard it names is there and reads back
    verified, and nothing else is left under the step."""
    manifest = shards.read_manifest(store, RUN, STEP)
    read = list(shards.iter_samples(store, RUN, manifest))
    writers = {s.sample_id.split("-")[0] for s in read}
    assert len(read) == manifest.num_samples == 6
    assert len(writers) == 1
    prefix = hidden_states_prefix(RUN, STEP)
    left = sorted(k.rsplit("/", 1)[-1] for k, _, _ in store.list_files(prefix))
    assert left == sorted([shard_format.MANIFEST, *(s.name for s in manifest.shards)])


@pytest.mark.slow
@pytest.mark.parametrize("kind", [
    pytest.param("file", marks=pytest.mark.reliability("fault", "two processes write one step at once, 12 times "
                                                                "(file://): no committed shard lost")),
    pytest.param("s3", marks=pytest.mark.reliability("fault", "two processes write one step at once, 6 times "
                                                              "(S3): no committed shard lost")),
])
def test_two_writers_racing_on_one_step_never_lose_committed_data(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store, endpoint = _store(kind, tmp_path, request)
    ctx = mp.get_context("fork")  # the writers need what this process imported: no second import of torch
    start, done, errors = ctx.Barrier(3), ctx.Barrier(3), ctx.Queue()
    writers = [ctx.Process(target=_writer, args=(store.root, endpoint, w, ROUNDS[kind], start, done, errors))
               for w in (1, 2)]
    for p in writers:
        p.start()
    try:
        for _ in range(ROUNDS[kind]):
            start.wait(timeout=30)
            done.wait(timeout=60)
            _check_committed(store)
    finally:
        for p in writers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    reported = []
    while not errors.empty():
        reported.append(errors.get())
    assert reported == []  # the second writer waited for the first, then rewrote the step: both succeeded
    assert [p.exitcode for p in writers] == [0, 0]


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_second_writer_waits_then_fails_naming_the_holder(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, reliability
) -> None:
    reliability.fault(f"a second writer of a step while the first holds it ({kind}): waits, then refused")
    store, _ = _store(kind, tmp_path, request)
    prefix = hidden_states_prefix(RUN, STEP)
    with lease.hold(store, prefix, "first", wait_s=0):
        began = time.monotonic()
        with pytest.raises(lease.StepBusyError, match="first"):
            shards.write_hidden_states(store, RUN, STEP, _samples(2), hidden_size=HIDDEN, layer_ids=[1],
                                       target=TARGET, lease_wait_s=0.3)
        assert time.monotonic() - began < 5
        assert not shards.has_manifest(store, RUN, STEP)
    shards.write_hidden_states(store, RUN, STEP, _samples(2), hidden_size=HIDDEN, layer_ids=[1], target=TARGET)
    _check_committed(store)


@pytest.mark.reliability("fault", "a writer that outlives its S3 lease (paused pod) tries to commit after "
                                  "another took the step over: fenced, the other's commit intact")
def test_a_writer_that_lost_its_lease_never_commits(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store, _ = _store("s3", tmp_path, request)
    prefix = hidden_states_prefix(RUN, STEP)
    now = [1000.0]
    with lease.hold(store, prefix, "zombie", ttl_s=10, clock=lambda: now[0]) as zombie:
        now[0] += 11  # the zombie's lease has expired: the next writer takes the step over
        with lease.hold(store, prefix, "next", ttl_s=10, wait_s=0, clock=lambda: now[0]) as taker:
            with pytest.raises(lease.WriterFencedError, match="zombie"):
                zombie.confirm()
            taker.confirm()
        assert store.exists(f"{prefix}/{lease.LEASE_FILE}") is False
    shards.write_hidden_states(store, RUN, STEP, _samples(1), hidden_size=HIDDEN, layer_ids=[1], target=TARGET)
    _check_committed(store)


def test_a_killed_writer_never_blocks_the_next_on_file(store: ObjectStore, reliability) -> None:
    reliability.fault("a writer killed while holding a step's lease (file://): the next writer goes ahead")
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_hold_and_die, args=(store.root,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == -9
    assert store.exists(f"{hidden_states_prefix(RUN, STEP)}/{lease.LEASE_FILE}")  # left behind, but unlocked
    shards.write_hidden_states(store, RUN, STEP, _samples(1), hidden_size=HIDDEN, layer_ids=[1], target=TARGET,
                               lease_wait_s=0)
    _check_committed(store)


def _hold_and_die(root: str) -> None:
    store = ObjectStore(root)
    with lease.hold(store, hidden_states_prefix(RUN, STEP), "doomed"):
        os.kill(os.getpid(), 9)
