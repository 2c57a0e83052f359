"""Object storage behind one small interface: `file://` by default, `s3://` in production.

Every path the pipeline writes lives under one root URI:

    <root>/
    ├── rollouts/<run>/step-000123/rollouts.parquet   from the RL trainer
    │                              policy.json        pointer to the policy checkpoint (commit point)
    ├── policies/<run>/step-000123/config.json        the simulated source's policy checkpoints
    │                              model.safetensors
    ├── hidden_states/<run>/step-000123/part-00000-<id>.arrow
    │                                   _manifest.json (commit point)
    ├── buffer/<run>/step-000123/_manifest.json
    └── acceptance/<run>/step-000123.json

Writes are atomic per object: on a local filesystem through a temporary file and a
rename; on S3 a PUT is atomic by itself. Multi-object writes commit with a manifest
written last.
"""

from __future__ import annotations

import errno
import io
import json
import mmap
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import fsspec
import fsspec.asyn
import numpy as np

from pipeline.data.local_files import check_inside
from pipeline.data.uris import UriPolicy, check_uri, redact

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

S3_MAX_ATTEMPTS = 8  # botocore's standard mode: up to about a minute of backoff before a request fails
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class StorageFullError(OSError):
    """The storage device (or a quota or file size limit) refused a write; nothing was committed."""


def storage_options_for(root: str, endpoint_url: str = "", region: str = "") -> dict[str, Any]:
    """fsspec options of a root URI. S3 credentials are not options: s3fs reads them from the
    standard AWS environment variables, so they never sit in config, logs or metadata."""
    if not root.startswith("s3://"):
        return {}
    client_kwargs = {k: v for k, v in (("endpoint_url", endpoint_url), ("region_name", region)) if v}
    # No listing cache: the RL trainer writes new steps from another process. botocore's standard
    # retry mode retries 500/502/503/504, throttling and dropped connections with jittered
    # exponential backoff, so a server that is briefly unwell costs time, not the step.
    return {"client_kwargs": client_kwargs, "use_listings_cache": False,
            "config_kwargs": {"retries": {"mode": "standard", "max_attempts": S3_MAX_ATTEMPTS}}}


class ObjectStore:
    """Keys are '/'-separated paths relative to the root URI."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None,
                 uri_policy: UriPolicy | None = None) -> None:
        self.root = root.rstrip("/")
        # Which URIs outside its keys (a trainer's checkpoint_uri) this store opens: see uris.py.
        self.uri_policy = uri_policy or UriPolicy()
        self.options = dict(storage_options or {})
        self.fs, self._root_path = fsspec.core.url_to_fs(self.root, **self.options)
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        self._protocols = protocols
        self._local = "file" in protocols

    def resolve(self, uri_or_key: str, where: str = "checkpoint_uri") -> str:
        """The full URI of a key under the root or of a URI the store's policy allows; UriPolicyError
        (naming `where`, showing the URI redacted) for anything else."""
        return check_uri(uri_or_key, self.root, self.uri_policy, where)

    def filesystem(self, uri: str, where: str = "checkpoint_uri") -> tuple[fsspec.AbstractFileSystem, str]:
        """Filesystem and path of a URI the store's policy allows; URIs of this store's protocol get its
        options (endpoint...). A local path must also resolve, symlinks followed, under the store root or
        a local allowed prefix: the policy's check is lexical."""
        uri = self.resolve(uri, where)
        protocol = uri.split("://", 1)[0]
        fs, path = fsspec.core.url_to_fs(uri, **(self.options if protocol in self._protocols else {}))
        if _is_local(fs):
            roots = [self._root_path] if self._local else []
            roots += [fsspec.core.url_to_fs(p)[1] for p in self.uri_policy.allowed_prefixes if p.startswith("file:")]
            check_inside(path, roots or [path], f"{where} {redact(uri)!r}")
        return fs, path

    def uri(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"store key {key!r} must be relative and stay under the root")
        return f"{self._root_path}/{key}"

    def _inside(self, key: str) -> str:
        """The path of `key` for a read or a write: on a local store it must resolve under the root, so a
        symlinked directory (a trainer's, say) leads no read or write out of it."""
        path = self._path(key)
        if self._local:
            check_inside(path, [self._root_path], f"store key {key}")
        return path

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def size(self, key: str) -> int:
        return int(self.fs.size(self._path(key)))

    def modified(self, key: str) -> float:
        """When the object at `key` was last written, as epoch seconds."""
        return _epoch_seconds(self.fs.info(self._path(key)))

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate sub-directories of `prefix` (empty if it does not exist)."""
        path = self._path(prefix)
        if not self.fs.exists(path):
            return []
        entries = self.fs.ls(path, detail=True)
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def list_files(self, prefix: str) -> list[tuple[str, int, float]]:
        """(key, bytes, modified as epoch seconds) of every object under `prefix`, recursively."""
        path = self._path(prefix)
        if not self.fs.exists(path):
            return []
        root = self._root_path.rstrip("/") + "/"
        files = []
        for name, info in sorted(self.fs.find(path, detail=True).items()):
            if info.get("type") == "directory":
                continue
            modified = _epoch_seconds(info)
            files.append((name[len(root):] if name.startswith(root) else name, int(info.get("size") or 0), modified))
        return files

    def read_bytes(self, key: str) -> bytes:
        with self.fs.open(self._inside(key), "rb") as f:
            return f.read()

    def read_json(self, key: str) -> Any:
        return json.loads(self.read_bytes(key))

    def read_json_object(self, key: str) -> dict:
        """A stored JSON object, read back as untrusted input: ValueError naming the object when it is not one."""
        try:
            doc = self.read_json(key)
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"{self.uri(key)}: not JSON this pipeline reads") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{self.uri(key)}: not a JSON object")
        return doc

    @contextmanager
    def open_ranges(self, key: str) -> Iterator[RangeReader]:
        """Reads of byte ranges of one object: a memory map of a local file, ranged GETs on S3."""
        path = self._inside(key)
        if not self._local:
            # Keywords: s3fs's cat_file takes version_id as its second positional argument.
            yield RangeReader(lambda offset, out: fill_range(out, self.fs.cat_file(path, start=offset,
                                                                              end=offset + len(out))))
            return
        # Mapped, not pread: raw layers are viewed where they lie (no copy into fresh memory, whose
        # page faults cost more than the read itself), compressed ones decoded and digested there.
        # Copy-on-write, so tensors over the map are writable and a caller's writes stay its own.
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        view = memoryview(mapped if mapped is not None else bytearray())
        try:
            yield RangeReader(data=view, mapped=True)
        finally:
            # Tensors viewing the map (or a slice held by a traceback) keep it open: it is unmapped
            # when the last of them goes.
            with suppress(BufferError):
                view.release()
                if mapped is not None:
                    mapped.close()

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several (offset, length) ranges of one object; concurrent requests on object storage."""
        path = self._inside(key)
        return self.fs.cat_ranges([path] * len(ranges), [o for o, _ in ranges], [o + n for o, n in ranges])

    @contextmanager
    def open_write(self, key: str) -> Iterator[IO[bytes]]:
        """A writable file that appears under `key` only if the block exits cleanly."""
        final = self._path(key)
        if not self._local:
            # Buffered and sent in one PUT on success: an object store file object would
            # upload what it has even when the block raises.
            buffer = io.BytesIO()
            yield buffer
            self.fs.pipe_file(final, buffer.getvalue())
            return
        check_inside(final.rsplit("/", 1)[0], [self._root_path], f"store key {key}")  # before makedirs follows it
        self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
        tmp = Path(f"{final}.tmp-{uuid.uuid4().hex}")
        try:
            with tmp.open("wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(final)
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                raise
            raise StorageFullError(exc.errno, f"{self.uri(key)}: not written, the storage is full or over a "
                                              f"size limit ({exc.strerror})") from exc
        finally:
            tmp.unlink(missing_ok=True)

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.open_write(key) as f:
            f.write(data)

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, json.dumps(obj, indent=2, sort_keys=True).encode())

    def delete_prefix(self, prefix: str) -> None:
        path = self._inside(prefix)  # retention never deletes through a symlink out of the root
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def read_tagged(self, key: str) -> tuple[bytes, str] | None:
        """An object on object storage and its ETag (the token of a conditional write), None if absent."""
        bucket, name, _ = self.fs.split_path(self._path(key))
        try:
            response = self.fs.call_s3("get_object", Bucket=bucket, Key=name)
        except FileNotFoundError:
            return None
        body = response["Body"]
        data = _read_body(self.fs, body)
        return data, response["ETag"]

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None:
        """Write `key` on object storage only if it is absent (`etag` None) or still the version `etag`
        (S3's If-None-Match / If-Match); its new ETag, or None when the condition did not hold."""
        bucket, name, _ = self.fs.split_path(self._path(key))
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        try:
            return self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data, **condition)["ETag"]
        except (FileExistsError, FileNotFoundError):
            return None
        except OSError as exc:
            if "PreconditionFailed" in str(exc.__cause__) or "ConditionalRequestConflict" in str(exc.__cause__):
                return None
            raise

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete `key` on object storage only if it is still the version `etag`."""
        bucket, name, _ = self.fs.split_path(self._path(key))
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=etag)
        except (OSError, FileNotFoundError):
            return False
        return True

    @property
    def is_local(self) -> bool:
        return self._local

    def local_path(self, key: str) -> str | None:
        """The filesystem path of `key` when the store is local (else None)."""
        return self._path(key) if self._local else None


class RangeReader:
    """Byte ranges of one stored object: read into the caller's memory, or, when the whole object is
    in memory or mapped (`data`), viewed where they lie."""

    def __init__(self, read_into: Callable[[int, memoryview], None] | None = None, *,
                 data: memoryview | None = None, mapped: bool = False) -> None:
        self._read_into = read_into
        self._data = data
        # `data` is a writable map of an immutable file: views of it may outlive the reader.
        self.mapped = mapped

    @property
    def in_memory(self) -> bool:
        """Reads are copies out of memory (mapped or fetched whole), not requests."""
        return self._data is not None

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill `out` (a writable byte view) with the object's bytes from `offset`."""
        out = out.cast("B")
        if self._data is None:
            self._read_into(offset, out)
            return
        np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(self.read(offset, len(out)), np.uint8))

    def read(self, offset: int, length: int) -> memoryview | bytearray:
        """The bytes of a range: a view when the object is in memory, else a fresh buffer."""
        if self._data is not None:
            if offset + length > len(self._data):
                raise EOFError(f"object ends {offset + length - len(self._data)} bytes before the end of "
                               f"the range read from offset {offset}")
            return self._data[offset : offset + length]
        data = bytearray(length)
        self._read_into(offset, memoryview(data))
        return data


def _epoch_seconds(info: dict) -> float:
    """An fsspec entry's modification time: `mtime` (local, epoch seconds) or `LastModified` (S3, a datetime)."""
    modified = info.get("mtime", info.get("LastModified"))
    return modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol))


def _read_body(fs: fsspec.AbstractFileSystem, body: Any) -> bytes:
    """The bytes of an aiobotocore streaming body, read on the filesystem's event loop."""
    async def read() -> bytes:
        async with body as stream:
            return await stream.read()
    return fsspec.asyn.sync(fs.loop, read)


def fill_range(out: memoryview, data: bytes) -> None:
    if len(data) != len(out):
        raise EOFError(f"ranged read returned {len(data)} bytes, expected {len(out)}")
    out[:] = data


def open_store(cfg: PipelineConfig) -> ObjectStore:
    """The object store a pipeline config names."""
    return ObjectStore(cfg.storage_root, storage_options_for(cfg.storage_root, cfg.storage.endpoint_url,
                                                             cfg.storage.region), uri_policy_for(cfg))


def uri_policy_for(cfg: PipelineConfig) -> UriPolicy:
    return UriPolicy(tuple(cfg.storage.checkpoint_prefixes), cfg.storage.allow_http_checkpoints)
