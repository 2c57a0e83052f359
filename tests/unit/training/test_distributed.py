"""Data-parallel training with torch.distributed (gloo on CPU): two ranks equal one process on the global batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.config import OptimConfig, TrainConfig
from pipeline.models import target_forward
from pipeline.training.dataset import InMemoryDataset, Sample
from pipeline.training.distributed import (
    DistContext,
    destroy_process_group,
    init_process_group,
    rank_device,
    rank_share,
)
from pipeline.training.loop import train_drafter
from tests.support.targets import tiny_target
from tests.unit.training.test_loop import drafter_for as _drafter

V, H, HEADS = 32, 32, 2


def _samples(target, n: int = 11) -> list[Sample]:
    """Odd count and mixed lengths: shares differ in size and the last global batch has one sample."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 20, (1,), generator=g))
        ids = (int(torch.randint(0, V, (1,), generator=g)) + 5 * torch.arange(length)) % V
        mask = torch.ones(length, dtype=torch.int64)
        mask[: int(torch.randint(1, 5, (1,), generator=g))] = 0
        out.append((ids, target_forward.forward(target, ids[None]).features[0].float(), mask))
    return out



def _cfg(batch_size_per_gpu: int) -> TrainConfig:
    # fp32 on a GPU too: the GPU runs are compared with the CPU's fp32 losses.
    return TrainConfig(epochs=2, batch_size_per_gpu=batch_size_per_gpu, max_seq_len=256, window_tokens=64, seed=4,
                       optim=OptimConfig(lr=3e-3, lr_warmup_steps=2), dtype="fp32")


def _rank_main(rank: int, world: int, port: int, out_dir: str, device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ctx = DistContext(rank, world, rank)
    init_process_group(ctx, rank_device(ctx, device))
    try:
        target = tiny_target(V, H, 1, HEADS)
        model = _drafter(target)
        result = train_drafter(model, InMemoryDataset(_samples(target)), _cfg(3), device=rank_device(ctx, device),
                               ctx=ctx)
        weights = {k: v.cpu().tolist() for k, v in model.trainable_state_dict().items()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
            "loss_history": result.loss_history, "tokens": result.tokens, "iterations": result.iterations,
            "fc": weights["fc.weight"]}))
    finally:
        destroy_process_group()


def test_rank_share_interleaves_the_global_batch() -> None:
    batch = [7, 3, 9, 1, 4]
    assert rank_share(batch, DistContext(0, 2)) == [7, 9, 4]
    assert rank_share(batch, DistContext(1, 2)) == [3, 1]
    assert rank_share([5], DistContext(1, 2)) == []  # the last batch of an epoch may leave a rank idle
    assert sorted(i for r in range(3) for i in rank_share(batch, DistContext(r, 3))) == sorted(batch)


def test_two_ranks_equal_one_process_on_the_global_batch(tmp_path: Path) -> None:
    """gloo, 2 ranks x 3 samples per rank vs 1 process x 6 samples: the same steps, the same losses."""
    from tests.support.config import free_port

    mp.start_processes(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    target = tiny_target(V, H, 1, HEADS)
    single_model = _drafter(target)
    single = train_drafter(single_model, InMemoryDataset(_samples(target)), _cfg(6))

    assert ranks[0]["iterations"] == ranks[1]["iterations"] == single.iterations == 2 * 2  # ceil(11/6) per epoch
    assert ranks[0]["tokens"] == single.tokens  # every sample trained once per epoch, across the ranks
    torch.testing.assert_close(torch.tensor(ranks[0]["loss_history"]), torch.tensor(single.loss_history),
                               rtol=1e-5, atol=1e-6)
    # the ranks hold one model, and it is the single process's
    assert ranks[0]["fc"] == ranks[1]["fc"]
    torch.testing.assert_close(torch.tensor(ranks[0]["fc"]), single_model.fc.weight.detach(), rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_step_on_cuda_matches_cpu() -> None:
    """The same training on the GPU (float32 features, TF32 off) follows the CPU's losses."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target = tiny_target(V, H, 1, HEADS)
    cfg = _cfg(4)
    cpu = train_drafter(_drafter(target), InMemoryDataset(_samples(target)), cfg)
    model = _drafter(target)
    gpu = train_drafter(model, InMemoryDataset(_samples(target)), cfg, device="cuda")
    assert next(model.parameters()).device.type == "cuda"
    torch.testing.assert_close(torch.tensor(gpu.loss_history), torch.tensor(cpu.loss_history), rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_nccl_ranks_equal_one_gpu_process(tmp_path: Path) -> None:
    from tests.support.config import free_port

    torch.backends.cuda.matmul.allow_tf32 = False
    mp.start_processes(_rank_main, args=(2, free_port(), str(tmp_path), "cuda"), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    target = tiny_target(V, H, 1, HEADS)
    single = train_drafter(_drafter(target), InMemoryDataset(_samples(target)), _cfg(6), device="cuda")
    torch.testing.assert_close(torch.tensor(ranks[0]["loss_history"]), torch.tensor(single.loss_history),
                               rtol=1e-3, atol=1e-4)
