"""Soft cross-entropy over a large vocabulary: chunked (ours) vs naive, time and peak memory.

Each variant runs in its own process so that its peak memory is its own. On CUDA the
peak is torch's allocator peak; on CPU the growth of the process's peak RSS over the
RSS after the inputs are allocated. The lm_head is frozen (EAGLE-1/2: the target's), so
the only gradient is the one w.r.t. the drafter's hidden states.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

VOCAB, HIDDEN, TOKENS = 128256, 4096, 2048


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _measure(variant: str, tokens: int, device: str) -> dict:
    import torch

    from pipeline.training.losses import soft_cross_entropy, soft_cross_entropy_reference

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden = torch.randn(tokens, HIDDEN, device=device, dtype=dtype, requires_grad=True)
    target_hidden = torch.randn(tokens, HIDDEN, device=device, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, device=device, dtype=dtype).mul_(0.02)  # in place: no transient copy
    mask = torch.ones(tokens, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    start = time.perf_counter()
    if variant == "chunked":
        loss, _ = soft_cross_entropy(hidden, weight, target_hidden, weight, mask)
    else:
        loss = soft_cross_entropy_reference(hidden, weight, target_hidden, weight, mask)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": time.perf_counter() - start, "peak_bytes": peak, "loss": float(loss)}


def run() -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = TOKENS
    results = {}
    for variant in ("naive", "chunked"):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.policy_loss", variant, str(tokens), device],
            check=True, capture_output=True, text=True,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    naive, chunked = results["naive"], results["chunked"]
    return {
        "peak_mem_ratio": chunked["peak_bytes"] / naive["peak_bytes"],
        "time_ratio": chunked["seconds"] / naive["seconds"],
        "naive": naive,
        "chunked": chunked,
        "vocab": VOCAB,
        "hidden": HIDDEN,
        "tokens": tokens,
        "device": device,
        "dtype": "bfloat16" if device == "cuda" else "float32",
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_measure(sys.argv[1], int(sys.argv[2]), sys.argv[3])) + "\n")
