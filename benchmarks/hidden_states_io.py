"""Hidden-state write and read throughput: our shards against the formats people use today.

Same data for every format: bf16 activations, H = 4096, one layer, 256-2048 tokens per
sample, >= 1 GiB locally (a smaller set over S3; `TINY`, the smoke run's: a few MiB). Baselines,
measured in the same run:

    raw          one flat file of the same bf16 bytes (the disk's limit): read with `readinto`
                 and through a memory map, the faster of the two counts
    torch_save   torch.save per sample (EAGLE / SpecForge offline data)
    safetensors  safetensors per request (vLLM's hidden-state connector layout)

"Read" means into torch tensors every byte of which has been read, as a training batch's would
be: each format its fastest way, either copied into memory the tensors own, or viewed in a memory
map and read once by an xxh3 pass (the pass our reader verifies its digests with). A lazy map
nobody has touched is not a read. The two baselines that map files (`safetensors.load_file`,
`torch.load(weights_only=True, mmap=True)`) are timed both ways, cloned and touched. Writes end
with fsync, like the object store's. The page cache cannot be dropped without root, so every
format is read back from the page cache right after it was written, the same way for all; each
figure is the best of `Sizes.repeats`.
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

HIDDEN = 4096
MIN_TOKENS, MAX_TOKENS = 256, 2048


@dataclass(frozen=True)
class Sizes:
    local_bytes: int
    s3_bytes: int
    repeats: int
    s3_repeats: int
    random_reads: int


FULL = Sizes(local_bytes=int(os.environ.get("BENCH_HS_BYTES", 1 << 30)), s3_bytes=32 << 20, repeats=3, s3_repeats=2,
             random_reads=24)
TINY = Sizes(local_bytes=16 << 20, s3_bytes=4 << 20, repeats=1, s3_repeats=1, random_reads=4)


def activations(tokens: int, gen: torch.Generator, channel_scale: torch.Tensor) -> torch.Tensor:
    """(T, 1, H) bf16 that look like a residual stream: per-channel scales, a few outlier channels."""
    values = torch.randn(tokens, HIDDEN, generator=gen).mul_(channel_scale)
    return values.to(torch.bfloat16).unsqueeze(1)


def make_samples(total_bytes: int, seed: int = 0) -> list:
    from pipeline.data.shard_format import HiddenSample

    gen = torch.Generator().manual_seed(seed)
    channel_scale = torch.empty(HIDDEN).log_normal_(0.0, 0.6, generator=gen)
    channel_scale[torch.randperm(HIDDEN, generator=gen)[:8]] *= 30.0  # massive-activation channels
    samples, size = [], 0
    while size < total_bytes:
        tokens = int(torch.randint(MIN_TOKENS, MAX_TOKENS + 1, (1,), generator=gen))
        ids = torch.randint(0, 128_000, (tokens,), generator=gen)
        mask = (torch.arange(tokens) >= tokens // 4).to(torch.int64)
        samples.append(HiddenSample(f"s{len(samples):05d}", 1, ids, mask, activations(tokens, gen, channel_scale)))
        size += tokens * HIDDEN * 2
    return samples


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
        del result
    return best


def _best_write(write: Callable[[int], object], cleanup: Callable[[int], None],
                repeats: int) -> tuple[float, object]:
    """Best time of `repeats` writes, each to a fresh place (overwriting would time a truncate or
    delete as well); earlier copies are removed untimed, the last one stays for reading."""
    best, result = float("inf"), None
    for rep in range(repeats):
        if rep:
            cleanup(rep - 1)
        start = time.perf_counter()
        result = write(rep)
        best = min(best, time.perf_counter() - start)
    return best, result


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _touch(tensors: Iterable[torch.Tensor]) -> None:
    """Read every byte of mapped tensors once, with the pass our reader's verification makes."""
    for t in tensors:
        xxhash.xxh3_64_intdigest(_bytes_of(t))


def _cloned_or_touched(mapped: dict[str, torch.Tensor], clone: bool) -> dict[str, torch.Tensor]:
    if clone:
        return {k: v.clone() for k, v in mapped.items()}
    _touch(mapped.values())
    return mapped


# -- baselines on a local disk ----------------------------------------------------------------------------------


def write_raw(samples: list, path: Path) -> None:
    with path.open("wb") as f:
        for s in samples:
            f.write(_bytes_of(s.hidden))
        f.flush()
        os.fsync(f.fileno())


def read_raw(samples: list, path: Path) -> list[torch.Tensor]:
    out = []
    with path.open("rb", buffering=0) as f:
        for s in samples:
            t = torch.empty(s.hidden.shape, dtype=torch.bfloat16)
            f.readinto(_bytes_of(t))
            out.append(t)
    return out


def read_raw_mapped(samples: list, path: Path) -> list[torch.Tensor]:
    """The raw file's second way in: copied out of a memory map (no syscall per read)."""
    out = []
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        data, pos = np.frombuffer(mapped, np.uint8), 0
        for s in samples:
            t = torch.empty(s.hidden.shape, dtype=torch.bfloat16)
            words = t.view(torch.uint8).numpy().reshape(-1)
            np.copyto(words, data[pos : pos + words.size])
            pos += words.size
            out.append(t)
        del data  # the map closes only once no array points into it
    return out


def read_raw_viewed(samples: list, path: Path) -> list[torch.Tensor]:
    """The third: viewed in a copy-on-write map, every byte touched once (as our reader does)."""
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out, pos = [], 0
    for s in samples:
        t = torch.frombuffer(mapped, dtype=torch.bfloat16, count=s.hidden.numel(), offset=pos)
        _touch([t])
        out.append(t.view(s.hidden.shape))
        pos += s.hidden.numel() * 2
    return out


def write_torch_save(samples: list, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for s in samples:
        with (directory / f"{s.sample_id}.pt").open("wb") as f:
            torch.save({"input_ids": s.input_ids, "loss_mask": s.loss_mask, "hidden_state": s.hidden}, f)
            f.flush()
            os.fsync(f.fileno())


def read_torch_save(samples: list, directory: Path, clone: bool) -> list[dict]:
    out = []
    for s in samples:
        data = torch.load(directory / f"{s.sample_id}.pt", weights_only=True, mmap=True)
        out.append(_cloned_or_touched(data, clone))
    return out


def write_safetensors(samples: list, directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for s in samples:
        path = directory / f"{s.sample_id}.safetensors"
        save_file({"hidden_states": s.hidden.contiguous(), "token_ids": s.input_ids}, path)
        _fsync(path)


def read_safetensors(samples: list, directory: Path, clone: bool) -> list[dict]:
    from safetensors.torch import load_file

    return [_cloned_or_touched(load_file(directory / f"{s.sample_id}.safetensors"), clone) for s in samples]


# -- ours -------------------------------------------------------------------------------------------------------


def write_shards(store, samples: list, step: int, compression: str):
    from pipeline.data import shards

    return shards.write_hidden_states(store, "bench", step, samples, hidden_size=HIDDEN, layer_ids=[0],
                                      target={"model_id": "bench"}, compression=compression)


def read_shards(store, manifest) -> list:
    from pipeline.data import shards

    out = []
    for shard in manifest.shards:
        rows = [e.row for e in manifest.samples if e.shard == shard.name]
        out += shards.read_rows(store, "bench", manifest, shard.name, rows)
    return out


def random_read_ms(store, manifest, reads: int) -> float:
    from pipeline.data import shards

    gen = torch.Generator().manual_seed(1)
    picks = torch.randint(0, manifest.num_samples, (reads,), generator=gen).tolist()
    times = []
    for i in picks:
        start = time.perf_counter()
        shards.read_sample(store, "bench", manifest, manifest.samples[i].sample_id)
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def _compressed_read(store, manifest, repeats: int) -> tuple[float, float]:
    """Best (wall s, CPU s of all threads) reading the compressed step."""
    best_wall, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = read_shards(store, manifest)
        best_wall, best_cpu = min(best_wall, time.perf_counter() - wall), min(best_cpu, time.process_time() - cpu)
        del result
    return best_wall, best_cpu


def _assert_same(samples: list, read: list) -> None:
    for want, got in zip(samples, read, strict=True):
        if not torch.equal(want.hidden.view(torch.int16), got.hidden.view(torch.int16)):
            raise AssertionError(f"sample {want.sample_id} did not round-trip bit-exactly")


def measure_local(directory: Path, sizes: Sizes) -> dict:
    from pipeline.data.keys import hidden_states_prefix
    from pipeline.data.store import ObjectStore

    samples = make_samples(sizes.local_bytes)
    repeats = sizes.repeats
    payload = sum(s.hidden.numel() * 2 for s in samples)
    store = ObjectStore((directory / "store").as_uri())

    def drop_step(step: int) -> None:
        store.delete_prefix(hidden_states_prefix("bench", step))

    # Format by format: written, read back, then deleted, so that every format is read from the
    # page cache and none is evicted by the formats written after it.
    last = repeats - 1
    seconds: dict[str, float] = {}
    seconds["raw_write"], _ = _best_write(lambda r: write_raw(samples, directory / f"raw{r}.bin"),
                                          lambda r: (directory / f"raw{r}.bin").unlink(), repeats)
    seconds["raw_read_syscall"] = _best(lambda: read_raw(samples, directory / f"raw{last}.bin"), repeats)
    seconds["raw_read_mapped"] = _best(lambda: read_raw_mapped(samples, directory / f"raw{last}.bin"), repeats)
    seconds["raw_read_viewed"] = _best(lambda: read_raw_viewed(samples, directory / f"raw{last}.bin"), repeats)
    seconds["raw_read"] = min(seconds["raw_read_syscall"], seconds["raw_read_mapped"], seconds["raw_read_viewed"])
    (directory / f"raw{last}.bin").unlink()

    seconds["torch_save_write"], _ = _best_write(lambda r: write_torch_save(samples, directory / f"pt{r}"),
                                                 lambda r: shutil.rmtree(directory / f"pt{r}"), repeats)
    seconds["torch_save_read_cloned"] = _best(lambda: read_torch_save(samples, directory / f"pt{last}", True), repeats)
    seconds["torch_save_read_viewed"] = _best(lambda: read_torch_save(samples, directory / f"pt{last}", False), repeats)
    seconds["torch_save_read"] = min(seconds["torch_save_read_cloned"], seconds["torch_save_read_viewed"])
    shutil.rmtree(directory / f"pt{last}")

    seconds["safetensors_write"], _ = _best_write(lambda r: write_safetensors(samples, directory / f"st{r}"),
                                                  lambda r: shutil.rmtree(directory / f"st{r}"), repeats)
    st_last = directory / f"st{last}"
    seconds["safetensors_read_cloned"] = _best(lambda: read_safetensors(samples, st_last, True), repeats)
    seconds["safetensors_read_viewed"] = _best(lambda: read_safetensors(samples, st_last, False), repeats)
    seconds["safetensors_read"] = min(seconds["safetensors_read_cloned"], seconds["safetensors_read_viewed"])
    shutil.rmtree(directory / f"st{last}")

    seconds["shards_write"], manifest = _best_write(lambda r: write_shards(store, samples, 10 + r, "none"),
                                                    lambda r: drop_step(10 + r), repeats)
    _assert_same(samples, read_shards(store, manifest))
    seconds["shards_read"] = _best(lambda: read_shards(store, manifest), repeats)
    random_ms = random_read_ms(store, manifest, sizes.random_reads)
    # Once: compression is for object storage, where the upload, not this, sets the pace.
    seconds["split_zstd_write"], packed = _best_write(lambda r: write_shards(store, samples, 20 + r, "split-zstd"),
                                                      lambda r: drop_step(20 + r), repeats=1)
    _assert_same(samples, read_shards(store, packed))
    wall, cpu = _compressed_read(store, packed, repeats)
    seconds["split_zstd_read"] = wall
    seconds["fp8_write"], lossy = _best_write(lambda r: write_shards(store, samples, 30 + r, "fp8-e4m3"),
                                              lambda r: drop_step(30 + r), repeats=1)
    seconds["fp8_read"] = _best(lambda: read_shards(store, lossy), repeats)
    return _figures(seconds, payload, manifest, packed, cpu, random_ms) | {
        "fp8_size_ratio": manifest.total_bytes / lossy.total_bytes,  # lossy: not a goal, see the demo's tau
        "write_vs_torch_save": seconds["torch_save_write"] / seconds["shards_write"],
        "write_vs_safetensors": seconds["safetensors_write"] / seconds["shards_write"],
        "page_cache": "reads come from the page cache (written just before, same for every format)",
    }


def _figures(seconds: dict, payload: int, manifest, packed, compressed_cpu_s: float, random_ms: float) -> dict:
    return {
        "write_vs_raw": seconds["raw_write"] / seconds["shards_write"],
        "read_vs_raw": seconds["raw_read"] / seconds["shards_read"],
        "read_vs_torch_save": seconds["torch_save_read"] / seconds["shards_read"],
        "read_vs_safetensors": seconds["safetensors_read"] / seconds["shards_read"],
        "compressed_size_ratio": manifest.total_bytes / packed.total_bytes,
        "compressed_read_gbps_per_core": payload / compressed_cpu_s / 1e9,
        "random_read_ms": random_ms,
        "gbps": {k: payload / v / 1e9 for k, v in seconds.items()},
        "payload_bytes": payload,
        "samples": len(manifest.samples),
        "shard_bytes": {"none": manifest.total_bytes, "split-zstd": packed.total_bytes},
    }


# -- over S3 (moto's server on loopback) ------------------------------------------------------------------------

BUCKET = "bench-bucket"


def write_raw_s3(fs, samples: list, key: str) -> None:
    fs.pipe_file(f"{BUCKET}/{key}", b"".join(_bytes_of(s.hidden) for s in samples))


def read_raw_s3(fs, samples: list, key: str) -> list[torch.Tensor]:
    data = bytearray(fs.cat_file(f"{BUCKET}/{key}"))
    out, pos = [], 0
    for s in samples:
        t = torch.empty(s.hidden.shape, dtype=torch.bfloat16)
        view = _bytes_of(t)
        view[:] = data[pos : pos + view.nbytes]
        pos += view.nbytes
        out.append(t)
    return out


def write_torch_save_s3(fs, samples: list, prefix: str) -> None:
    for s in samples:
        buf = io.BytesIO()
        torch.save({"input_ids": s.input_ids, "loss_mask": s.loss_mask, "hidden_state": s.hidden}, buf)
        fs.pipe_file(f"{BUCKET}/{prefix}/{s.sample_id}.pt", buf.getvalue())


def read_torch_save_s3(fs, samples: list, prefix: str) -> list:
    blobs = [io.BytesIO(fs.cat_file(f"{BUCKET}/{prefix}/{s.sample_id}.pt")) for s in samples]
    return [torch.load(blob, weights_only=True) for blob in blobs]


def write_safetensors_s3(fs, samples: list, prefix: str) -> None:
    from safetensors.torch import save

    for s in samples:
        data = save({"hidden_states": s.hidden.contiguous(), "token_ids": s.input_ids})
        fs.pipe_file(f"{BUCKET}/{prefix}/{s.sample_id}.safetensors", data)


def read_safetensors_s3(fs, samples: list, prefix: str) -> list:
    from safetensors.torch import load

    return [load(fs.cat_file(f"{BUCKET}/{prefix}/{s.sample_id}.safetensors")) for s in samples]


@contextlib.contextmanager
def _moto_s3() -> Iterator[str]:
    """moto's S3 server on a free loopback port, for as long as the block runs: its endpoint."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def measure_s3(sizes: Sizes) -> dict:
    import s3fs

    from pipeline.data.store import ObjectStore, storage_options_for

    samples = make_samples(sizes.s3_bytes, seed=2)
    repeats = sizes.s3_repeats
    payload = sum(s.hidden.numel() * 2 for s in samples)
    with _moto_s3() as endpoint:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, use_listings_cache=False)
        fs.mkdir(BUCKET)
        store = ObjectStore(f"s3://{BUCKET}/store", storage_options_for(f"s3://{BUCKET}/store", endpoint))

        def drop(key: str, base: int = 0) -> Callable[[int], None]:
            return lambda rep: fs.rm(f"{BUCKET}/{key.format(rep=base + rep)}", recursive=True)

        last = repeats - 1
        seconds: dict[str, float] = {}
        seconds["raw_write"], _ = _best_write(lambda r: write_raw_s3(fs, samples, f"raw{r}.bin"),
                                              drop("raw{rep}.bin"), repeats)
        seconds["shards_write"], manifest = _best_write(lambda r: write_shards(store, samples, 10 + r, "none"),
                                                        drop("store/hidden_states/bench/step-{rep:06d}", 10),
                                                        repeats)
        seconds["torch_save_write"], _ = _best_write(lambda r: write_torch_save_s3(fs, samples, f"pt{r}"),
                                                     drop("pt{rep}"), repeats)
        seconds["safetensors_write"], _ = _best_write(lambda r: write_safetensors_s3(fs, samples, f"st{r}"),
                                                      drop("st{rep}"), repeats)
        _assert_same(samples, read_shards(store, manifest))
        seconds |= {
            "raw_read": _best(lambda: read_raw_s3(fs, samples, f"raw{last}.bin"), repeats),
            "shards_read": _best(lambda: read_shards(store, manifest), repeats),
            "torch_save_read": _best(lambda: read_torch_save_s3(fs, samples, f"pt{last}"), repeats),
            "safetensors_read": _best(lambda: read_safetensors_s3(fs, samples, f"st{last}"), repeats),
        }
        random_ms = random_read_ms(store, manifest, sizes.random_reads)
        packed = write_shards(store, samples, 20, "split-zstd")
        _assert_same(samples, read_shards(store, packed))
        wall, cpu = _compressed_read(store, packed, repeats)
        seconds["split_zstd_read"] = wall
    return _figures(seconds, payload, manifest, packed, cpu, random_ms) | {
        "server": "moto ThreadedMotoServer on 127.0.0.1 (Python; the server is the bottleneck)",
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _in_subprocess(where: str, tiny: bool) -> dict:
    env = dict(os.environ)
    if where == "s3":  # moto accepts any credentials; real ones are never sent to it
        env |= {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.hidden_states_io", where, *(["--tiny"] if tiny else [])],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(tiny: bool = False) -> dict:
    return _in_subprocess("local", tiny)


def run_s3(tiny: bool = False) -> dict:
    return _in_subprocess("s3", tiny)


def main(where: str, sizes: Sizes) -> dict:
    if where == "s3":
        return measure_s3(sizes)
    base = Path(__file__).resolve().parent.parent / ".data" / "bench"
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="hidden_states_io-", dir=base))
    try:
        return measure_local(directory, sizes)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    # python -m benchmarks.hidden_states_io local|s3 [--tiny]
    sys.stdout.write(json.dumps(main(sys.argv[1], TINY if "--tiny" in sys.argv else FULL)) + "\n")
