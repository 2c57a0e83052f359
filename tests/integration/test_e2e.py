"""The demo as a newcomer runs it: a subprocess, a persisted Dagster instance, MLflow, outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from pipeline.config import load_config
from pipeline.data import shards
from pipeline.data.fleet_state import read_fleet_policy
from pipeline.data.rollouts import read_rollouts
from pipeline.data.store import open_store
from pipeline.data.training_record import read_training
from pipeline.registry import DrafterRegistry
from tests.support.config import write_config

ROOT = Path(__file__).resolve().parents[2]


def _demo(config: Path, steps: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "DRAFTER_PIPELINE_CONFIG")}
    return subprocess.run(
        [sys.executable, "cli.py", "--config", str(config), "demo", "--steps", str(steps)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )


@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path) -> None:
    # the first demo pre-trains the target itself; two replicas, as the demo's fleet
    tiny_config_path = write_config(tmp_path, pretrained=False, replicas=2)
    cfg = load_config(tiny_config_path)
    proc = _demo(tiny_config_path, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary_path = cfg.data_path / "demo" / "summary.json"
    plot_path = cfg.data_path / "demo" / "acceptance.png"
    assert str(summary_path) in proc.stdout
    assert str(plot_path) in proc.stdout
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(summary_path.read_text())
    assert summary["wall_s"] > 0
    assert [s["step"] for s in summary["steps"]] == [1, 2, 3]
    ceiling = cfg.eval.num_speculative_tokens + 1
    for row in summary["steps"]:
        assert row["samples"] == cfg.simulation.rollouts_per_step
        for key in ("tau_cotrained", "tau_baseline", "tau_served"):
            assert 1.0 <= row[key] <= ceiling
    # The source published at its own pace (as fast as it ran): a step either trained, or a newer step
    # committed while it waited superseded its training; the newest step always trains.
    store = open_store(cfg)
    trainings = [read_training(store, cfg.run, s) for s in (1, 2, 3)]
    for t in trainings:
        newer = re.match(r"superseded: step (\d+) was committed", t.reason)
        assert t.trained or (newer and int(newer.group(1)) > t.step), t.reason
    assert trainings[-1].trained
    assert [r["trained"] for r in summary["steps"]] == [t.trained for t in trainings]
    assert summary["steps"][0]["tau_served"] == 1.0  # nothing served before the first drafter
    # The ledger: every step's lag and cost, from the pipeline's records
    ledger = summary["ledger"]
    assert [r["step"] for r in ledger["steps"]] == [1, 2, 3]
    assert ledger["steps"][0]["served_version"] is None
    assert ledger["spent_s"] == pytest.approx(sum(sum(r["seconds"].values()) for r in ledger["steps"]), abs=0.01)
    assert sum(r["seconds"]["training"] > 0 for r in ledger["steps"]) == sum(t.trained for t in trainings)
    assert (cfg.data_path / "demo" / "ledger.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The fleet runs the champion the last step left.
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    assert [r["replica"] for r in summary["fleet"]] == ["standin-0", "standin-1"]
    assert {r["version"] for r in summary["fleet"]} == {registry.alias_version("champion")}
    assert all(r["live_tau"] >= 1.0 for r in summary["fleet"])
    assert "runs drafter version" in proc.stdout
    # The fleet generated every step's rollouts, each step's policy pushed to it first; step 1's before any
    # drafter existed (plain decoding), and the rollouts' tokens are the steps' responses.
    assert [w["step"] for w in summary["fleet_rollouts"]] == [1, 2, 3]
    for window in summary["fleet_rollouts"]:
        rollouts = read_rollouts(store, cfg.run, window["step"])
        assert window["rollouts"] == len(rollouts) == cfg.simulation.rollouts_per_step
        assert window["tokens"] == sum(sum(r.loss_mask) for r in rollouts)
    assert summary["fleet_rollouts"][0]["drafts"] == 0
    assert read_fleet_policy(store, cfg.run).step == 3
    assert "fleet rollouts, step 3:" in proc.stdout
    # The last co-trained drafter at k = 4 and 8: an EAGLE-3 drafter spends a forward per drafted token.
    assert [c["k"] for c in summary["round_costs"]] == [4, 8]
    assert all(c["drafter_forwards_per_round"] == c["k"] for c in summary["round_costs"])
    assert summary["train_tokens_per_s"] > 0
    # The buffer holds the training samples of the last two steps (buffer_steps=2); held-out ones never.
    trained_on = {s: shards.read_manifest(store, cfg.run, s).num_samples for s in (1, 2, 3)}
    assert all(n < cfg.simulation.rollouts_per_step for n in trained_on.values())
    assert [r["captured"] for r in summary["steps"]] == [trained_on[s] for s in (1, 2, 3)]
    assert all(r["bytes_stored"] > 0 for r in summary["steps"])
    assert [r["buffer_samples"] for r in summary["steps"]] == [
        trained_on[1], trained_on[1] + trained_on[2], trained_on[2] + trained_on[3]]

    # Every step ran as a run of the persisted instance, tagged as the sensor tags it.
    os.environ["DAGSTER_HOME"] = str(cfg.data_path / "dagster")
    try:
        with dg.DagsterInstance.get() as instance:
            runs = instance.get_runs(filters=dg.RunsFilter(job_name="rl_step_job"))
            assert sorted(r.tags["dagster/run_key"] for r in runs) == ["step-000001", "step-000002", "step-000003"]
            assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
            assert set(instance.get_dynamic_partitions("rl_step")) == {"step-000001", "step-000002", "step-000003"}
            # the step's replay, measured speedups Dagster plots over partitions
            acceptance = instance.get_latest_materialization_event(dg.AssetKey("acceptance")).asset_materialization
            assert acceptance.partition == "step-000003"
            assert {"speedup_cotrained", "speedup_cotrained_tail"} <= set(acceptance.metadata)
    finally:
        del os.environ["DAGSTER_HOME"]

    trained = sum(t.trained for t in trainings)
    assert len(registry.client.search_runs([registry.experiment_id])) == trained
    assert registry.alias_version("baseline") == "1"
    assert registry.alias_version("challenger") == str(trained)
    newest = registry.client.get_model_version(registry.model_name, str(trained))
    assert {"rollout_speedup", "rollout_speedup_tail"} <= set(registry.client.get_run(newest.run_id).data.metrics)

    # A second demo reuses the cached pre-trained target and starts from fresh pipeline state.
    again = _demo(tiny_config_path, 1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(list((cfg.data_path / "cache").iterdir())) == 1
    assert [s["step"] for s in json.loads(summary_path.read_text())["steps"]] == [1]
