"""Local copies of policy checkpoints that live on object storage, bounded in bytes.

Weights are memory-mapped from local files; a checkpoint on S3 is copied once into a cache
directory and read there. An entry is keyed by the checkpoint's identity (its URI and each
file's size and ETag or mtime), so a trainer that rewrites a checkpoint in place gets a new
entry rather than a stale one. Entries are evicted least recently used first when a new one
would exceed the limit; processes sharing the directory take turns under a file lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import fsspec

COMPLETE = ".complete.json"  # written last: an entry without it is a copy that did not finish
CHUNK = 16 * 2**20


class CacheLimitError(OSError):
    """A checkpoint larger than the whole cache."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int


@dataclass(frozen=True)
class CheckpointCache:
    root: Path
    max_bytes: int

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def entries(self) -> list[Path]:
        """Complete entries, least recently used first."""
        if not self.root.exists():
            return []
        found = [p for p in self.root.iterdir() if _own_entry(p)]
        return sorted(found, key=lambda p: (p / COMPLETE).stat().st_mtime_ns)

    def used_bytes(self) -> int:
        return sum(_entry_bytes(p) for p in self.entries())

    def fetch(self, fs: fsspec.AbstractFileSystem, path: str, files: list[RemoteFile], key: str, where: str) -> Path:
        """The local directory holding `files` of `path`, copied on a miss; `where` names it in errors."""
        entry = self.root / key
        need = sum(f.size for f in files)
        if need > self.max_bytes:
            raise CacheLimitError(f"{where}: checkpoint of {need} bytes exceeds target.cache_max_gb "
                                  f"({self.max_bytes} bytes)")
        with self._locked():
            if _own_entry(entry):
                os.utime(entry / COMPLETE)  # most recently used
                return entry
            if entry.is_symlink():  # not a copy this cache made: never followed, replaced by one
                entry.unlink()
            self._evict(need)
            tmp = self.root / f".tmp-{uuid.uuid4().hex}"
            tmp.mkdir()
            try:
                for f in files:
                    _copy(fs, f"{path}/{f.name}", tmp / f.name, f.size, where)
                (tmp / COMPLETE).write_text(json.dumps({"files": [f.name for f in files], "at": time.time()}))
                shutil.rmtree(entry, ignore_errors=True)  # an unfinished copy of a crashed process
                tmp.rename(entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return entry

    def _evict(self, need: int) -> None:
        # Copies run under the lock, so a partial copy seen here is one whose process died.
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        entries = self.entries()
        used = sum(_entry_bytes(p) for p in entries)
        for old in entries:
            if used + need <= self.max_bytes:
                break
            used -= _entry_bytes(old)
            # Readers that mapped its files keep them until they unmap: unlinking does not pull pages away.
            shutil.rmtree(old, ignore_errors=True)


def _own_entry(entry: Path) -> bool:
    """A complete copy made by this cache: a directory of regular files, no symlink at any level (the
    directory may be shared, and a link could make any directory of the machine pass for a policy)."""
    if entry.is_symlink() or not entry.is_dir() or not (entry / COMPLETE).is_file():
        return False
    return not any(p.is_symlink() or not p.is_file() for p in entry.iterdir())


def _entry_bytes(entry: Path) -> int:
    return sum(p.lstat().st_size for p in entry.iterdir() if p.is_file() and not p.is_symlink())


def _copy(fs: fsspec.AbstractFileSystem, src: str, dst: Path, size: int, where: str) -> None:
    """Stream one object to disk, a chunk at a time; its size must be what the listing said."""
    copied = 0
    with fs.open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK):
            copied += len(chunk)
            if copied > size:
                break
            fout.write(chunk)
    if copied != size:
        raise OSError(f"{where}: {dst.name} changed while being copied ({copied} bytes read, listed {size})")
