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
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sizes:
    vocab: int
    hidden: int
    tokens: int


FULL = Sizes(vocab=128256, hidden=4096, tokens=2048)
TINY = Sizes(vocab=8192, hidden=256, tokens=512)  # the smoke run's: (tokens, vocab) float32 is still 16 MiB


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _measure(variant: str, sizes: Sizes, device: str) -> dict:
    import torch

    from pipeline.training.losses import soft_cross_entropy, soft_cross_entropy_reference

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens = sizes.tokens
    hidden = torch.randn(tokens, sizes.hidden, device=device, dtype=dtype, requires_grad=True)
    target_hidden = torch.randn(tokens, sizes.hidden, device=device, dtype=dtype)
    weight = torch.randn(sizes.vocab, sizes.hidden, device=device, dtype=dtype).mul_(0.02)  # in place: no copy
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


def run(tiny: bool = False) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = TINY if tiny else FULL
    results = {}
    for variant in ("naive", "chunked"):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.policy_loss", variant, device, *(["--tiny"] if tiny else [])],
            check=True, capture_output=True, text=True,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    naive, chunked = results["naive"], results["chunked"]
    return {
        "peak_mem_ratio": chunked["peak_bytes"] / naive["peak_bytes"],
        "time_ratio": chunked["seconds"] / naive["seconds"],
        "naive": naive,
        "chunked": chunked,
        "vocab": sizes.vocab,
        "hidden": sizes.hidden,
        "tokens": sizes.tokens,
        "device": device,
        "dtype": "bfloat16" if device == "cuda" else "float32",
    }


if __name__ == "__main__":
    # the child of `run`: python -m benchmarks.policy_loss VARIANT DEVICE [--tiny]
    sys.stdout.write(json.dumps(_measure(sys.argv[1], TINY if "--tiny" in sys.argv else FULL, sys.argv[2])) + "\n")
