"""`make bench`: every benchmark, one JSON file; its path is the last line printed.

    python -m benchmarks.run [--tiny] [--only NAME,...] [--out DIR]

Each section runs in turn; one that fails is recorded in the JSON (`failed`, and the section's `error`), named on
stderr, and the next runs. The JSON is rewritten after every section, so what was measured survives a section
that fails or a run that is stopped; the exit status is 1 when a section failed. `--tiny`: every section at its
smoke-run sizes (seconds to a minute each; tests/unit/test_benchmarks.py), the same code paths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import (
    batch_prep,
    demo_economics,
    evaluation,
    extraction,
    fp8_tau,
    hidden_states_io,
    policy_loss,
    real_model,
    scale,
    schedule,
    serving,
    stage_launch,
    target_load,
    training,
    vllm,
    vllm_capture,
)

OUT_DIR = Path(__file__).resolve().parent.parent / ".data" / "bench"


@dataclass(frozen=True)
class Section:
    """One benchmark of `make bench`: its entry point and the figures printed for it (docs/storage.md, Benchmarks,
    says what each measures): `figures` are numbers in every run, `optional` are None in some (no GPU; a ratio
    whose baseline is 0)."""

    name: str
    run: Callable[..., dict]  # run(tiny=False) -> the section's JSON
    figures: tuple[str, ...]
    optional: tuple[str, ...] = ()


_IO = ("write_vs_raw", "read_vs_raw", "read_vs_torch_save", "read_vs_safetensors", "compressed_size_ratio",
       "compressed_read_gbps_per_core", "random_read_ms")
_LAUNCH = ("launched_vs_in_process_ratio", "warm_vs_in_process_ratio", "warm_vs_in_process_step_ratio",
           "launch_overhead_s", "warm_overhead_s", "dagster_step_overhead_s", "warm_launcher_overhead_s")
_RAY_LAUNCH = ("ray_vs_in_process_ratio", "ray_overhead_s", "ray_vs_launched_ratio")  # None without ray[default]

SECTIONS = (
    Section("policy_loss", policy_loss.run, ("peak_mem_ratio", "time_ratio")),
    Section("hidden_states_io", hidden_states_io.run,
            (*_IO, "fp8_size_ratio", "write_vs_torch_save", "write_vs_safetensors")),
    Section("hidden_states_io_s3", hidden_states_io.run_s3, _IO),
    Section("batch_prep", batch_prep.run, ("speedup_vs_reference", "speedup_vs_reference_h64",
                                           "speedup_with_device_copy_vs_reference", "rss_ratio_8g_vs_1g")),
    Section("training", training.run, (
        "cpu_tokens_per_s", "ddp2_speedup", "fsdp2_vs_ddp2_tokens_ratio", "fsdp2_vs_ddp2_cpu_ratio",
        "fsdp2_vs_ddp2_rank_state_ratio", "fsdp2_layer_vs_ddp2_tokens_ratio", "fsdp2_layer_vs_ddp2_cpu_ratio",
        "fsdp2_layer_vs_ddp2_rank_state_ratio", "banded_vs_dense_ttt_ratio", "banded_vs_dense_ttt_cpu_ratio",
        "banded_vs_dense_ttt_loss_abs_diff", "checkpoint_lost_background_vs_sync_ratio"), ("gpu_mfu",)),
    Section("target_load", target_load.run, ("load_time_ratio", "load_and_first_forward_ratio")),
    Section("extraction", extraction.run, ("tokens_per_s_vs_plain_forward", "capture_tokens_per_s_vs_plain_forward",
                                           "storage_bound_vs_plain_forward", "peak_rss_ratio_4x_step")),
    Section("stage_launch", stage_launch.run, (*_LAUNCH, *(f"large_{name}" for name in _LAUNCH)),
            (*_RAY_LAUNCH, *(f"large_{name}" for name in _RAY_LAUNCH))),
    Section("evaluation", evaluation.run, ("per_token_cost_ratio_2048_vs_128", "batched_speedup",
                                           "tau_estimate_abs_diff", "peagle_eagle3_per_token_k4_ratio",
                                           "peagle_eagle3_per_token_k8_ratio",
                                           "estimate_per_token_cost_ratio_2048_vs_128",
                                           "estimate_peak_mem_ratio_2048_vs_128")),
    Section("scale", scale.run, ("bytes_vs_windows", "total_bytes_vs_windows",
                                 "extraction_peak_rss_ratio_vs_quarter_step", "training_wall_vs_budget_prediction",
                                 "training_cpu_vs_budget_prediction")),
    Section("fp8_tau", fp8_tau.run, ("fp8_tau_max_abs_diff", "fp8_tau_max_loss")),
    Section("schedule", schedule.run, ("training_s_ratio", "rollout_scale"), ("saved_s_ratio",)),
    Section("serving", serving.run, ("threshold", "probabilistic_over_greedy_tau_ratio",
                                     "batch_1_speculative_speedup", "batch_1_auto_speedup")),
    Section("demo_economics", demo_economics.run, ("drafter_cost_weights_ratio", "language_top1_mean_ratio",
                                                   "language_entropy_mean_ratio"),
            ("rollout_served_tail_speedup", "rollout_served_speedup")),
    Section("real_model", real_model.run, (), ("entropy_nats_mean", "top1_prob_mean", "oracle_greedy_tau_k4_t1")),
    Section("vllm", vllm.run, (), vllm.FIGURES),  # None without vLLM's environment, and at tiny sizes
    Section("vllm_capture", vllm_capture.run, (), vllm_capture.FIGURES),  # the same
)


def headline(section: Section, result: dict) -> dict:
    """The section's figures as printed: rounded, None where the result lacks one or it is not a number."""
    def shown(value: object) -> float | None:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return round(value, 3) if ok else None
    return {name: shown(result.get(name)) for name in (*section.figures, *section.optional)}


def error_of(exc: BaseException) -> str:
    """What failed: the exception, and for a benchmark's child process the end of what it wrote to stderr."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, subprocess.CalledProcessError) and exc.stderr:
        stderr = exc.stderr if isinstance(exc.stderr, str) else exc.stderr.decode(errors="replace")
        message += "\n" + "\n".join(stderr.strip().splitlines()[-20:])
    return message


def _write(path: Path, report: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(path)


def run_sections(sections: tuple[Section, ...], out_dir: Path, tiny: bool = False) -> tuple[Path, list[str]]:
    """Every section in turn, the JSON rewritten after each; the JSON's path and the sections that failed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}{'-tiny' if tiny else ''}.json"
    report: dict = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count()}, "tiny": tiny,
                    "failed": []}
    for section in sections:
        start = time.perf_counter()
        try:
            report[section.name] = section.run(tiny=tiny)
        except Exception as exc:  # noqa: BLE001 - recorded and reported; the other sections still run
            error = error_of(exc)
            report[section.name] = {"error": error, "traceback": traceback.format_exc()}
            report["failed"].append(section.name)
            sys.stdout.flush()  # stdout's lines before it, stderr's after them
            sys.stderr.write(f"{section.name}: FAILED: {error}\n")
        else:
            sys.stdout.write(f"{section.name}: {headline(section, report[section.name])}\n")
        report[section.name]["wall_s"] = round(time.perf_counter() - start, 2)
        _write(path, report)
    return path, report["failed"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="every section at its smoke-run sizes (seconds to a minute each)")
    parser.add_argument("--only", help="the sections to run, comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="the folder of the JSON (default: .data/bench)")
    args = parser.parse_args(argv)
    sections = SECTIONS
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {s.name for s in SECTIONS})
        if unknown:
            parser.error(f"no section {', '.join(unknown)}; the sections: {', '.join(s.name for s in SECTIONS)}")
        sections = tuple(s for s in SECTIONS if s.name in names)
    path, failed = run_sections(sections, args.out, args.tiny)
    if failed:
        sys.stdout.flush()
        sys.stderr.write(f"{len(failed)} of {len(sections)} sections failed: {', '.join(failed)} (errors in {path})\n")
    sys.stderr.flush()
    sys.stdout.write(f"{path}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
