"""Where this user's processes meet on one machine (a warm stage worker's socket, its lock and log, a stand-in
replica's pid file): in a directory only this user can enter, answered only by this user's processes.

A name in a world-writable directory (`/tmp`) is a rendezvous anyone can take: another local user can
listen there first, or plant a file that stops every later start. So these live under the run's data
dir in a folder of mode 0700 that this user owns (refused, by name, when another user owns it), their
files of mode 0600, and each end of a Unix socket checks the other's credentials (Linux's SO_PEERCRED):
a process of another user gets no job and is sent no answer.

A Unix socket's path holds at most 108 bytes. A longer one is reached through the folder's file
descriptor (`/proc/self/fd/N/<name>`), so the socket never leaves its private folder.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes


class RendezvousError(PermissionError):
    """A meeting point this user does not hold alone: the message names the path and who holds it."""


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter: created with mode 0700 (its parents as usual), a folder
    of ours left more open is closed to others; RendezvousError when it is a symlink or another user's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    found = os.lstat(path)
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
        raise RendezvousError(f"{path} is not a directory of its own (a symlink or a file): refusing to meet there")
    if found.st_uid != os.getuid():
        raise RendezvousError(f"{path} belongs to uid {found.st_uid}, not to this user (uid {os.getuid()}): "
                              "refusing to meet there")
    if stat.S_IMODE(found.st_mode) & 0o077:
        path.chmod(0o700)
    return path


def private_file(path: Path, mode: str = "ab") -> BinaryIO:
    """`path` opened (created with mode 0600, never through a symlink), readable by this user alone;
    RendezvousError when it is a symlink, not a plain file, or another user's (root could open and chmod it)."""
    flags = os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND | os.O_WRONLY if "a" in mode else os.O_RDWR)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise RendezvousError(f"{path} is a symlink: refusing to open a file through it") from None
        raise
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
        os.close(fd)
        raise RendezvousError(f"{path} is not a plain file of this user's (uid {found.st_uid}, this user: uid "
                              f"{os.getuid()}): refusing to use it")
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode)


def owned_tree(path: Path) -> None:
    """`path`, an existing folder, and every entry in it, as this user's alone to write: RendezvousError, naming
    the entry, when one is a symlink, another user's, writable by others, or (the entries) not a plain file.
    Read, never changed: what another user could have written there is not trusted after a chmod."""
    _owned(path, stat.S_ISDIR, "directory")
    for entry in sorted(path.iterdir()):
        _owned(entry, stat.S_ISREG, "plain file")


def _owned(entry: Path, kind, what: str) -> None:  # noqa: ANN001 - stat's S_IS* predicates
    found = os.lstat(entry)
    if stat.S_ISLNK(found.st_mode) or not kind(found.st_mode):
        raise RendezvousError(f"{entry} is not a {what} of its own (a symlink or another kind of file): refusing "
                              "to trust it")
    if found.st_uid != os.getuid():
        raise RendezvousError(f"{entry} belongs to uid {found.st_uid}, not to this user (uid {os.getuid()}): "
                              "refusing to trust it")
    if stat.S_IMODE(found.st_mode) & 0o022:
        raise RendezvousError(f"{entry} is writable by other users (mode {stat.S_IMODE(found.st_mode):04o}): "
                              "refusing to trust it")


@contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """The address to bind or connect a Unix socket at `path`: the path itself when it fits, else the path
    through its folder's file descriptor (held open while the address is in use)."""
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


@dataclass(frozen=True)
class Peer:
    """The process at a Unix socket's other end, as the kernel knows it."""

    pid: int
    uid: int

    @classmethod
    def of(cls, conn: socket.socket) -> Peer:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return cls(pid, uid)

    @property
    def is_this_user(self) -> bool:
        return self.uid == os.getuid()
