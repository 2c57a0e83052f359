"""Extraction through the stage launcher against the in-process path it replaces, on one simulated step.

* `warm_vs_in_process_ratio` (goal >= 0.9): tokens/s of the `hidden_states` Dagster step with
  `train.launcher: warm`, which hands the job to the extraction stage's warm worker
  (`pipeline.stage_server`: imports loaded, then the policy load, the forward and the shard writes,
  reported back over Pipes), over tokens/s of `extract.extract_hidden_states` called in the process,
  the function the worker runs (the same load, forward and writes). The worker's first job, which
  starts it, is `warm_cold_s`; the ratio is on its later jobs.
* `launched_vs_in_process_ratio`: the same with `train.launcher: subprocess`, a fresh process per step
  (`python -m pipeline.sources.worker`: process start, torch import, then the same work).
* `launch_overhead_s` and `warm_overhead_s`: a launched step's seconds minus the in-process call's:
  what a process per stage (or a job on a warm worker) costs per step, whatever the step's size;
  `break_even_step_s` and `warm_break_even_step_s` are the in-process extraction times from which
  the ratios reach 0.9 (9 x the overhead). `worker_stage_s` and `warm_worker_stage_s` are the
  extraction's own seconds inside the worker: the rest of a step is Dagster's step, the Pipes session
  and the worker's reading back of the committed shards (the `shards_valid` check), which the
  in-process call does not do.

All on the same step, same run, alternated, best of two each.

The step: the simulated source with a 4-layer, hidden-128 policy, 128 rollouts of 64 tokens (CPU, a
few minutes on two shared cores, most of it simulating the step). On a real step (a policy of
billions of parameters, thousands of rollouts) extraction takes minutes and the fixed overhead is
a small share of it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

STEP, KEY = 1, "step-000001"
SIMULATION = {"vocab_size": 64, "hidden_size": 128, "num_layers": 4, "num_heads": 4, "pretrain_iters": 5,
              "rl_iters": 1, "rollouts_per_step": 128, "prompt_len": 8, "response_len": 56, "step_period_s": 0.0}


def run() -> dict:
    import dagster as dg
    import yaml

    from assets.cotraining import hidden_states
    from pipeline.config import load_config
    from pipeline.data.store import open_store
    from pipeline.sources import extract
    from pipeline.sources.simulation import SimulatedRL
    from resources import pipeline_resource

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench-stage-launch-") as tmp:
        path = Path(tmp) / "pipeline.yaml"
        base = {"run": "bench", "data_dir": str(Path(tmp) / "data"), "simulation": SIMULATION,
                "capture": {"max_samples": 0}}
        path.write_text(yaml.safe_dump({**base, "train": {"launcher": "subprocess"}}))
        warm_path = Path(tmp) / "warm.yaml"
        warm_path.write_text(yaml.safe_dump({**base, "train": {"launcher": "warm", "warm_idle_s": 60.0}}))
        cfg = load_config(path)
        store = open_store(cfg)
        SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
        extract.extract_hidden_states(store, cfg, STEP)  # warm: the policy's local copy, the page cache

        in_process_s, launched_s, worker_s, warm_s, warm_worker_s = [], [], [], [], []
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("rl_step", [KEY])

            def step_seconds(config: Path) -> tuple[float, float]:
                """The `hidden_states` step's seconds and its worker's stage seconds."""
                result = dg.materialize([hidden_states], partition_key=KEY, instance=instance,
                                        resources={"pipeline": pipeline_resource(str(config))})
                (stats,) = instance.get_run_step_stats(result.run_id)
                metadata = result.asset_materializations_for_node("hidden_states")[0].metadata
                return stats.end_time - stats.start_time, metadata["stage_seconds"].value

            warm_cold_s = step_seconds(warm_path)[0]  # starts the worker
            for _ in range(2):  # alternated, best of two each: the machine's other load falls on all
                started = time.perf_counter()
                manifest = extract.extract_hidden_states(store, cfg, STEP)
                in_process_s.append(time.perf_counter() - started)
                seconds, stage_s = step_seconds(path)
                launched_s.append(seconds)
                worker_s.append(stage_s)
                seconds, stage_s = step_seconds(warm_path)
                warm_s.append(seconds)
                warm_worker_s.append(stage_s)
    tokens = manifest.num_tokens
    in_process, launched, warm = min(in_process_s), min(launched_s), min(warm_s)
    overhead = launched - in_process
    return {
        "tokens": tokens,
        "in_process_s": round(in_process, 3),
        "launched_s": round(launched, 3),
        "worker_stage_s": round(min(worker_s), 3),
        "in_process_tokens_per_s": round(tokens / in_process, 1),
        "launched_tokens_per_s": round(tokens / launched, 1),
        "launched_vs_in_process_ratio": round(in_process / launched, 3),
        "launch_overhead_s": round(overhead, 3),
        "warm_cold_s": round(warm_cold_s, 3),
        "warm_s": round(warm, 3),
        "warm_worker_stage_s": round(min(warm_worker_s), 3),
        "warm_tokens_per_s": round(tokens / warm, 1),
        "warm_vs_in_process_ratio": round(in_process / warm, 3),
        "warm_overhead_s": round(warm - in_process, 3),
        "break_even_step_s": round(9 * overhead, 1),
        "warm_break_even_step_s": round(9 * (warm - in_process), 1),
    }


if __name__ == "__main__":
    import sys

    sys.stdout.write(json.dumps(run(), indent=2) + "\n")
