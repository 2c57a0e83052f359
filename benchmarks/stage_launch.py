"""Extraction through the stage launcher against the in-process path it replaces, at two step sizes.

The steps: step 1, the simulated source's (a 4-layer, hidden-128 policy, 128 rollouts of up to 64
tokens: 3.5k tokens stored, under a second of extraction, where a step's fixed cost is most of it), and step 2,
384 rollouts of 8 + 248 tokens cut from step 1's prompts and responses under step 1's policy (89k tokens
stored, about 5 s of extraction on 2 cores: nearer the share the fixed cost has of a real step, whose
extraction takes minutes). For each:

* `warm_vs_in_process_ratio` (goal >= 0.9): tokens/s of the `hidden_states` Dagster step with
  `launch.launcher: warm`, which hands the job to the extraction stage's warm worker
  (`pipeline.launch.warm`: imports loaded, then the policy load, the forward and the shard writes,
  the committed shards read back and checked, reported over Pipes), over tokens/s of
  `extract.extract_hidden_states` called in the process, the function the worker runs (the same load,
  forward and writes). The worker's first job, which starts it, is `warm_cold_s`; the ratio is on its
  later jobs.
* `launched_vs_in_process_ratio`: the same with `launch.launcher: subprocess`, a fresh process per step
  (`python -m pipeline.sources.worker`: process start, torch import, then the same work).
* `in_process_step_s`: the path the launcher replaced, a `hidden_states` step that does the worker's work
  in the Dagster run process (extraction, placement record, `shards_valid` read-back check, the same
  metadata and check result): `dagster_step_overhead_s` is its seconds minus the bare call's, what any
  step costs (Dagster's events and the check), and `warm_vs_in_process_step_ratio` and
  `warm_launcher_overhead_s` compare the warm step with it: what the launcher itself adds (the Pipes
  session and hand-off), with the extraction's speed in another process than this one, which on busy
  cores varies by several percent either way (`warm_worker_stage_s` against `in_process_s`).
* `ray_vs_in_process_ratio`, `ray_overhead_s`: the same with `launch.launcher: ray`, the stage a Ray job on a
  one-node Ray cluster on loopback (`ops.ray_cluster`, started once for the run): the job's submission, Ray's
  job supervisor actor, the same fresh process, its log tailed for the Pipes messages. `ray_vs_launched_ratio`:
  the subprocess step's seconds over the Ray job's. None when Ray (ray[default]) is not installed.
* `launch_overhead_s` and `warm_overhead_s`: a launched step's seconds minus the in-process call's:
  what a process per stage (or a job on a warm worker) costs per step, whatever the step's size;
  `break_even_step_s` and `warm_break_even_step_s` are the in-process extraction times from which
  the ratios reach 0.9 (9 x the overhead). `worker_stage_s` and `warm_worker_stage_s` are the
  extraction's own seconds inside the worker.

Step 1's figures have these names, step 2's the same with `large_` before them. All on the same steps in
the same run, alternated (3 rounds of step 1, 2 of step 2), best of the rounds each; `load_average` is the
machine's 1-minute load before and after, the other work it ran meanwhile. Every process runs
`OMP_NUM_THREADS` torch threads (1 unless set): the workers inherit it, and this process sets its own to
match, so the ratios compare where the work runs, not how many cores it may use. `TINY`, the smoke run's: steps of
16 and 24 short rollouts, one round each, the Ray job on step 1 only (`large_ray_*` None).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ops.ray_cluster import RayCluster

STEP, KEY = 1, "step-000001"
LARGE_STEP, LARGE_KEY = 2, "step-000002"
SIMULATION = {"vocab_size": 64, "hidden_size": 128, "num_layers": 4, "num_heads": 4, "pretrain_iters": 5,
              "rl_iters": 1, "prompt_len": 8, "step_period_s": 0.0}


@dataclass(frozen=True)
class Sizes:
    rollouts: int  # step 1's, the simulated source's
    response_len: int
    large_rollouts: int  # step 2's, cut from step 1's
    large_response_len: int
    rounds: int
    large_rounds: int
    large_ray: bool  # the large step as a Ray job too (the smoke run times the small step's alone)


FULL = Sizes(rollouts=128, response_len=56, large_rollouts=384, large_response_len=248, rounds=3, large_rounds=2,
             large_ray=True)
TINY = Sizes(rollouts=16, response_len=16, large_rollouts=24, large_response_len=32, rounds=1, large_rounds=1,
             large_ray=False)


def _write_large_step(store, run: str, sizes: Sizes) -> None:
    """Step 2: `sizes.large_rollouts` rollouts, each a step-1 prompt and `large_response_len` tokens of step 1's
    responses run together, under step 1's policy: a larger step without simulating it."""
    from pipeline.data import rollouts as rollouts_lib
    from pipeline.data.rollouts import Rollout

    base = rollouts_lib.read_rollouts(store, run, STEP)
    pointer = rollouts_lib.read_policy_pointer(store, run, STEP)
    stream = [t for r in base for t in r.input_ids[r.prompt_len:]]
    rollouts = []
    for i in range(sizes.large_rollouts):
        source = base[i % len(base)]
        start = i * sizes.large_response_len // 3
        response = [stream[(start + j) % len(stream)] for j in range(sizes.large_response_len)]
        rollouts.append(Rollout.from_prompt_and_response(
            f"large-{i:04d}", source.input_ids[:source.prompt_len], response, source.reward, source.policy_version))
    rollouts_lib.write_rollouts(store, run, LARGE_STEP, rollouts, pointer)


def _in_process_asset():
    """The `hidden_states` asset as it was before the launcher: the worker's rank-0 work (extraction, placement
    record, the read-back check, the metadata) in the Dagster run process, the same check reported."""
    import dagster as dg

    from assets.partitions import rl_step, step_of
    from pipeline.ranks import SINGLE
    from pipeline.sources import worker
    from pipeline.stages import EXTRACTION

    @dg.asset(name="hidden_states", partitions_def=rl_step, deps=[dg.AssetKey("rollouts")], pool="gpu",
              required_resource_keys={"pipeline"},
              check_specs=[dg.AssetCheckSpec("shards_valid", asset="hidden_states", blocking=True)])
    def hidden_states(context):  # annotations would be strings naming this function's imports
        job = context.resources.pipeline.launcher().stage_job(EXTRACTION, step_of(context))
        manifest, where = worker.run_extraction(job, SINGLE)
        report = worker.report_extraction(job, manifest, where)
        return dg.MaterializeResult(
            metadata=report.metadata,  # Dagster infers each value's type, as from Pipes
            check_results=[dg.AssetCheckResult(check_name="shards_valid", passed=not report.problems,
                                               severity=dg.AssetCheckSeverity.ERROR,
                                               metadata=report.check_metadata())])

    return hidden_states


def _ray_figures(call: float, launched: float, ray: float | None, ray_worker: float | None) -> dict:
    if ray is None or ray_worker is None:
        return {"ray_s": None, "ray_worker_stage_s": None, "ray_vs_in_process_ratio": None, "ray_overhead_s": None,
                "ray_vs_launched_ratio": None}
    return {"ray_s": round(ray, 3), "ray_worker_stage_s": round(ray_worker, 3),
            "ray_vs_in_process_ratio": round(call / ray, 3), "ray_overhead_s": round(ray - call, 3),
            "ray_vs_launched_ratio": round(launched / ray, 3)}


def _figures(tokens: int, call: float, step: float, launched: float, warm: float, worker: float,
             warm_worker: float) -> dict:
    overhead, warm_overhead = launched - call, warm - call
    return {
        "tokens": tokens,
        "in_process_s": round(call, 3),
        "launched_s": round(launched, 3),
        "worker_stage_s": round(worker, 3),
        "in_process_tokens_per_s": round(tokens / call, 1),
        "launched_tokens_per_s": round(tokens / launched, 1),
        "launched_vs_in_process_ratio": round(call / launched, 3),
        "launch_overhead_s": round(overhead, 3),
        "warm_s": round(warm, 3),
        "warm_worker_stage_s": round(warm_worker, 3),
        "warm_tokens_per_s": round(tokens / warm, 1),
        "warm_vs_in_process_ratio": round(call / warm, 3),
        "warm_overhead_s": round(warm_overhead, 3),
        "break_even_step_s": round(9 * overhead, 1),
        "warm_break_even_step_s": round(9 * warm_overhead, 1),
        "in_process_step_s": round(step, 3),
        "dagster_step_overhead_s": round(step - call, 3),
        "warm_vs_in_process_step_ratio": round(step / warm, 3),
        "warm_launcher_overhead_s": round(warm - step, 3),
    }


def run(tiny: bool = False) -> dict:
    import torch

    # one thread on both sides: the workers inherit OMP_NUM_THREADS, this process has imported torch already
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        return _measure(TINY if tiny else FULL)
    finally:
        torch.set_num_threads(threads)


def _ray_cluster() -> AbstractContextManager[RayCluster | None]:
    """A one-node Ray cluster on loopback for the `ray` launcher's figures, or None without Ray."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("dagster_ray") is None:
        return nullcontext()
    from ops.ray_cluster import ray_cluster

    return ray_cluster(head_cpus=2)


def _measure(sizes: Sizes) -> dict:
    with _ray_cluster() as cluster:
        return _measure_on(sizes, cluster)


def _measure_on(sizes: Sizes, cluster: RayCluster | None) -> dict:
    import dagster as dg
    import yaml

    from assets.cotraining import hidden_states
    from pipeline.config import load_config
    from pipeline.data.store import open_store
    from pipeline.sources import extract
    from pipeline.sources.simulation import SimulatedRL
    from resources import pipeline_resource

    load_before = os.getloadavg()[0]
    in_process_asset = _in_process_asset()
    with tempfile.TemporaryDirectory(prefix="bench-stage-launch-") as tmp:
        path = Path(tmp) / "pipeline.yaml"
        simulation = {**SIMULATION, "rollouts_per_step": sizes.rollouts, "response_len": sizes.response_len}
        base = {"run": "bench", "data_dir": str(Path(tmp) / "data"), "simulation": simulation,
                "capture": {"max_samples": 0}}
        path.write_text(yaml.safe_dump({**base, "launch": {"launcher": "subprocess"}}))
        warm_path = Path(tmp) / "warm.yaml"
        warm_path.write_text(yaml.safe_dump({**base, "launch": {"launcher": "warm", "warm_idle_s": 60.0}}))
        ray_path = Path(tmp) / "ray.yaml"  # what the loopback node has, not a GPU node's 8 CPUs and 64 GiB
        ray_path.write_text(yaml.safe_dump({**base, "launch": {
            "launcher": "ray", "ray": {"address": cluster.address if cluster else "",
                                       "token_file": str(cluster.token_file) if cluster else ""},
            "extraction": {"cpu": "1", "memory": "1Gi"}}}))
        cfg = load_config(path)
        store = open_store(cfg)
        SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(STEP)
        _write_large_step(store, cfg.run, sizes)
        extract.extract_hidden_states(store, cfg, STEP)  # warm: the policy's local copy, the page cache

        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("rl_step", [KEY, LARGE_KEY])

            def step_seconds(asset, config: Path, key: str) -> tuple[float, float]:
                """The `hidden_states` step's seconds and its stage seconds."""
                result = dg.materialize([asset], partition_key=key, instance=instance,
                                        resources={"pipeline": pipeline_resource(str(config))})
                (stats,) = instance.get_run_step_stats(result.run_id)
                metadata = result.asset_materializations_for_node("hidden_states")[0].metadata
                return stats.end_time - stats.start_time, metadata["stage_seconds"].value

            def measure(step: int, key: str, rounds: int, ray: bool) -> dict:
                seconds: dict[str, list[float]] = {k: [] for k in ("call", "step", "launched", "worker", "warm",
                                                                   "warm_worker", "ray", "ray_worker")}
                for _ in range(rounds):  # alternated, best of the rounds each: the machine's other load falls on all
                    started = time.perf_counter()
                    manifest = extract.extract_hidden_states(store, cfg, step)
                    seconds["call"].append(time.perf_counter() - started)
                    seconds["step"].append(step_seconds(in_process_asset, path, key)[0])
                    launched, worker = step_seconds(hidden_states, path, key)
                    seconds["launched"].append(launched)
                    seconds["worker"].append(worker)
                    warm, warm_worker = step_seconds(hidden_states, warm_path, key)
                    seconds["warm"].append(warm)
                    seconds["warm_worker"].append(warm_worker)
                    if cluster and ray:
                        ray_s, ray_worker = step_seconds(hidden_states, ray_path, key)
                        seconds["ray"].append(ray_s)
                        seconds["ray_worker"].append(ray_worker)
                best = {k: min(v) if v else None for k, v in seconds.items()}
                return {**_figures(manifest.num_tokens, best["call"], best["step"], best["launched"], best["warm"],
                                   best["worker"], best["warm_worker"]),
                        **_ray_figures(best["call"], best["launched"], best["ray"], best["ray_worker"])}

            warm_cold_s = step_seconds(hidden_states, warm_path, KEY)[0]  # starts the worker
            small = measure(STEP, KEY, sizes.rounds, ray=True)
            extract.extract_hidden_states(store, cfg, LARGE_STEP)  # the page cache, as for step 1
            large = measure(LARGE_STEP, LARGE_KEY, sizes.large_rounds, ray=sizes.large_ray)
    return {**small, "warm_cold_s": round(warm_cold_s, 3), **{f"large_{k}": v for k, v in large.items()},
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


if __name__ == "__main__":
    import sys

    sys.stdout.write(json.dumps(run(tiny="--tiny" in sys.argv), indent=2) + "\n")
