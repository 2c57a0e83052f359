"""Hidden-state extraction (source B): throughput against a plain forward, and peak memory against step size.

* `tokens_per_s_vs_plain_forward`: extraction as the pipeline runs it (rollouts sorted and batched
  by `tokens_per_batch`, the stored layers caught, cast to bf16, copied to the host and streamed
  into shards in a local store) over a plain batched forward of the target's backbone over the same
  padded batches, in the same process. `capture_tokens_per_s_vs_plain_forward` is the same without
  the shard writes (catching, casting and copying the layers only).
* `storage_bound_vs_plain_forward`: the most the store's disk allows, in the same units: its
  write-and-fsync rate (what a shard write costs; measured in the same directory, same run)
  over the plain forward's rate of stored bytes. Extraction cannot beat it, whatever the forward.
* `peak_rss_ratio_4x_step`: peak RSS of a process that extracts a step of 4N rollouts over one that
  extracts N (same target, same length distribution), each in its own process. Memory bounded by a
  batch gives ~1.0; holding the step would grow with it.

CPU (default, `make bench`): a small fp32 Llama, under two minutes on two cores. `--tiny` (the smoke run's):
`TINY_THROUGHPUT` and `TINY_MEMORY` on either device, one repeat, seconds.
CUDA: `python -m benchmarks.extraction --device cuda`: a 1.5B-parameter bf16 Llama built from its
config (H 2048, 16 layers, vocab 128256); needs torch, transformers, pyarrow, numpy, fsspec and
xxhash only (no pipeline configuration, no dagster or mlflow).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Setup:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    dtype: str
    samples: int  # rollouts of a step (the smaller step of the memory comparison)
    min_len: int
    max_len: int
    tokens_per_batch: int


# Throughput: a target whose forward is the cost that matters. Memory: the same hidden size and
# batches but a narrow MLP over few layers, so that a step's stored bytes are large against the
# process (a step of 4N held in memory would show) while its forward stays cheap.
THROUGHPUT = {
    "cpu": Setup(hidden_size=512, num_layers=4, intermediate_size=1408, num_heads=8, num_kv_heads=8,
                 vocab_size=32000, dtype="float32", samples=16, min_len=64, max_len=512, tokens_per_batch=4096),
    "cuda": Setup(hidden_size=2048, num_layers=16, intermediate_size=8192, num_heads=32, num_kv_heads=8,
                  vocab_size=128256, dtype="bfloat16", samples=256, min_len=128, max_len=2048,
                  tokens_per_batch=32768),
}
MEMORY = {
    "cpu": Setup(hidden_size=512, num_layers=2, intermediate_size=128, num_heads=8, num_kv_heads=8,
                 vocab_size=32000, dtype="float32", samples=48, min_len=64, max_len=1024, tokens_per_batch=4096),
    "cuda": Setup(hidden_size=2048, num_layers=2, intermediate_size=512, num_heads=32, num_kv_heads=8,
                  vocab_size=128256, dtype="bfloat16", samples=64, min_len=128, max_len=2048,
                  tokens_per_batch=32768),
}
TINY_THROUGHPUT = Setup(hidden_size=64, num_layers=2, intermediate_size=128, num_heads=4, num_kv_heads=4,
                        vocab_size=256, dtype="float32", samples=4, min_len=16, max_len=64, tokens_per_batch=256)
TINY_MEMORY = replace(TINY_THROUGHPUT, samples=8)
PROBE_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}  # the disk's write-and-fsync probe
TINY_PROBE_BYTES = 4 << 20


def _target(setup: Setup, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=setup.vocab_size, hidden_size=setup.hidden_size, intermediate_size=setup.intermediate_size,
        num_hidden_layers=setup.num_layers, num_attention_heads=setup.num_heads,
        num_key_value_heads=setup.num_kv_heads, max_position_embeddings=max(4096, setup.max_len),
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, setup.dtype))
    return model.eval()


def _rollouts(setup: Setup, samples: int, seed: int) -> list:
    from pipeline.data.rollouts import Rollout

    rng = random.Random(seed)
    out = []
    for i in range(samples):
        n = rng.randint(setup.min_len, setup.max_len)
        ids = [rng.randrange(setup.vocab_size) for _ in range(n)]
        out.append(Rollout(f"s{seed}-{i}", ids, [0] * (n // 4) + [1] * (n - n // 4), 1.0, 1))
    return out


def _layer_ids(num_layers: int) -> list[int]:
    from pipeline.models.eagle3 import default_aux_layer_ids, stored_layer_ids

    return stored_layer_ids(default_aux_layer_ids(num_layers), num_layers)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _extract(model, rollouts: list, setup: Setup, device: str, store, step: int, hold: bool = False) -> int:
    """Extract `rollouts` into shards of `store`; the manifest's token count. `hold`: the whole step
    in memory before the write (the control that shows what the memory measurement detects)."""
    from pipeline.data import shards
    from pipeline.sources.extract import iter_hidden_states

    layer_ids = _layer_ids(model.config.num_hidden_layers)
    samples = iter_hidden_states(model, rollouts, step, tokens_per_batch=setup.tokens_per_batch, device=device,
                                 layer_ids=layer_ids)
    if hold:
        samples = [replace(s, hidden=s.hidden.clone()) for s in samples]  # each its own copy, as a list holds them
    manifest = shards.write_hidden_states(store, "bench", step, samples, hidden_size=model.config.hidden_size,
                                          layer_ids=layer_ids, target={})
    return manifest.num_tokens


def _capture(model, rollouts: list, setup: Setup, device: str) -> int:
    """The extraction's forward, catch and host copy, the samples dropped as they come."""
    from pipeline.sources.extract import iter_hidden_states

    layer_ids = _layer_ids(model.config.num_hidden_layers)
    return sum(s.hidden.shape[0] for s in iter_hidden_states(
        model, rollouts, 0, tokens_per_batch=setup.tokens_per_batch, device=device, layer_ids=layer_ids))


def _plain_forward(model, rollouts: list, setup: Setup, device: str) -> int:
    """The baseline: the backbone over the same padded batches, nothing kept."""
    import torch

    from pipeline.sources.extract import plan_batches

    tokens = 0
    with torch.no_grad():
        for batch in plan_batches([len(r.input_ids) for r in rollouts], setup.tokens_per_batch):
            longest = len(rollouts[batch[0]].input_ids)
            ids = torch.zeros(len(batch), longest, dtype=torch.int64)
            for row, i in enumerate(batch):
                ids[row, : len(rollouts[i].input_ids)] = torch.tensor(rollouts[i].input_ids)
            model.model(input_ids=ids.to(device), use_cache=False)
            tokens += sum(len(rollouts[i].input_ids) for i in batch)
    _sync(device)
    return tokens


def _timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def _durable_write_bytes_per_s(directory: str, nbytes: int) -> float:
    """Bytes per second of writing `nbytes` to a file in `directory` and fsyncing it, as a shard write does."""
    import os

    block = os.urandom(min(nbytes, 64 << 20))
    path = Path(directory) / "fsync-probe"
    start = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    written = path.stat().st_size
    path.unlink()
    return written / seconds


def throughput(setup: Setup, device: str, repeats: int, probe_bytes: int) -> dict:
    from pipeline.data.keys import hidden_states_prefix
    from pipeline.data.store import ObjectStore

    model = _target(setup, device)
    rollouts = _rollouts(setup, setup.samples, seed=0)
    best = {"plain": float("inf"), "capture": float("inf"), "extract": float("inf")}
    tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        store = ObjectStore(Path(tmp).as_uri())
        _plain_forward(model, rollouts[:2], setup, device)  # warm-up: kernels, allocator
        _extract(model, rollouts[:2], setup, device, store, step=0)
        for rep in range(repeats):  # interleaved, best of each: load on a shared machine hits both alike
            seconds, tokens = _timed(lambda: _plain_forward(model, rollouts, setup, device))
            best["plain"] = min(best["plain"], seconds)
            seconds, _ = _timed(lambda: _capture(model, rollouts, setup, device))
            best["capture"] = min(best["capture"], seconds)
            seconds, _ = _timed(lambda r=rep: _extract(model, rollouts, setup, device, store, step=r + 1))
            best["extract"] = min(best["extract"], seconds)
            store.delete_prefix(hidden_states_prefix("bench", rep + 1))
        disk_bytes_per_s = _durable_write_bytes_per_s(tmp, probe_bytes)
    layers = len(_layer_ids(setup.num_layers))
    plain_bytes_per_s = layers * setup.hidden_size * 2 * tokens / best["plain"]  # stored bytes at the forward's rate
    return {
        "tokens": tokens,
        "stored_layers": layers,
        "stored_bytes_per_token": layers * setup.hidden_size * 2,
        "plain_forward_tokens_per_s": tokens / best["plain"],
        "extraction_tokens_per_s": tokens / best["extract"],
        "tokens_per_s_vs_plain_forward": best["plain"] / best["extract"],
        "capture_tokens_per_s_vs_plain_forward": best["plain"] / best["capture"],
        "storage_write_gb_per_s": disk_bytes_per_s / 1e9,
        "storage_bound_vs_plain_forward": disk_bytes_per_s / plain_bytes_per_s,
    }


def measure_step(setup: Setup, device: str, samples: int, hold: bool = False) -> dict:
    """In this process: extract a step of `samples` rollouts into shards; its peak RSS."""
    from pipeline.data.store import ObjectStore

    model = _target(setup, device)
    rollouts = _rollouts(setup, samples, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = _extract(model, rollouts, setup, device, ObjectStore(Path(tmp).as_uri()), step=1, hold=hold)
    return {"tokens": tokens, "peak_rss_bytes": _peak_rss_bytes()}


def _peak_rss_bytes() -> int:
    """This process's own peak RSS: VmHWM belongs to the address space exec made. ru_maxrss does not do:
    Linux carries it across exec, so a child of a large process (a pytest worker) reports its parent's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss(setup: Setup, device: str, samples: int) -> dict:
    """`measure_step` in a fresh process: its peak RSS is that extraction's alone."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.extraction", "--measure-step", json.dumps(asdict(setup)),
         "--device", device, "--samples", str(samples)],
        check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(setup: Setup, device: str) -> dict:
    small = peak_rss(setup, device, setup.samples)
    large = peak_rss(setup, device, 4 * setup.samples)
    return {
        "step_tokens": small["tokens"],
        "step_4x_tokens": large["tokens"],
        "peak_rss_mib": small["peak_rss_bytes"] / 2**20,
        "peak_rss_4x_step_mib": large["peak_rss_bytes"] / 2**20,
        "peak_rss_ratio_4x_step": large["peak_rss_bytes"] / small["peak_rss_bytes"],
    }


def run(device: str = "cpu", repeats: int = 2, tiny: bool = False) -> dict:
    if tiny:
        speed, rss, repeats, probe = TINY_THROUGHPUT, TINY_MEMORY, 1, TINY_PROBE_BYTES
    else:
        speed, rss, probe = THROUGHPUT[device], MEMORY[device], PROBE_BYTES[device]
    return {"device": device, "target": asdict(speed), "memory_target": asdict(rss),
            **throughput(speed, device, repeats, probe), **memory(rss, device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=sorted(THROUGHPUT))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="the smoke run's sizes (seconds)")
    parser.add_argument("--measure-step", help=argparse.SUPPRESS)  # a Setup as JSON: the child of `peak_rss`
    parser.add_argument("--samples", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--hold-step", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_step:
        result = measure_step(Setup(**json.loads(args.measure_step)), args.device, args.samples, args.hold_step)
    else:
        result = run(args.device, args.repeats, args.tiny)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
