"""Local files another party writes (the RL trainer, on a `file://` store): what a path names is
checked where it lies, not as it reads.

A URI or key is checked lexically (uris.py, the store's keys), but a symlink inside the store can
lead anywhere on the machine. So a local path the pipeline reads or writes for a store must
resolve inside the store root (or an allowed checkpoint prefix), and the files of a checkpoint
are opened without following a symlink (O_NOFOLLOW), as regular files only. Messages name the
path as the pipeline was given it, never where a symlink points.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class LocalPathError(ValueError):
    """A local path that leads out of where it must stay, or a file that is not a regular file."""


def resolves_inside(path: str | Path, roots: list[str | Path]) -> bool:
    """Whether `path`, every symlink on the way followed, lies under one of `roots` (each resolved too)."""
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(os.path.realpath(root)) for root in roots)


def check_inside(path: str | Path, roots: list[str | Path], where: str) -> None:
    """LocalPathError naming `where` when `path` resolves outside every one of `roots`."""
    if not resolves_inside(path, roots):
        raise LocalPathError(f"{where}: {path} leads out of {roots[0]} through a symlink; not followed")


def open_regular(path: str | Path, where: str) -> BinaryIO:
    """`path` opened for reading if it is a regular file: never through a symlink as its last component,
    never blocking on a FIFO. LocalPathError naming `where` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        why = "a symlink (not followed)" if Path(path).is_symlink() else exc.strerror
        raise LocalPathError(f"{where}: cannot be opened as a regular file: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LocalPathError(f"{where}: not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)
