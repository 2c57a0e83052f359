"""Batch preparation (window, shift, pack) and the memory of streaming the buffer.

speedup_vs_reference: tokens per second of `pipeline.training.window.pack` over
`reference_prepare_training_batch`, a straightforward per-sample Python version of the
seed's `_prepare_training_batch` (FastRL, seed 000: the same window, shift and packing,
written with per-token Python loops), on the same in-memory samples in the same run.
`pack` does not copy the features (the batch holds views of each sample's window; they are
concatenated when the batch is moved to its device), so the figure
speedup_with_device_copy_vs_reference also counts, on both sides, making the float32
input and target features the training step reads on its device (here the CPU).

rss_ratio_8g_vs_1g: peak RSS (VmHWM) of a fresh process that streams every batch of a
buffer over 8 GiB of shards through `pipeline.training.dataset` (plan from lengths, loads with a
prefetch thread, packs), over the same for 1 GiB. The shards are written once for the
run and deleted after it. `TINY`, the smoke run's sizes: one batch of each, 8 and 32 MiB streamed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HIDDEN = 4096
WINDOW = 512
BATCH = 16
SMALL_HIDDEN = 64  # the demo's target


@dataclass(frozen=True)
class Sizes:
    batches: int  # timed batches at H 4096 (twice as many at H 64), best of `repeats`
    repeats: int
    stream_bytes: tuple[int, int]  # the smaller and the larger buffer streamed
    step_bytes: int  # one RL step's shards in the streaming test


FULL = Sizes(batches=3, repeats=3, stream_bytes=(1 << 30, 8 << 30), step_bytes=512 << 20)
TINY = Sizes(batches=1, repeats=1, stream_bytes=(8 << 20, 32 << 20), step_bytes=8 << 20)


def _label(nbytes: int) -> str:
    return f"{nbytes >> 30}g" if nbytes >= 1 << 30 else f"{nbytes >> 20}m"


def reference_prepare_training_batch(
    samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], window_tokens: int
) -> dict[str, torch.Tensor]:
    """The reference: the seed's window / shift / concatenate, per sample and per token in Python."""
    ids, hidden_in, target, masks, positions, documents = [], [], [], [], [], []
    for doc, (input_ids, hidden, loss_mask) in enumerate(samples):
        full_len = len(input_ids)
        span = min(full_len, window_tokens)
        response = [t for t in range(full_len) if int(loss_mask[t]) == 1]
        if response:
            start = max(0, min(response[0], full_len - span))
            if response[-1] + 1 - start > span:  # keep the response END inside the window
                start = response[-1] + 1 - span
        else:
            start = full_len - span
        end = start + span
        if end - start < 2:
            continue
        for t in range(start, end - 1):  # shift inside the sample: f_t with x_{t+1}, predicting f_{t+1}
            ids.append(int(input_ids[t + 1]))
            hidden_in.append(hidden[t])
            target.append(hidden[t + 1])
            masks.append(float(loss_mask[t + 1]))
            positions.append(t - start)
            documents.append(doc)
    return {
        "input_ids": torch.tensor(ids).unsqueeze(0),
        "hidden_states": torch.stack(hidden_in).unsqueeze(0),
        "target": torch.stack(target).unsqueeze(0),
        "loss_mask": torch.tensor(masks).unsqueeze(0),
        "position_ids": torch.tensor(positions).unsqueeze(0),
        "document_ids": torch.tensor(documents).unsqueeze(0),
    }


def _batches(hidden_size: int, count: int, seed: int = 0) -> list[list[tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        batch = []
        for _ in range(BATCH):
            tokens = int(torch.randint(256, 2049, (1,), generator=gen))
            prompt = int(torch.randint(tokens // 4, 3 * tokens // 4, (1,), generator=gen))
            mask = (torch.arange(tokens) >= prompt).to(torch.int64)
            batch.append((torch.randint(0, 128_000, (tokens,), generator=gen),
                          torch.randn(tokens, hidden_size, generator=gen).to(torch.bfloat16), mask))
        batches.append(batch)
    return batches


def _tokens_per_s(fn, batches: list, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = 0
        for batch in batches:
            tokens += fn(batch)
        best = min(best, time.perf_counter() - start)
    return tokens / best


def _reference(batch: list, on_device: bool = False) -> int:
    out = reference_prepare_training_batch(batch, WINDOW)
    if on_device:  # what the training step then holds: float32 features on its device (the CPU here)
        _ = out["hidden_states"].float(), out["target"].float()
    return int(out["input_ids"].shape[1])


def _pack(batch: list, on_device: bool = False) -> int:
    from pipeline.training.window import pack

    packed = pack(batch, WINDOW)
    if on_device:
        packed = packed.to("cpu")
        _ = packed.hidden_states, packed.target
    return packed.num_tokens


def _check_same(batches: list) -> None:
    from pipeline.training.window import pack

    for batch in batches:
        want, got = reference_prepare_training_batch(batch, WINDOW), pack(batch, WINDOW)
        for name, value in want.items():
            if not torch.equal(getattr(got, name).to(value.dtype), value):
                raise AssertionError(f"pack and the reference disagree on {name}")


def speedups(sizes: Sizes) -> dict:
    out = {}
    for hidden_size, count in ((HIDDEN, sizes.batches), (SMALL_HIDDEN, 2 * sizes.batches)):
        batches = _batches(hidden_size, count)
        _check_same(batches[:1])
        repeats = sizes.repeats
        reference, ours = _tokens_per_s(_reference, batches, repeats), _tokens_per_s(_pack, batches, repeats)
        reference_on_device = _tokens_per_s(lambda b: _reference(b, on_device=True), batches, repeats)
        ours_on_device = _tokens_per_s(lambda b: _pack(b, on_device=True), batches, repeats)
        out[hidden_size] = {"reference_tokens_per_s": reference, "pack_tokens_per_s": ours,
                            "speedup": ours / reference,
                            "speedup_with_device_copy": ours_on_device / reference_on_device}
    return out


# -- peak RSS while streaming the buffer --------------------------------------------------------------------------


def write_buffer_shards(root: Path, nbytes: int, step_bytes: int) -> None:
    """Steps of ~`step_bytes` of bf16 hidden states until `nbytes` are stored (one sample pool, re-keyed per step)."""
    from dataclasses import replace

    from benchmarks.hidden_states_io import make_samples
    from pipeline.data import shards
    from pipeline.data.store import ObjectStore

    store = ObjectStore(root.as_uri())
    pool = make_samples(step_bytes, seed=3)
    step_bytes = sum(s.hidden.numel() * 2 for s in pool)
    for step in range(1, -(-nbytes // step_bytes) + 1):
        samples = [replace(s, sample_id=f"{step}-{s.sample_id}", step=step) for s in pool]
        shards.write_hidden_states(store, "bench", step, samples, hidden_size=HIDDEN, layer_ids=[0],
                                   target={"model_id": "bench"})


def stream_buffer(root: Path, nbytes: int) -> dict:
    """In a fresh process: stream every batch of the steps holding the first `nbytes`; peak RSS."""
    from pipeline.config import TrainConfig
    from pipeline.data import buffer, shards
    from pipeline.data.store import ObjectStore
    from pipeline.training.dataset import BufferDataset, iter_batches, plan_epoch

    store = ObjectStore(root.as_uri())
    manifests, size, step = [], 0, 1
    while size < nbytes and shards.has_manifest(store, "bench", step):
        manifests.append(shards.read_manifest(store, "bench", step))
        size += manifests[-1].hidden_bytes
        step += 1
    entries = buffer.select_buffer(manifests, step - 1, buffer_steps=step, max_samples=10**9)
    dataset = BufferDataset(store, "bench", entries, lambda s: (s.input_ids, s.hidden[:, -1, :], s.loss_mask))
    cfg = TrainConfig(batch_size_per_gpu=BATCH, window_tokens=WINDOW)
    baseline = _vm("VmRSS")
    tokens, batches, start = 0, 0, time.perf_counter()
    for batch in iter_batches(dataset, plan_epoch(dataset.lengths, cfg, 0), WINDOW):
        tokens += batch.num_tokens
        batches += 1
    return {"bytes": nbytes, "hidden_bytes": size, "samples": len(entries), "batches": batches, "tokens": tokens,
            "seconds": time.perf_counter() - start, "rss_before_bytes": baseline, "peak_rss_bytes": _vm("VmHWM")}


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss(sizes: Sizes) -> dict:
    base = Path(__file__).resolve().parent.parent / ".data" / "bench"
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="batch_prep-", dir=base))
    try:
        subprocess.run([sys.executable, "-m", "benchmarks.batch_prep", "write", str(root), str(max(sizes.stream_bytes)),
                        str(sizes.step_bytes)], check=True, capture_output=True, text=True)
        runs = {}
        for nbytes in sizes.stream_bytes:
            out = subprocess.run([sys.executable, "-m", "benchmarks.batch_prep", "stream", str(root), str(nbytes)],
                                 check=True, capture_output=True, text=True)
            runs[_label(nbytes)] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return runs


def run(tiny: bool = False) -> dict:
    sizes = TINY if tiny else FULL
    speed = speedups(sizes)
    streams = rss(sizes)
    small, large = (streams[_label(nbytes)] for nbytes in sizes.stream_bytes)
    return {
        "speedup_vs_reference": speed[HIDDEN]["speedup"],
        "speedup_vs_reference_h64": speed[SMALL_HIDDEN]["speedup"],
        "speedup_with_device_copy_vs_reference": speed[HIDDEN]["speedup_with_device_copy"],
        "rss_ratio_8g_vs_1g": large["peak_rss_bytes"] / small["peak_rss_bytes"],
        "speed": {str(k): v for k, v in speed.items()},
        "streams": streams,
        "window_tokens": WINDOW,
        "batch_size": BATCH,
    }


if __name__ == "__main__":
    # the children of `rss`: write ROOT BYTES STEP_BYTES, stream ROOT BYTES
    if sys.argv[1] == "write":
        write_buffer_shards(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.stdout.write(json.dumps(stream_buffer(Path(sys.argv[2]), int(sys.argv[3]))) + "\n")
