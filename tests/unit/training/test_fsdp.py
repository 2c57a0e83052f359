"""FSDP2 (`train.parallelism: fsdp`) on two gloo ranks: the same training as data parallel and as one
process on the same global batch, an exact resume from its checkpoint, and `auto`'s decision."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.config import DrafterConfig, OptimConfig, TrainConfig
from pipeline.data.store import ObjectStore
from pipeline.models import drafter as drafters
from pipeline.models import target_forward
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter
from pipeline.training.dataset import InMemoryDataset, Sample
from pipeline.training.distributed import (
    DistContext,
    choose_parallelism,
    destroy_process_group,
    init_process_group,
    training_state_bytes,
)
from pipeline.training.loop import train_drafter
from pipeline.training.state import TrainingCheckpoints
from tests.support.config import free_port
from tests.support.targets import tiny_target

V, H, HEADS, LAYERS = 32, 32, 2, 3
KINDS = ("eagle", "eagle3")
# Sharded and replicated ranks sum the same gradients in another order (a reduce-scatter of each
# rank's loss-weighted gradient, against an all-reduce of token-weighted ones): float rounding, which
# Adam's first steps (an update of about lr x sign(gradient)) magnify in the smallest gradients: on some
# CPUs one element of EAGLE-3's fc.weight ends 1.4e-5 apart. A wrong loss weighting or a missed reduction
# moves the weights by about lr (3e-3) a step, 60 times ATOL.
RTOL, ATOL = 1e-4, 5e-5


def _drafter(kind: str, target):
    cfg = DrafterConfig(kind=kind, aux_layer_ids=[0, 1, 2] if kind == "eagle3" else None)
    drafter = drafters.fresh_drafter(cfg, target, torch.arange(V), seed=0)
    drafter.attach(target)
    return drafter


def _samples(kind: str, target, n: int = 11) -> list[Sample]:
    """Odd count and mixed lengths: shares differ in size and the last global batch leaves a rank idle."""
    g = torch.Generator().manual_seed(3)
    drafter = _drafter(kind, target)
    layer_ids = drafter.stored_layer_ids(LAYERS)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 20, (1,), generator=g))
        ids = (int(torch.randint(0, V, (1,), generator=g)) + 5 * torch.arange(length)) % V
        mask = torch.ones(length, dtype=torch.int64)
        mask[: int(torch.randint(1, 5, (1,), generator=g))] = 0
        with torch.no_grad():
            layers = target_forward.forward(target, ids[None], layer_ids).layers[0].float()  # (T, layers, H)
        hidden = layers.flatten(1) if kind == "eagle3" else layers[:, -1]
        out.append((ids, hidden, mask))
    return out


def _cfg(batch_size_per_gpu: int, parallelism: str = "auto", checkpoint_every: int = 0,
         units: str = "auto") -> TrainConfig:
    return TrainConfig(epochs=2, batch_size_per_gpu=batch_size_per_gpu, max_seq_len=256, window_tokens=64, seed=4,
                       optim=OptimConfig(lr=3e-3, lr_warmup_steps=2, weight_decay=0.01), dtype="fp32",
                       parallelism=parallelism, checkpoint_every=checkpoint_every, fsdp_units=units)


def _train(kind: str, cfg: TrainConfig, ctx: DistContext | None = None,
           checkpoints: TrainingCheckpoints | None = None) -> dict:
    target = tiny_target(V, H, LAYERS, HEADS)
    model = _drafter(kind, target)
    result = train_drafter(model, InMemoryDataset(_samples(kind, target)), cfg, teacher=model.teacher(target),
                           ctx=ctx, checkpoints=checkpoints)
    return {"loss_history": result.loss_history, "iterations": result.iterations, "tokens": result.tokens,
            "resumed_from": result.resumed_from_iteration, "mode": result.parallelism.mode,
            "units": result.parallelism.units,
            "rank_state_bytes": result.rank_state_bytes,
            "weights": {k: v.tolist() for k, v in model.trainable_state_dict().items() if v.is_floating_point()},
            "plain": all(type(p) is torch.nn.Parameter for p in model.parameters())}


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ctx = DistContext(rank, world, rank)
    init_process_group(ctx, "cpu")
    try:
        out = {}
        for kind in KINDS:
            out[f"{kind}-ddp"] = _train(kind, _cfg(3, "ddp"), ctx)
            out[f"{kind}-fsdp"] = _train(kind, _cfg(3, "fsdp"), ctx)  # auto: the whole drafter one unit
            out[f"{kind}-fsdp-layer"] = _train(kind, _cfg(3, "fsdp", units="layer"), ctx)
        # A sharded training that saves every 2 iterations; the same training again finds its last
        # checkpoint (as a retry after a kill does) and must end exactly where the first ended.
        checkpoints = TrainingCheckpoints(ObjectStore(Path(out_dir, "store").as_uri()), "training/run/fsdp")
        out["eagle3-fsdp-checkpointed"] = _train("eagle3", _cfg(3, "fsdp", 2), ctx, checkpoints)
        torch.distributed.barrier()  # rank 0 has committed its last write: the retry reads it on every rank
        out["eagle3-fsdp-resumed"] = _train("eagle3", _cfg(3, "fsdp", 2), ctx, checkpoints)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(_rank_main, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _close(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["loss_history"]), torch.tensor(b["loss_history"]), rtol=RTOL, atol=ATOL)
    assert a["weights"].keys() == b["weights"].keys()
    for key in a["weights"]:
        torch.testing.assert_close(torch.tensor(a["weights"][key]), torch.tensor(b["weights"][key]), rtol=RTOL,
                                   atol=ATOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_on_two_ranks_equals_ddp_and_one_process_on_the_global_batch(two_ranks: list[dict], kind: str) -> None:
    """2 gloo ranks x 3 samples, sharded and replicated, vs 1 process x 6 samples.

    EAGLE-3's ranks equal one process only in the loss: the ranks weigh their losses by step 0's
    tokens, while each later training-time-test step averages over its own rows (fewer, near the
    documents' ends), so the weights drift apart within Adam's first steps. Sharded and replicated
    ranks weigh alike and must agree closely."""
    single = _train(kind, _cfg(6))
    fsdp, ddp = two_ranks[0][f"{kind}-fsdp"], two_ranks[0][f"{kind}-ddp"]
    layered = two_ranks[0][f"{kind}-fsdp-layer"]
    assert (fsdp["mode"], ddp["mode"], single["mode"]) == ("fsdp", "ddp", "single")
    assert (fsdp["units"], layered["units"], ddp["units"]) == ("drafter", "layer", None)
    assert fsdp["iterations"] == ddp["iterations"] == single["iterations"] == 2 * 2  # ceil(11/6) per epoch
    assert fsdp["tokens"] == ddp["tokens"] == single["tokens"] == layered["tokens"]
    _close(fsdp, ddp)
    _close(layered, ddp)
    if kind == "eagle":
        _close(fsdp, single)
    else:
        torch.testing.assert_close(torch.tensor(fsdp["loss_history"]), torch.tensor(single["loss_history"]),
                                   rtol=RTOL, atol=ATOL)
    # Both ranks end with the whole trained drafter, in plain tensors (the export reads them).
    assert two_ranks[0][f"{kind}-fsdp"]["weights"] == two_ranks[1][f"{kind}-fsdp"]["weights"]
    assert fsdp["plain"]
    # Each rank held about half the training state, however the units gather it.
    assert fsdp["rank_state_bytes"] == layered["rank_state_bytes"] < 0.6 * ddp["rank_state_bytes"]


@pytest.mark.slow
def test_a_sharded_training_resumes_exactly_from_its_checkpoint(two_ranks: list[dict]) -> None:
    full, resumed = two_ranks[0]["eagle3-fsdp-checkpointed"], two_ranks[0]["eagle3-fsdp-resumed"]
    assert (full["resumed_from"], resumed["resumed_from"]) == (0, 2)
    assert resumed["iterations"] == full["iterations"] == 4
    assert resumed["loss_history"] == full["loss_history"]
    assert resumed["weights"] == full["weights"]  # bit for bit


def _reference_drafter(hidden: int, mlp: int, heads: int, vocab: int = 128256) -> Eagle3Drafter:
    """An EAGLE-3 drafter of a Llama-3.1 target's shapes, on the meta device (no memory)."""
    with torch.device("meta"):
        drafter = Eagle3Drafter(Eagle3Config(
            vocab_size=vocab, draft_vocab_size=32000, hidden_size=hidden, target_hidden_size=hidden,
            intermediate_size=mlp, num_attention_heads=heads, num_key_value_heads=8, aux_layer_ids=(2, 16, 29)))
    return drafter


def test_auto_shards_only_a_drafter_whose_training_state_crowds_the_gpu() -> None:
    gpu = 80 * 10**9
    decisions = {}
    for name, (hidden, mlp, heads) in {"8B": (4096, 14336, 32), "70B": (8192, 28672, 64),
                                       "405B": (16384, 53248, 128)}.items():
        plan = choose_parallelism(_reference_drafter(hidden, mlp, heads), "auto", 0.5, gpu, world_size=8)
        decisions[name] = plan
    assert {k: p.mode for k, p in decisions.items()} == {"8B": "ddp", "70B": "ddp", "405B": "fsdp"}
    big = decisions["405B"]
    assert big.trainable_params == pytest.approx(4.82e9, rel=0.01)  # docs/production.md's arithmetic
    assert big.frozen_params == 128256 * 16384  # the target's embeddings: no gradient, no AdamW state
    assert big.state_bytes == 16 * big.trainable_params + 4 * big.frozen_params
    assert "exceeds train.fsdp_memory_share=0.5" in big.reason
    assert big.metadata()["parallelism"] == "fsdp"
    # Sharded, a step with the whole drafter one unit holds its weights and gradient whole, plus the
    # rank's shards: 57.7 GB on each of 8 ranks, over half the GPU, so the 405B drafter's layers are
    # units of their own, freed after their forward.
    assert big.step_peak_bytes == 4 * (2 * big.trainable_params + big.frozen_params) + big.state_bytes // 8
    assert big.step_peak_bytes == pytest.approx(57.7e9, rel=0.01)
    assert (big.units, big.metadata()["fsdp_units"]) == ("layer", "layer")
    assert "exceeds train.fsdp_memory_share=0.5" in big.units_reason
    assert "fsdp_units" not in decisions["8B"].metadata()  # replicated: no units
    # the setting wins over the figures; one process has nothing to shard
    small = _reference_drafter(4096, 14336, 32)
    assert choose_parallelism(small, "fsdp", 0.5, gpu, 2).mode == "fsdp"
    assert choose_parallelism(_reference_drafter(16384, 53248, 128), "ddp", 0.5, gpu, 2).mode == "ddp"
    assert choose_parallelism(small, "fsdp", 0.5, gpu, 1).mode == "single"
    # The 8B drafter, sharded on 2 ranks: weights and gradient whole for a step, plus half the state: 9.9 GB.
    eight = choose_parallelism(small, "fsdp", 0.5, gpu, 2)
    assert (eight.units, eight.step_peak_bytes) == ("drafter", 4 * (2 * eight.trainable_params + eight.frozen_params)
                                                    + eight.state_bytes // 2)
    assert "within train.fsdp_memory_share=0.5" in eight.units_reason
    assert choose_parallelism(small, "fsdp", 0.5, gpu, 2, units="layer").units == "layer"  # the setting wins
    assert choose_parallelism(small, "fsdp", 0.05, gpu, 2).units == "layer"  # 4 GB: a step's peak exceeds it
    trainable, frozen, _ = training_state_bytes(small)
    assert trainable == sum(p.numel() for p in small.parameters() if p.requires_grad)
    assert frozen == 128256 * 4096
