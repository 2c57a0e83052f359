"""The tiny pipeline configuration tests run on, with its data in a temporary directory."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from pathlib import Path

import yaml

from pipeline.config import ConfigError, load_config
from pipeline.sources.simulation import SimulatedRL

_PRETRAINED_ENV = "DRAFTER_TESTS_PRETRAINED_DIR"
_WARM_ENV = "DRAFTER_TESTS_WARM_DIR"
_MLFLOW_ENV = "DRAFTER_TESTS_MLFLOW_DIR"

TINY = {
    "run": "test",
    "simulation": {
        "vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "pretrain_iters": 30,
        "rl_iters": 5, "rollouts_per_step": 24, "prompt_len": 6, "response_len": 12,
        "step_period_s": 0.0,  # a demo's source publishes as fast as it runs: steps coalesce
        "response_len_sigma": 0.0, "parts_per_step": 1,  # whole steps of fixed lengths unless a test asks
    },
    "refresh": {"enabled": False},
    "train": {"epochs": 2, "min_samples": 4, "batch_size_per_gpu": 8},
    # A failing stage fails its step at once (the retry's own tests ask for it). The tests of a process share their
    # stages' warm workers (`launch.warm_dir`, set by write_config), as pipelines on one machine may: a job carries
    # its own configuration, and a worker keeps nothing between jobs (WarmJobs), so a test pays for a stage's imports
    # once per process, not once per test. A worker stays a minute after its last job (the next test's steps find
    # it; an idle one holds its memory), and at once when the process exits and its folder goes.
    "launch": {"warm_idle_s": 60.0, "retries": 0},
    "eval": {"num_prompts": 3, "max_new_tokens": 8, "held_out_fraction": 0.2, "replay_runs": 1},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(directory: Path, overrides: dict | None = None, pretrained: bool = True, replicas: int = 1) -> Path:
    """A tiny config with its data under `directory`; `replicas` stand-in replicas (if deployed to) on free ports:
    one unless a test's fleet needs more (a rolling update, a crash after the first replica), each a process.

    With `pretrained`, the data dir's cache already holds the simulation's pre-trained target, as after
    a first demo: pre-training (seconds of CPU) then runs once per test process, not once per test."""
    fleet = {"replicas": [{"name": f"standin-{i}", "port": free_port()} for i in range(replicas)],
             "canary_requests": 2, "canary_tokens": 8}
    data = {**TINY, "fleet": fleet, "data_dir": str(directory / "data"),
            "launch": {**TINY["launch"], "warm_dir": str(_process_dir(_WARM_ENV, "drafter-tests-warm-"))}}
    for key, value in (overrides or {}).items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = directory / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    if not data.get("mlflow", {}).get("tracking_uri"):
        _seed_mlflow_database(Path(data["data_dir"]))
    if pretrained:
        _seed_pretrained_target(path)
    return path


def _seed_mlflow_database(data_dir: Path) -> None:
    """The data dir's MLflow database (`mlflow.tracking_uri` empty: SQLite under data_dir) as MLflow creates it, empty:
    a copy of one this process had MLflow create, so each test does not pay for MLflow's schema migrations."""
    template = _process_dir(_MLFLOW_ENV, "drafter-tests-mlflow-") / "mlflow.db"
    if not template.exists():
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{template}").search_experiments()  # creates the tables, then the default experiment
    (data_dir / "mlflow").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, data_dir / "mlflow" / "mlflow.db")


def _seed_pretrained_target(config_path: Path) -> None:
    try:
        cfg = load_config(config_path)
    except ConfigError:
        return  # a test of a bad config: nothing will be simulated
    if cfg.rollout_source != "simulated":
        return
    shared = SimulatedRL(cfg.simulation, None, cfg.run, _process_dir(_PRETRAINED_ENV, "drafter-tests-pretrained-"))
    source = shared._cache_path()  # the cache's own naming, by the simulation config
    if not (source / "model.safetensors").exists():
        shared.pretrained()
    shutil.copytree(source, cfg.data_path / "cache" / source.name, dirs_exist_ok=True)


def _process_dir(env: str, prefix: str) -> Path:
    """A folder of this test process's (pytest-xdist workers each have their own), named in `env` so that the
    processes it starts find the same one; removed when the process exits."""
    shared_dir = os.environ.get(env)
    if not shared_dir:
        shared_dir = tempfile.mkdtemp(prefix=prefix)
        os.environ[env] = shared_dir
        atexit.register(shutil.rmtree, shared_dir, True)
    return Path(shared_dir)
