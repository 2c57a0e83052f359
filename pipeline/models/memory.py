"""The memory a process may still allocate, so that a checkpoint too large for it is refused by name
before its weights are allocated, rather than failing inside the allocator.

On the CPU the bound is the smallest of: what the machine has available (MemAvailable), what the
process's cgroup still allows (memory.max less memory.current, or cgroup v1's limit less usage:
the limit a container or pod runs under), and what RLIMIT_AS still allows (less the address space
already mapped). On a CUDA device it is the device's free memory.
"""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryBound:
    bytes: int
    source: str  # where the figure comes from, for messages: "cgroup memory.max", "MemAvailable", ...


def available_memory(device: str | torch.device) -> MemoryBound | None:
    """The most this process may allocate on `device` now; None where nothing can be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return MemoryBound(int(free), f"free memory of {device}")
    if device.type != "cpu":
        return None
    bounds = [b for b in (_mem_available(), _cgroup_v2(), _cgroup_v1(), _address_space()) if b is not None]
    return min(bounds, key=lambda b: b.bytes) if bounds else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _kib_field(text: str | None, name: str) -> int | None:
    found = re.search(rf"^{name}:\s*(\d+) kB$", text or "", re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def _mem_available() -> MemoryBound | None:
    available = _kib_field(_read(Path("/proc/meminfo")), "MemAvailable")
    return MemoryBound(available, "MemAvailable in /proc/meminfo") if available is not None else None


def _cgroup_v2() -> MemoryBound | None:
    """The tightest memory.max on the way from this process's cgroup up to the root, less its usage."""
    own = next((line[3:] for line in (_read(Path("/proc/self/cgroup")) or "").splitlines()
                if line.startswith("0::")), None)
    if own is None:
        return None
    tightest = None
    directory = CGROUP_ROOT / own.strip().lstrip("/")
    while directory.is_relative_to(CGROUP_ROOT):
        limit, used = _read(directory / "memory.max"), _read(directory / "memory.current")
        if limit and used and limit.strip() != "max":
            left = int(limit) - int(used)
            if tightest is None or left < tightest.bytes:
                tightest = MemoryBound(max(left, 0), f"cgroup memory.max of {directory}")
        if directory == CGROUP_ROOT:
            break
        directory = directory.parent
    return tightest


def _cgroup_v1() -> MemoryBound | None:
    directory = CGROUP_ROOT / "memory"
    limit, used = _read(directory / "memory.limit_in_bytes"), _read(directory / "memory.usage_in_bytes")
    if not (limit and used) or int(limit) >= 2**62:  # "no limit" reads as a huge page-aligned number
        return None
    return MemoryBound(max(int(limit) - int(used), 0), f"cgroup memory.limit_in_bytes of {directory}")


def _address_space() -> MemoryBound | None:
    limit, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if limit == resource.RLIM_INFINITY:
        return None
    mapped = _kib_field(_read(Path("/proc/self/status")), "VmSize") or 0
    return MemoryBound(max(limit - mapped, 0), "RLIMIT_AS (ulimit -v) less the address space mapped")
