"""Drafter training throughput: CPU at the demo's size (one process vs two gloo ranks), and
model FLOPs utilization of an EAGLE-3 drafter of a Llama-3-8B-sized target on a GPU.

CPU: the demo's EAGLE-3 drafter (simulated target: vocab 64, hidden 64, 2 layers), its
buffer (two steps of 84 samples of 64 tokens) and its training settings, four epochs. Two
ranks (gloo) train the same global batches of 16 samples as the one process, 8 samples
each. Every process runs one thread, so the ratio is the data-parallel scaling from one core
to two (with more threads per process, OpenMP's barriers dominate on a busy machine and
the single process looks worse than it is). Single and DDP runs alternate, best of
`REPEATS`, so that load from other work on the machine hits both alike.

GPU (CUDA only, else null): hidden 4096, vocab 128256, draft vocab 32000, MLP 14336, 32
heads / 8 KV heads, three aux layers, 2048-token packed sequences of four documents, bf16
autocast over fp32 master weights, fused AdamW. Model FLOPs per token count the drafter's
matmuls and causal attention three times (forward, backward) per training-time-test step
plus the teacher's lm_head rows once; MFU is their rate over the GPU's bf16 matmul rate
measured in the same run (8192^3 matmuls).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

REPEATS = 2
DRAFT_VOCAB, VOCAB, HIDDEN, MLP, HEADS, KV_HEADS, TOKENS, DOCS = 32000, 128256, 4096, 14336, 32, 8, 2048, 4


def _demo_setup():  # noqa: ANN202
    import torch

    from pipeline.config import load_config
    from pipeline.models import drafter as drafters
    from pipeline.models import target as target_lib
    from pipeline.training.dataset import InMemoryDataset

    cfg = load_config()
    sim = cfg.simulation
    target = target_lib.build_target(
        target_lib.tiny_llama_config(sim.vocab_size, sim.hidden_size, sim.num_layers, sim.num_heads), sim.seed)
    per_step = sim.rollouts_per_step - round(sim.rollouts_per_step * cfg.eval.held_out_fraction)
    n, length = per_step * cfg.train.buffer_steps, sim.prompt_len + sim.response_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sim.vocab_size, (n, length), generator=g)
    drafter = drafters.fresh_drafter(cfg.drafter, target, torch.bincount(ids.flatten(), minlength=sim.vocab_size),
                                     cfg.train.seed)
    drafter.attach(target)
    layer_ids = [*drafter.config.aux_layer_ids, sim.num_layers]
    with torch.no_grad():
        layers = target_lib.forward(target, ids, layer_ids).layers  # (n, T, layers, H)
    mask = torch.cat([torch.zeros(sim.prompt_len), torch.ones(sim.response_len)]).long()
    samples = [(ids[i], layers[i].flatten(1), mask) for i in range(n)]
    return cfg, target, drafter, InMemoryDataset(samples)


def _cpu_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch

    from pipeline.training.distributed import DistContext, destroy_process_group, init_process_group
    from pipeline.training.loop import train_drafter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = DistContext(rank, world, rank)
    init_process_group(ctx, "cpu")
    try:
        cfg, target, drafter, data = _demo_setup()
        train = cfg.train.model_copy(update={"batch_size_per_gpu": cfg.train.batch_size_per_gpu // world,
                                             "epochs": 4})
        result = train_drafter(drafter, data, train, teacher=drafter.teacher(target), ctx=ctx)
        if ctx.is_main:
            Path(out).write_text(json.dumps({"tokens": result.tokens, "wall_s": result.wall_s,
                                             "iterations": result.iterations, "loss": result.loss}))
    finally:
        destroy_process_group()


def _cpu_tokens_per_s(world: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(_cpu_rank, args=(world, port, out), nprocs=world, start_method="spawn")
        result = json.loads(Path(out).read_text())
    return {**result, "tokens_per_s": result["tokens"] / result["wall_s"]}


def model_flops_per_token(tokens: int, ttt_steps: int) -> float:
    """Training FLOPs per token of the EAGLE-3 drafter above (see the module docstring)."""
    d = HIDDEN // HEADS
    proj = 2 * (2 * HIDDEN) * (HEADS + 2 * KV_HEADS) * d + 2 * HEADS * d * HIDDEN  # q, k, v from 2H; o
    mlp = 2 * 3 * HIDDEN * MLP
    head = 2 * HIDDEN * DRAFT_VOCAB
    attention = 2 * 2 * (tokens / DOCS / 2) * HIDDEN  # QK^T and PV, causal within a document
    teacher = 2 * HIDDEN * DRAFT_VOCAB  # the target's logits over the draft vocab: forward only
    fc = 2 * 3 * HIDDEN * HIDDEN
    return ttt_steps * (3 * (proj + mlp + head + attention) + teacher) + 3 * fc


def _bf16_matmul_flops(torch) -> float:  # noqa: ANN001
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


def _gpu_mfu(steps: int = 10, warmup: int = 3) -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    from pipeline.config import TrainConfig
    from pipeline.models.eagle import RMSNorm
    from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter
    from pipeline.models.teacher import Teacher
    from pipeline.training.loop import compute_loss
    from pipeline.training.window import PackedBatch

    torch.manual_seed(0)
    cfg = TrainConfig()
    config = Eagle3Config(vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, hidden_size=HIDDEN,
                          target_hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, aux_layer_ids=(2, 16, 29), max_position_embeddings=TOKENS)
    model = Eagle3Drafter(config).cuda().train()
    teacher = Teacher(norm=RMSNorm(HIDDEN, 1e-5).cuda().requires_grad_(False),
                      head=torch.randn(DRAFT_VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02)
    per_doc = TOKENS // DOCS
    features = torch.randn(1, TOKENS + 1, 4 * HIDDEN, device="cuda", dtype=torch.bfloat16)
    batch = PackedBatch(
        input_ids=torch.randint(0, VOCAB, (1, TOKENS), device="cuda"),
        hidden_states=features[:, :-1], target=features[:, 1:],
        loss_mask=torch.ones(1, TOKENS, device="cuda"),
        position_ids=torch.arange(per_doc, device="cuda").repeat(DOCS)[None],
        document_ids=torch.arange(DOCS, device="cuda").repeat_interleave(per_doc)[None],
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def train_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            parts = compute_loss(model, batch, cfg, teacher)
        parts.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        train_step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        train_step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    achieved = model_flops_per_token(TOKENS, cfg.ttt_steps) * TOKENS / step_s
    peak = _bf16_matmul_flops(torch)
    return {"gpu": torch.cuda.get_device_name(), "tokens_per_s": TOKENS / step_s, "model_tflops": achieved / 1e12,
            "bf16_matmul_tflops": peak / 1e12, "mfu": achieved / peak}


def run() -> dict:
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(REPEATS):
        for world in runs:
            runs[world].append(_cpu_tokens_per_s(world))
    single, ddp2 = (max(runs[w], key=lambda r: r["tokens_per_s"]) for w in (1, 2))
    gpu = _gpu_mfu()
    return {
        "cpu_tokens_per_s": single["tokens_per_s"],
        "ddp2_tokens_per_s": ddp2["tokens_per_s"],
        "ddp2_speedup": ddp2["tokens_per_s"] / single["tokens_per_s"],
        "cpu_iterations": single["iterations"],
        "cpu_cores": os.cpu_count(),
        "gpu_mfu": gpu["mfu"] if gpu else None,
        "gpu": gpu,
    }


if __name__ == "__main__":
    import sys

    sys.stdout.write(json.dumps(run(), indent=2) + "\n")
