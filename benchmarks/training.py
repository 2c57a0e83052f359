"""Drafter training throughput: CPU at the demo's size (one process vs two gloo ranks), and
model FLOPs utilization of an EAGLE-3 drafter of a Llama-3-8B-sized target on a GPU.

CPU: the demo's EAGLE-3 drafter (simulated target: vocab 64, hidden 64, 2 layers), its buffer (two
steps of 84 samples of 64 tokens) and its training settings, four epochs. Two ranks (gloo) each
train `train.batch_size_per_gpu` (16) samples a step, as two GPUs of the pipeline do (a global
batch twice the one process's). Every process runs one thread, so the ratio is the data-parallel
scaling from one core to two (with more threads per process, OpenMP's barriers dominate on a busy
machine and the single process looks worse than it is). The same two ranks also shard the drafter
(FSDP2), with the units `train.fsdp_units: auto` picks and with a unit per decoder layer: DDP and
both FSDP2 trainings run in `Sizes.paired_rounds` rounds in the same two processes, the order rotating,
and each figure is the median over the rounds of an FSDP2 training's over the same round's DDP
training's, with the spread beside it, in tokens/s and in tokens per CPU-second, so that load from
other work on the machine meets every arm alike (`paired`; `--paired N` runs only this).

GPU (CUDA only, else null; `--gpu` runs only this, with nothing but torch, transformers,
safetensors and pyarrow installed): the training step the loop runs (`pipeline.training.step`:
bf16 autocast over fp32 master weights, fused AdamW, FlexAttention for the training-time test) on a
drafter of Llama-3.1-8B's sizes, hidden 4096, vocab 128256, draft vocab 32000, MLP 14336, 32 heads /
8 KV heads, three aux layers, over the step the defaults train on: 16 documents of 512 tokens
(train.batch_size_per_gpu x train.window_tokens) packed by `window.pack`; also at a quarter of that
(the per-step costs, AdamW and clipping, weigh more there). Model FLOPs per token count the drafter's
matmuls and causal attention three times (forward, backward) per training-time-test step
plus the teacher's lm_head rows once; MFU is their rate over the GPU's bf16 matmul rate
measured in the same run (8192^3 matmuls).

`run(tiny=True)`, the smoke run: every measurement once, one epoch, on one step's buffer, small checkpoints, and
on CUDA a drafter of hidden 256 (`TINY`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the GPU path needs only torch and the model code
    from pipeline.training.losses import LossParts
    from pipeline.training.step import StepStats
    from pipeline.training.window import DeviceBatch


@dataclass(frozen=True)
class Sizes:
    repeats: int  # one process's trainings, and the checkpoint comparison's rounds: best of them
    epochs: int  # of each timed training on the demo's buffer
    buffer_steps: int | None  # RL steps of the demo's buffer (None: train.buffer_steps)
    paired_rounds: int  # rounds of DDP and FSDP2 trainings, alternating in the same two processes
    ttt_rounds: int  # rounds of the banded and the dense TTT attention's trainings, alternating in one process
    ttt_epochs: int
    checkpoint_hidden: int  # the checkpointed drafter's target


FULL = Sizes(repeats=2, epochs=4, buffer_steps=None, paired_rounds=7, ttt_rounds=5, ttt_epochs=2,
             checkpoint_hidden=384)
TINY = Sizes(repeats=1, epochs=1, buffer_steps=1, paired_rounds=1, ttt_rounds=1, ttt_epochs=1, checkpoint_hidden=64)
# The paired arms: data parallel, FSDP2 as `train.fsdp_units: auto` shards the demo's drafter (one unit,
# gathered once a step), and FSDP2 with a unit per decoder layer (the least memory within a step).
PAIRED_ARMS = (("ddp", "auto"), ("fsdp", "auto"), ("fsdp", "layer"))


def _demo_setup(lognormal: bool = False, steps: int | None = None):
    """The demo's target, a fresh drafter and `steps` RL steps of its training rollouts (default
    `train.buffer_steps`): every response `simulation.response_len` long, or (`lognormal`) of the
    lengths the simulation draws (median 0.4 of it, sigma 0.5, capped at it)."""
    import math

    import torch

    from pipeline.config import load_config
    from pipeline.models import drafter as drafters
    from pipeline.models import target as target_lib
    from pipeline.models import target_forward
    from pipeline.training.dataset import InMemoryDataset

    cfg = load_config()
    sim = cfg.simulation
    target = target_lib.build_target(
        target_lib.tiny_llama_config(sim.vocab_size, sim.hidden_size, sim.num_layers, sim.num_heads), sim.seed)
    per_step = sim.rollouts_per_step - round(sim.rollouts_per_step * cfg.eval.held_out_fraction)
    n, length = per_step * (steps or cfg.train.buffer_steps), sim.prompt_len + sim.response_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sim.vocab_size, (n, length), generator=g)
    responses = [sim.response_len] * n
    if lognormal:  # as `SimulatedRL.response_lengths` draws them
        median = math.log(sim.response_len_median * sim.response_len)
        responses = [max(1, min(sim.response_len, round(math.exp(median + sim.response_len_sigma * float(z)))))
                     for z in torch.randn(n, generator=g, dtype=torch.float64)]
    drafter = drafters.fresh_drafter(cfg.drafter, target, torch.bincount(ids.flatten(), minlength=sim.vocab_size),
                                     cfg.train.seed)
    drafter.attach(target)
    layer_ids = [*drafter.config.aux_layer_ids, sim.num_layers]
    with torch.no_grad():
        layers = target_forward.forward(target, ids, layer_ids).layers  # (n, T, layers, H)
    mask = torch.cat([torch.zeros(sim.prompt_len), torch.ones(sim.response_len)]).long()
    # A causal target: a rollout's states are its prefix of the full-length forward's.
    ends = [sim.prompt_len + r for r in responses]
    samples = [(ids[i, :end], layers[i, :end].flatten(1), mask[:end]) for i, end in enumerate(ends)]
    return cfg, target, drafter, InMemoryDataset(samples)


def _cpu_rank(rank: int, world: int, port: int, out: str, arms: tuple[tuple[str, str], ...], repeats: int,
              epochs: int, buffer_steps: int | None) -> None:
    """Train the demo's drafter `repeats` rounds of `epochs`, each round every arm (`train.parallelism`,
    `train.fsdp_units`) once, on the same global batches, in these same processes, so that load from
    other work on the machine meets every arm alike. The order rotates from round to round (no arm
    always runs first, or right after the same other), after one warm-up epoch of each arm. Per
    training: tokens/s (wall) and tokens per CPU-second of the ranks (`time.process_time`, summed
    over them), which other work on the machine slows less than the wall clock."""
    import copy

    import torch
    import torch.distributed as dist

    from pipeline.training.distributed import DistContext, destroy_process_group, init_process_group
    from pipeline.training.loop import train_drafter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = DistContext(rank, world, rank)
    init_process_group(ctx, "cpu")
    try:
        cfg, target, drafter, data = _demo_setup(steps=buffer_steps)
        teacher = drafter.teacher(target)

        def train(arm: tuple[str, str], epochs: int):
            parallelism, units = arm
            settings = cfg.train.model_copy(update={"batch_size_per_gpu": cfg.train.batch_size_per_gpu,
                                                    "epochs": epochs, "parallelism": parallelism,
                                                    "fsdp_units": units})
            cpu = time.process_time()
            result = train_drafter(copy.deepcopy(drafter), data, settings, teacher=teacher, ctx=ctx)
            cpu_s = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
            if ctx.distributed:
                dist.all_reduce(cpu_s)
            return result, float(cpu_s)

        if repeats > 1:
            for arm in arms:  # the first training of each arm pays one-off costs (allocations, FSDP2's set-up)
                train(arm, 1)
        results: dict[str, list[dict]] = {_arm_name(arm): [] for arm in arms}
        load = [os.getloadavg()[0]]
        for round_ in range(repeats):
            for arm in arms[round_ % len(arms):] + arms[: round_ % len(arms)]:
                result, cpu_s = train(arm, epochs)
                plan = result.parallelism
                results[_arm_name(arm)].append({
                    "round": round_, "tokens": result.tokens, "wall_s": result.wall_s,
                    "tokens_per_s": result.tokens / result.wall_s, "tokens_per_cpu_s": result.tokens / cpu_s,
                    "iterations": result.iterations, "loss": result.loss, "rank_state_bytes": result.rank_state_bytes,
                    "units": plan.units if plan else None, "step_peak_bytes": plan.step_peak_bytes if plan else 0})
        load.append(os.getloadavg()[0])
        if ctx.is_main:
            Path(out).write_text(json.dumps({"runs": results, "load_average": load}))
    finally:
        destroy_process_group()


@contextlib.contextmanager
def _dense_ttt():
    """`eagle3_loss` with the dense `TTTCache` in place of the cache `ttt_cache` picks: the baseline."""
    from pipeline.models.ttt import TTTCache
    from pipeline.training import losses

    picked = losses.ttt_cache
    losses.ttt_cache = lambda document_ids: TTTCache()
    try:
        yield
    finally:
        losses.ttt_cache = picked


def ttt_attention(rounds: int = FULL.ttt_rounds, epochs: int = FULL.ttt_epochs) -> dict:
    """The demo's EAGLE-3 training on the CPU (one thread, one RL step's rollouts of the simulation's
    lognormal lengths, 16 packed per step, about 55 positions each), with the TTT attention
    `ttt_cache` picks there (`BandTTTCache`) against the dense `TTTCache` (`_dense_ttt`): trainings of
    `epochs` epochs, alternating in `rounds` rounds in this process after a warm-up of each. Each figure
    is the median over the rounds of the band's over the same round's dense training, in tokens/s
    (`banded_vs_dense_ttt_ratio`) and in tokens per CPU-second (`_cpu_ratio`, which other work on the
    machine disturbs less), with the spread beside it; the final losses agree to float noise."""
    import copy

    import torch

    from pipeline.models.ttt import BandTTTCache, ttt_cache
    from pipeline.training.loop import train_drafter
    from pipeline.training.window import pack

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg, target, drafter, data = _demo_setup(lognormal=True, steps=1)
        teacher = drafter.teacher(target)
        first = pack(data.load(list(range(cfg.train.batch_size_per_gpu))), cfg.train.window_tokens)
        assert isinstance(ttt_cache(first.document_ids), BandTTTCache), "the demo's batches attend in a band"

        def train(dense: bool, epochs: int):
            settings = cfg.train.model_copy(update={"epochs": epochs})
            with _dense_ttt() if dense else contextlib.nullcontext():
                cpu = time.process_time()
                result = train_drafter(copy.deepcopy(drafter), data, settings, teacher=teacher)
            return result, time.process_time() - cpu

        for dense in (False, True):
            train(dense, 1)
        runs: dict[str, list] = {"band": [], "dense": []}
        for round_ in range(rounds):
            for arm in ("band", "dense") if round_ % 2 == 0 else ("dense", "band"):
                runs[arm].append(train(arm == "dense", epochs))
    finally:
        torch.set_num_threads(threads)
    walls = [(b.tokens / b.wall_s) / (d.tokens / d.wall_s) for (b, _), (d, _) in zip(runs["band"], runs["dense"],
                                                                                       strict=True)]
    cpus = [d_cpu / b_cpu for (_, b_cpu), (_, d_cpu) in zip(runs["band"], runs["dense"], strict=True)]
    (wall, wall_spread), (cpu, cpu_spread) = _median_and_spread(walls), _median_and_spread(cpus)
    band, dense = runs["band"][0][0], runs["dense"][0][0]
    return {"ttt_rounds": rounds, "ttt_tokens_per_step": first.num_tokens,
            "banded_ttt_tokens_per_s": max(r.tokens / r.wall_s for r, _ in runs["band"]),
            "dense_ttt_tokens_per_s": max(r.tokens / r.wall_s for r, _ in runs["dense"]),
            "banded_vs_dense_ttt_ratio": wall, "banded_vs_dense_ttt_ratio_spread": wall_spread,
            "banded_vs_dense_ttt_cpu_ratio": cpu, "banded_vs_dense_ttt_cpu_ratio_spread": cpu_spread,
            "banded_vs_dense_ttt_loss_abs_diff": abs(band.loss - dense.loss)}


def _arm_name(arm: tuple[str, str]) -> str:
    parallelism, units = arm
    return parallelism if units == "auto" else f"{parallelism}_{units}"


def _cpu_runs(world: int, arms: tuple[tuple[str, str], ...], repeats: int, sizes: Sizes = FULL) -> dict:
    """Each arm's trainings, in order, from one set of `world` processes, and the machine's load
    average (1 minute) before and after them."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(_cpu_rank, args=(world, port, out, arms, repeats, sizes.epochs, sizes.buffer_steps),
                           nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())


def _median_and_spread(values: list[float]) -> tuple[float, list[float]]:
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return median, [ordered[0], ordered[-1]]


def paired(repeats: int = FULL.paired_rounds, sizes: Sizes = FULL) -> dict:
    """FSDP2 against DDP on two gloo ranks: each FSDP2 training's tokens/s over the DDP training's of the
    same round, the median of `repeats` rounds and the lowest and highest (`_spread`); the same for
    tokens per CPU-second; the training state one rank holds between steps, and a step's peak with
    the drafter one unit (the plan's figure). Both FSDP2 settings, `auto`'s choice unsuffixed."""
    paired_runs = _cpu_runs(2, PAIRED_ARMS, repeats, sizes)
    runs = paired_runs["runs"]
    ddp = runs["ddp"]
    out: dict = {"paired_rounds": repeats, "paired_load_average": paired_runs["load_average"],
                 "ddp2_tokens_per_s": max(r["tokens_per_s"] for r in ddp)}
    for arm, prefix in (("fsdp", "fsdp2"), ("fsdp_layer", "fsdp2_layer")):
        sharded = runs[arm]
        assert all(f["tokens"] == d["tokens"] for d, f in zip(ddp, sharded, strict=True)), "not the same batches"
        walls = [f["tokens_per_s"] / d["tokens_per_s"] for d, f in zip(ddp, sharded, strict=True)]
        cpus = [f["tokens_per_cpu_s"] / d["tokens_per_cpu_s"] for d, f in zip(ddp, sharded, strict=True)]
        (wall, wall_spread), (cpu, cpu_spread) = _median_and_spread(walls), _median_and_spread(cpus)
        out.update({
            f"{prefix}_units": sharded[0]["units"],
            f"{prefix}_tokens_per_s": max(r["tokens_per_s"] for r in sharded),
            f"{prefix}_vs_ddp2_tokens_ratio": wall, f"{prefix}_vs_ddp2_tokens_ratio_spread": wall_spread,
            f"{prefix}_vs_ddp2_cpu_ratio": cpu, f"{prefix}_vs_ddp2_cpu_ratio_spread": cpu_spread,
            f"{prefix}_vs_ddp2_rounds": [{"tokens": round(w, 3), "cpu": round(c, 3)} for w, c in zip(walls, cpus,
                                                                                             strict=True)],
            f"{prefix}_vs_ddp2_rank_state_ratio": sharded[0]["rank_state_bytes"] / ddp[0]["rank_state_bytes"],
            f"{prefix}_rank_state_mb": sharded[0]["rank_state_bytes"] / 1e6})
    out["ddp2_rank_state_mb"] = ddp[0]["rank_state_bytes"] / 1e6
    out["fsdp2_step_peak_mb"] = runs["fsdp"][0]["step_peak_bytes"] / 1e6
    return out


@dataclass(frozen=True)
class DrafterShapes:
    """An EAGLE-3 drafter of a target, and the packed batch it trains on."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    mlp: int = 14336
    vocab: int = 128256
    draft_vocab: int = 32000
    tokens: int = 8192  # one packed sequence of `docs` documents
    docs: int = 16


LLAMA_8B = DrafterShapes()  # Llama-3.1-8B's sizes, the default training step
LLAMA_8B_SHORT = DrafterShapes(tokens=2048, docs=4)
GPU_TINY = DrafterShapes(hidden=256, heads=4, kv_heads=2, mlp=512, vocab=4096, draft_vocab=1024, tokens=512, docs=4)
TTT_STEPS, TTT_DECAY = 3, 0.8  # the defaults of train.ttt_steps and train.ttt_decay


def model_flops_per_token(shapes: DrafterShapes, ttt_steps: int) -> float:
    """Training FLOPs per token of the EAGLE-3 drafter above (see the module docstring)."""
    h, d = shapes.hidden, shapes.hidden // shapes.heads
    proj = 2 * (2 * h) * (shapes.heads + 2 * shapes.kv_heads) * d + 2 * shapes.heads * d * h  # q, k, v from 2H; o
    mlp = 2 * 3 * h * shapes.mlp
    head = 2 * h * shapes.draft_vocab
    attention = 2 * 2 * (shapes.tokens / shapes.docs / 2) * h  # QK^T and PV, causal within a document
    teacher = 2 * h * shapes.draft_vocab  # the target's logits over the draft vocab: forward only
    fc = 2 * 3 * h * h
    return ttt_steps * (3 * (proj + mlp + head + attention) + teacher) + 3 * fc


def _bf16_matmul_flops(torch) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps, start = 20, time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start)


def shipped_step(shapes: DrafterShapes, device: str, dtype: str = "bf16") -> Callable[[], StepStats]:
    """One training step of an EAGLE-3 drafter of `shapes`, built and run as the training loop runs
    it: a batch packed by `window.pack` and moved by `PackedBatch.to`, `step.forward_backward`
    over the EAGLE-3 loss, `step.apply_gradients` with the loop's optimizer. Returns a
    function that runs one step and returns its loss parts (on the device)."""
    import torch

    from pipeline.models.eagle import RMSNorm
    from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter
    from pipeline.training.losses import eagle3_loss
    from pipeline.training.step import apply_gradients, forward_backward, make_optimizer
    from pipeline.training.window import pack

    torch.manual_seed(0)
    h = shapes.hidden
    config = Eagle3Config(vocab_size=shapes.vocab, draft_vocab_size=shapes.draft_vocab, hidden_size=h,
                          target_hidden_size=h, intermediate_size=shapes.mlp, num_attention_heads=shapes.heads,
                          num_key_value_heads=shapes.kv_heads, aux_layer_ids=(2, 16, 29),
                          max_position_embeddings=shapes.tokens)
    model = Eagle3Drafter(config).to(device).train()
    norm = RMSNorm(h, 1e-5).to(device).requires_grad_(False)
    # The target's lm_head rows (draft_vocab, H_t), in the target's bf16 where autocast runs, else fp32.
    head_dtype = torch.bfloat16 if torch.device(device).type == "cuda" and dtype == "bf16" else torch.float32
    head = torch.randn(shapes.draft_vocab, h, device=device, dtype=head_dtype) * 0.02
    per_doc = shapes.tokens // shapes.docs + 1  # a document's window: its positions plus the shifted target
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, shapes.vocab, (per_doc,), generator=g),
                torch.randn(per_doc, 4 * h, generator=g).to(torch.bfloat16),  # (T, 4H) as the shards hold them
                torch.ones(per_doc, dtype=torch.int64)) for _ in range(shapes.docs)]
    batch = pack(samples, window_tokens=per_doc).to(device)  # (1, tokens, 4H) float32 features
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(model, lr=1e-4, weight_decay=0.0, device=device)

    def loss_of(b: DeviceBatch) -> LossParts:
        return eagle3_loss(model, b, norm, head, TTT_STEPS, TTT_DECAY)

    def step() -> StepStats:
        stats = forward_backward(loss_of, batch, dtype)
        apply_gradients(optimizer, params, 1e-4, 1.0)
        return stats

    return step


def _gpu_mfu(shapes: DrafterShapes, peak: float, steps: int = 10, warmup: int = 3) -> dict:
    import torch

    step = shipped_step(shapes, "cuda")
    for _ in range(warmup):  # the first compiles FlexAttention and the loss's chunk kernel
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    achieved = model_flops_per_token(shapes, TTT_STEPS) * shapes.tokens / step_s
    result = {"tokens": shapes.tokens, "step_s": step_s, "tokens_per_s": shapes.tokens / step_s,
              "model_tflops": achieved / 1e12, "mfu": achieved / peak,
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    del step
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def gpu(tiny: bool = False) -> dict | None:
    """MFU at the default step and at a quarter of it (`tiny`: of `GPU_TINY`, both), against the bf16 matmul rate
    measured here."""
    import torch

    if not torch.cuda.is_available():
        return None
    shapes, short_shapes = (GPU_TINY, GPU_TINY) if tiny else (LLAMA_8B, LLAMA_8B_SHORT)
    peak = _bf16_matmul_flops(torch)
    default, short = _gpu_mfu(shapes, peak), _gpu_mfu(short_shapes, peak)
    return {"gpu": torch.cuda.get_device_name(), "bf16_matmul_tflops": peak / 1e12, **default,
            "shapes": asdict(shapes), "short_step": short}  # shapes: what `cli.py plan` scales from


CHECKPOINT_EPOCHS, CHECKPOINT_EVERY = 1, 3


def _checkpoint_setup(h: int):
    """An EAGLE-3 drafter of a small simulated target (hidden `h`; at 384, checkpoints of 42 MB of weights and
    AdamW moments) and 48 samples of 128 tokens (12 iterations per epoch of 4 samples)."""
    import torch

    from pipeline.config import DrafterConfig
    from pipeline.models import drafter as drafters
    from pipeline.models import target as target_lib
    from pipeline.models import target_forward
    from pipeline.training.dataset import InMemoryDataset

    vocab, layers = 512, 4
    target = target_lib.build_target(target_lib.tiny_llama_config(vocab, h, layers, h // 64), seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (48, 128), generator=g)
    drafter = drafters.fresh_drafter(DrafterConfig(kind="eagle3", aux_layer_ids=[1, 2, 3]), target,
                                     torch.bincount(ids.flatten(), minlength=vocab), seed=0)
    with torch.no_grad():
        hidden = target_forward.forward(target, ids, drafter.stored_layer_ids(layers)).layers  # (48, 128, 4, H)
    mask = torch.ones(128, dtype=torch.int64)
    samples = [(ids[i], hidden[i].flatten(1), mask) for i in range(ids.shape[0])]  # (T, [aux..., last] x H)
    return drafter, drafter.teacher(target), InMemoryDataset(samples)


def checkpoint_cost(sizes: Sizes = FULL) -> dict:
    """Training time lost to checkpoints, written synchronously or in the background (to a `file://`
    store), in the same training, alternating, best of `sizes.repeats`. Lost: the training thread's time on
    checkpoints (`TrainResult.checkpoint_s`: the copy to the host, then the write, or the wait for the
    previous one); also the wall time over the same training without checkpoints, which adds the
    background thread's competition for the CPU (two cores here, shared)."""
    import copy

    import torch

    from pipeline.config import OptimConfig, TrainConfig
    from pipeline.data.store import ObjectStore
    from pipeline.training.loop import train_drafter
    from pipeline.training.state import TrainingCheckpoints

    torch.set_num_threads(1)
    drafter, teacher, data = _checkpoint_setup(sizes.checkpoint_hidden)
    results: dict[str, list] = {"none": [], "sync": [], "background": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(sizes.repeats):
            for mode in results:
                cfg = TrainConfig(epochs=CHECKPOINT_EPOCHS, batch_size_per_gpu=4, max_seq_len=512, window_tokens=128,
                                  optim=OptimConfig(lr=1e-3, lr_warmup_steps=2), dtype="fp32",
                                  checkpoint_every=0 if mode == "none" else CHECKPOINT_EVERY,
                                  checkpoint_background=mode == "background")
                checkpoints = TrainingCheckpoints(ObjectStore(Path(tmp).as_uri()), f"training/bench/{mode}-{repeat}")
                results[mode].append(train_drafter(copy.deepcopy(drafter), data, cfg, teacher=teacher,
                                                   checkpoints=checkpoints if mode != "none" else None))
    best = {mode: min(results[mode], key=lambda r: r.wall_s) for mode in results}
    saves = (best["none"].iterations - 1) // CHECKPOINT_EVERY
    sync_s = min(r.checkpoint_s for r in results["sync"])
    background_s = min(r.checkpoint_s for r in results["background"])
    wall_sync, wall_background = (best[m].wall_s - best["none"].wall_s for m in ("sync", "background"))
    return {"checkpoints": saves, "checkpoint_mb": _checkpoint_mb(drafter), "train_s": best["none"].wall_s,
            "sync_lost_ms_per_checkpoint": 1e3 * sync_s / saves,
            "background_lost_ms_per_checkpoint": 1e3 * background_s / saves,
            "checkpoint_lost_background_vs_sync_ratio": background_s / sync_s,
            "wall_lost_ms_per_checkpoint": {"sync": 1e3 * wall_sync / saves,
                                            "background": 1e3 * wall_background / saves}}


def _checkpoint_mb(drafter) -> float:
    """Weights and the two AdamW moments of the trainable parameters, as a checkpoint holds them."""
    return sum(3 * p.numel() * p.element_size() for p in drafter.parameters() if p.requires_grad) / 1e6


def run(tiny: bool = False) -> dict:
    sizes = TINY if tiny else FULL
    single = max(_cpu_runs(1, (("ddp", "auto"),), sizes.repeats, sizes)["runs"]["ddp"], key=lambda r: r["tokens_per_s"])
    sharding = paired(sizes.paired_rounds, sizes)
    attention = ttt_attention(sizes.ttt_rounds, sizes.ttt_epochs)
    checkpoints = checkpoint_cost(sizes)
    gpu_result = gpu(tiny)
    return {
        "cpu_tokens_per_s": single["tokens_per_s"],
        "ddp2_speedup": sharding["ddp2_tokens_per_s"] / single["tokens_per_s"],
        **sharding,
        **attention,
        **checkpoints,
        "reference_drafters": reference_decisions(),
        "cpu_iterations": single["iterations"],
        "cpu_cores": os.cpu_count(),
        "gpu_mfu": gpu_result["mfu"] if gpu_result else None,
        "gpu": gpu_result,
    }


REFERENCE_TARGETS = {"llama-3.1-8b": (4096, 14336, 32), "llama-3.1-70b": (8192, 28672, 64),
                     "llama-3.1-405b": (16384, 53248, 128)}  # hidden, MLP, heads (8 KV heads, vocab 128256)


def reference_decisions(gpu_memory_gb: float = 80.0, share: float = 0.5) -> dict:
    """`train.parallelism: auto` for EAGLE-3 drafters of the Llama-3.1 targets, built on the meta device."""
    import torch

    from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter
    from pipeline.training.distributed import choose_parallelism

    out = {}
    for name, (hidden, mlp, heads) in REFERENCE_TARGETS.items():
        with torch.device("meta"):
            drafter = Eagle3Drafter(Eagle3Config(
                vocab_size=128256, draft_vocab_size=32000, hidden_size=hidden, target_hidden_size=hidden,
                intermediate_size=mlp, num_attention_heads=heads, num_key_value_heads=8, aux_layer_ids=(2, 16, 29)))
        plan = choose_parallelism(drafter, "auto", share, int(gpu_memory_gb * 1e9), world_size=8)
        sharded = choose_parallelism(drafter, "fsdp", share, int(gpu_memory_gb * 1e9), world_size=8)
        out[name] = {"parallelism": plan.mode, "trainable_params_b": plan.trainable_params / 1e9,
                     "frozen_params_b": plan.frozen_params / 1e9, "training_state_gb": plan.state_bytes / 1e9,
                     "share_of_gpu": plan.state_share,
                     "fsdp_units": sharded.units, "fsdp_step_peak_gb": sharded.step_peak_bytes / 1e9}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training", description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true",
                        help="only the GPU measurement (needs only torch, transformers, safetensors and pyarrow)")
    parser.add_argument("--paired", type=int, metavar="ROUNDS", default=0,
                        help="only FSDP2 against DDP on two gloo ranks, this many rounds")
    parser.add_argument("--ttt", type=int, metavar="ROUNDS", default=0,
                        help="only the banded TTT attention against the dense one, this many rounds")
    parser.add_argument("--tiny", action="store_true", help="the smoke run's sizes (seconds)")
    args = parser.parse_args(argv)
    if args.gpu:
        gpu_result = gpu(args.tiny)
        result = {"gpu_mfu": gpu_result["mfu"] if gpu_result else None, "gpu": gpu_result}
    elif args.paired:
        result = paired(args.paired)
    elif args.ttt:
        result = ttt_attention(args.ttt)
    else:
        result = run(args.tiny)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
