"""The ranks of a launched model stage (extraction, evaluation): who does which part of a step's work,
and how their results meet on rank 0, exactly.

    torchrun --nproc-per-node=N -m pipeline.sources.worker      N ranks, gloo on CPU, NCCL on GPUs
        every rank   the same deterministic plan of the step's work, cut into units (shards, prompt batches)
        rank r       units r, r + N, r + 2N, ... : a unit's content never depends on N
        rank 0       gathers the others' results (JSON, or integer counts summed), then commits

A unit is computed the same way whoever computes it, so N ranks produce what one process does,
bit for bit: shards equal byte for byte, counts sum to the same integers. Results travel as JSON
bytes in uint8 tensors or as int64 sums, never pickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among a stage's ranks (torchrun's RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def mine(self, units: Sequence[T]) -> list[T]:
        """This rank's units: every world_size-th, from its rank on (units stay whole: their content and order
        are the same for any number of ranks)."""
        return list(units[self.rank :: self.world_size])

    def owner(self, unit: int) -> int:
        return unit % self.world_size

    def device(self, device: str, gpus_per_rank: int = 1) -> str:
        """`cuda` is the first GPU of this rank's own (cuda:LOCAL_RANK x gpus_per_rank: a policy split over
        several GPUs takes a block of them per rank); anything else as given."""
        return f"cuda:{self.local_rank * gpus_per_rank}" if device == "cuda" else device

    def sum_counts(self, counts: list[int]) -> list[int]:
        """Integer counts summed over the ranks (exact: int64), on every rank."""
        if self.world_size == 1:
            return list(counts)
        carrier = torch.tensor(counts, dtype=torch.int64, device=self._comm_device())
        dist.all_reduce(carrier, op=dist.ReduceOp.SUM)
        return [int(c) for c in carrier.tolist()]

    def max_value(self, value: float) -> float:
        """The largest of the ranks' values, on every rank."""
        if self.world_size == 1:
            return value
        carrier = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(carrier, op=dist.ReduceOp.MAX)
        return float(carrier.item())

    def gather_json(self, value: object) -> list[object]:
        """Every rank's JSON-encodable `value`, in rank order, on rank 0 (other ranks get [])."""
        if self.world_size == 1:
            return [value]
        device = self._comm_device()
        data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        parts = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        if not self.is_main:
            return []
        return [json.loads(bytes(p[: int(s.item())].tolist())) for p, s in zip(parts, sizes, strict=True)]

    def broadcast_text(self, text: str, length: int) -> str:
        """Rank 0's `text` (ASCII, exactly `length` characters) on every rank."""
        if self.world_size == 1:
            return text
        carrier = torch.zeros(length, dtype=torch.uint8, device=self._comm_device())
        if self.is_main:
            carrier[:] = torch.tensor(list(text.encode("ascii")), dtype=torch.uint8)
        dist.broadcast(carrier, src=0)
        return bytes(carrier.tolist()).decode("ascii")

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _comm_device(self) -> str:
        return f"cuda:{self.local_rank}" if dist.get_backend() == "nccl" else "cpu"


SINGLE = Ranks()


def ranks_from_env() -> Ranks:
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain `python -m` run is rank 0 of 1."""
    return Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def join(ranks: Ranks, device: str) -> None:
    """Join the stage's process group: NCCL for CUDA devices, gloo otherwise (nothing for one rank)."""
    if ranks.world_size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world_size)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
