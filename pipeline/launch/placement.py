"""Where a launched stage ran (process or pod, ranks, device) and what it held, as its StagePlacement record."""

from __future__ import annotations

import resource
import time

import torch

from pipeline.data.records import StagePlacement
from pipeline.ranks import Ranks
from pipeline.stages import Stage


def peak_memory_bytes(device: str) -> int:
    """This process's peak: allocated GPU memory on CUDA, else its peak resident set (Linux: KiB)."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def measure_placement(stage: Stage, where: str, ranks: Ranks, device: str, started: float) -> StagePlacement:
    """Where the stage ran and what it held, the largest rank's peak memory; every rank calls it (the
    peak is reduced over them), rank 0's record counts."""
    peak = int(ranks.max_value(float(peak_memory_bytes(device))))
    return StagePlacement(stage, where, ranks.world_size, device_name(device), peak,
                          round(time.perf_counter() - started, 3))
