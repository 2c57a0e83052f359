"""One writer at a time per step: the lease that fences writers of a step's hidden states.

Two materializations of one step can run at once (a manual run beside the sensor's, a second
Dagster instance, a retried run whose old pod still lives). Each writes shards under its own
write id and then commits a manifest; the lease makes the commit and the sweep that follows it
safe: while a writer holds the step's lease, no other writer can commit, so the files of other
write ids under the step belong to writers that died or lost their lease and will never commit.

* file://   an exclusive `flock` on `<step>/_writer.lease`: the kernel releases it when its holder
            exits, however it exits, so a crashed writer never blocks the next one.
* s3://     an object `<step>/_writer.lease` created with `If-None-Match: *`, holding the writer's id
            and an expiry. An expired lease is taken over with `If-Match` on its ETag (only one of
            several takers wins), and the holder renews it with `If-Match` right before it commits:
            a writer whose lease was taken over fails that renewal and never commits.

A second writer waits up to `wait_s` for the lease, then fails with StepBusyError naming the holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.rollouts import finite_number
from pipeline.data.store import ObjectStore

LEASE_FILE = "_writer.lease"
_POLL_S = 0.05


class StepBusyError(RuntimeError):
    """Another writer holds the step's lease; nothing was written."""


class WriterFencedError(RuntimeError):
    """This writer's lease was taken over (it outlived it): it must not commit."""


@dataclass
class Lease:
    """A held lease. `confirm()` right before the commit: it raises WriterFencedError when the lease is
    no longer this writer's, and on object storage renews it for `ttl_s`."""

    store: ObjectStore
    key: str
    write_id: str
    ttl_s: float
    etag: str | None = None  # object storage: the version of the lease object this writer wrote last
    clock: Callable[[], float] = time.time

    def confirm(self) -> None:
        if self.etag is None:
            return  # an flock held by this process cannot be taken away
        body = _body(self.write_id, self.clock() + self.ttl_s)
        renewed = self.store.put_if(self.key, body, etag=self.etag)
        if renewed is None:
            raise WriterFencedError(
                f"{self.store.uri(self.key)}: the lease of write {self.write_id} was taken over by another writer "
                "(this one outlived it); its shards are not committed"
            )
        self.etag = renewed


def _body(write_id: str, expires: float) -> bytes:
    return json.dumps({"write_id": write_id, "holder": f"{socket.gethostname()}:{os.getpid()}",
                       "expires": expires}).encode()


@contextmanager
def hold(store: ObjectStore, prefix: str, write_id: str, ttl_s: float = 1800.0, wait_s: float = 120.0,
         clock: Callable[[], float] = time.time) -> Iterator[Lease]:
    """Hold the lease of the step under `prefix` for the block; StepBusyError after `wait_s`."""
    key = f"{prefix}/{LEASE_FILE}"
    if store.is_local:
        with _flock(store, key, write_id, wait_s):
            yield Lease(store, key, write_id, ttl_s)
        return
    lease = _acquire_object(store, key, write_id, ttl_s, wait_s, clock)
    try:
        yield lease
    finally:
        with suppress(OSError):
            store.delete_if(key, lease.etag)  # not ours any more (taken over): leave it to its holder


@contextmanager
def _flock(store: ObjectStore, key: str, write_id: str, wait_s: float) -> Iterator[None]:
    path = Path(store.local_path(key))
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            if time.monotonic() >= deadline:
                raise StepBusyError(f"{store.uri(key)}: another writer holds this step ({holder or 'unknown'}); "
                                    f"waited {wait_s:g} s") from None
            time.sleep(_POLL_S)
            continue
        # The previous holder unlinks the file on release: a lock on a file no longer at `path` fences nothing.
        try:
            same = path.stat().st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, _body(write_id, float("inf")), 0)
        yield
    finally:
        path.unlink()  # while still locked: a waiter that opened it sees it gone and opens afresh
        os.close(fd)


def _acquire_object(store: ObjectStore, key: str, write_id: str, ttl_s: float, wait_s: float,
                    clock: Callable[[], float]) -> Lease:
    deadline = time.monotonic() + wait_s
    while True:
        etag = store.put_if(key, _body(write_id, clock() + ttl_s), etag=None)
        if etag is not None:
            return Lease(store, key, write_id, ttl_s, etag, clock)
        found = store.read_tagged(key)
        if found is None:
            continue  # released between the two requests
        data, current = found
        try:
            held = json.loads(data)
            expires = finite_number(held["expires"])
        except (ValueError, KeyError, TypeError):
            held, expires = {}, None
        if expires is None:  # unreadable, or no finite time (NaN, a number of hundreds of digits): expired
            held, expires = {}, 0.0
        if expires <= clock():
            etag = store.put_if(key, _body(write_id, clock() + ttl_s), etag=current)
            if etag is not None:
                return Lease(store, key, write_id, ttl_s, etag, clock)
            continue
        if time.monotonic() >= deadline:
            raise StepBusyError(
                f"{store.uri(key)}: write {held.get('write_id')!r} ({held.get('holder')}) holds this step for "
                f"{expires - clock():.0f} s more; waited {wait_s:g} s. If that writer is gone, delete the lease "
                "object or wait for it to expire"
            )
        time.sleep(_POLL_S * 2)
