"""Where a launched stage ran (process, pod or Ray job, ranks, device), what it held and how long it waited to
start, as its StagePlacement record."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from pipeline.data.stage_placement import StagePlacement
from pipeline.ranks import Ranks
from pipeline.stages import Stage

# The launcher's wall clock (epoch seconds) when it submitted the stage to a cluster that queues it (a Ray job);
# set in the job's environment, so every rank and its torchrun agent see it.
SUBMITTED_AT_ENV = "DRAFTER_STAGE_SUBMITTED_AT"


def peak_memory_bytes(device: str) -> int:
    """This process's peak: allocated GPU memory on CUDA, else its own peak resident set (Linux: VmHWM, in KiB;
    not getrusage's ru_maxrss, which keeps the peak of the process that launched it across fork and exec)."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def process_started_at() -> float:
    """This process's start, epoch seconds (Linux: its start time in clock ticks since boot, from /proc)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def waited_s() -> float:
    """Seconds from the stage's submission (`SUBMITTED_AT_ENV`) to this process's start: a Ray job waiting for
    its resources, then the cluster starting it; 0 where the launcher starts the process itself."""
    submitted = os.environ.get(SUBMITTED_AT_ENV)
    if submitted is None:
        return 0.0
    try:
        return max(0.0, process_started_at() - float(submitted))
    except ValueError:
        raise ValueError(f"{SUBMITTED_AT_ENV} is {submitted!r}, not epoch seconds: the launcher sets it") from None


def measure_placement(stage: Stage, where: str, ranks: Ranks, device: str, started: float) -> StagePlacement:
    """Where the stage ran, what it held (the largest rank's peak memory) and how long it waited to start; every
    rank calls it (the peak is reduced over them), rank 0's record counts."""
    peak = int(ranks.max_value(float(peak_memory_bytes(device))))
    return StagePlacement(stage, where, ranks.world_size, device_name(device), peak,
                          round(time.perf_counter() - started, 3), round(waited_s(), 3))
