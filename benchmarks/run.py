"""`make bench`: every benchmark, one JSON file; its path is the last line printed."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks import (
    batch_prep,
    evaluation,
    extraction,
    fp8_tau,
    hidden_states_io,
    policy_loss,
    real_model,
    scale,
    schedule,
    stage_launch,
    target_load,
    training,
)

BENCHMARKS = {
    "policy_loss": policy_loss.run,
    "hidden_states_io": hidden_states_io.run,
    "hidden_states_io_s3": hidden_states_io.run_s3,
    "batch_prep": batch_prep.run,
    "training": training.run,
    "target_load": target_load.run,
    "extraction": extraction.run,
    "stage_launch": stage_launch.run,
    "evaluation": evaluation.run,
    "scale": scale.run,
    "fp8_tau": fp8_tau.run,
    "schedule": schedule.run,
    "real_model": real_model.run,
}


def main() -> None:
    out_dir = Path(__file__).resolve().parent.parent / ".data" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}
    for name, bench in BENCHMARKS.items():
        start = time.perf_counter()
        report[name] = bench()
        report[name]["wall_s"] = round(time.perf_counter() - start, 2)
        figures = {k: round(v, 3) for k, v in report[name].items()
                   if k.endswith(("ratio", "_vs_raw", "_vs_torch_save", "_vs_safetensors", "_per_core", "_ms", "_vs_1g",
                                  "reference", "_h64", "_vs_plain_forward", "_4x_step", "_vs_128", "_speedup",
                                  "_abs_diff", "_vs_windows", "_vs_quarter_step", "_prediction", "_overhead_s"))}
        sys.stdout.write(f"{name}: {figures}\n")
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    sys.stdout.write(f"{path}\n")


if __name__ == "__main__":
    main()
