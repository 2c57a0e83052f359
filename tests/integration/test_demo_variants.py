"""The demo's documented variants as a newcomer runs them (`cli.py` in a subprocess), at the tests' tiny sizes:
`SOURCE=trl` with `DRAFTER=peagle` (TRL's GRPO publishing in parts, the refresh deploying while a step is still
open, a P-EAGLE drafter through every stage) and `compare-schedules` (one demo process per schedule, then side by
side). `make demo` itself is tests/integration/test_e2e.py; `MODEL=smollm2` is tests/integration/test_smollm2_demo.py.
`STEPS=N` changes only the count: three steps already evict from the two-step buffer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.data.store import open_store
from pipeline.data.training_record import read_training
from pipeline.registry import DrafterRegistry
from tests.support.config import write_config

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "DRAFTER_PIPELINE_CONFIG")}
    return subprocess.run([sys.executable, "cli.py", "--config", str(config), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)


def test_the_trl_source_with_a_peagle_drafter_and_the_refresh(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"refresh": {"enabled": True}})
    cfg = load_config(config)
    proc = _cli(config, "demo", "--source", "trl", "--drafter", "peagle", "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads((cfg.data_path / "demo" / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == [1, 2]
    assert all(s["trl_mean_reward"] is not None for s in summary["steps"])
    store = open_store(cfg)
    assert read_training(store, cfg.run, 2).trained
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    versions = registry.client.search_model_versions(f"name='{registry.model_name}'")
    assert versions
    assert {v.tags["drafter_kind"] for v in versions} == {"peagle"}
    # Every replica runs one of them: the champion, or a refresh of an open step that the champion waits behind
    # (which, depends on when TRL's parts arrive; a refresh that went live first is the incumbent a step's
    # drafter must beat to be promoted at all).
    served = {r["version"] for r in summary["fleet"]}
    assert len(served) == 1
    assert served <= {str(v.version) for v in versions}


def test_compare_schedules_runs_each_schedule_and_sets_them_side_by_side(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    proc = _cli(config, "compare-schedules", "--steps", "1", "--schedules", "interval", "cost", "--no-fleet")
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary_path = Path(proc.stdout.strip().splitlines()[-1].split()[-1])
    figures = json.loads(summary_path.read_text())
    assert set(figures["runs"]) == {"interval", "cost"}
    assert all([r["step"] for r in rows] == [1] for rows in figures["runs"].values())
    assert (summary_path.parent / "schedules.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "cost / interval: training seconds" in proc.stdout
