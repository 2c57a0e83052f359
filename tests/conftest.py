"""Shared fixtures: a tiny pipeline configuration whose data lives in a temporary directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.config import PipelineConfig, load_config
from tests.reliability import (  # noqa: F401  (the report's fixture and hooks)
    pytest_configure,
    pytest_deselected,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    reliability,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

TINY = {
    "run": "test",
    "simulation": {
        "vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "pretrain_iters": 30,
        "rl_iters": 5, "rollouts_per_step": 24, "prompt_len": 6, "response_len": 12,
    },
    "train": {"epochs": 2, "min_samples": 4, "batch_size_per_gpu": 8},
    "eval": {"num_prompts": 3, "max_new_tokens": 8, "held_out_fraction": 0.2},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(directory: Path, overrides: dict | None = None) -> Path:
    """A tiny config with its data under `directory`; stand-in replicas (if deployed to) on free ports."""
    fleet = {"replicas": [{"name": f"standin-{i}", "port": free_port()} for i in range(2)],
             "canary_requests": 2, "canary_tokens": 8}
    data = {**TINY, "fleet": fleet, "data_dir": str(directory / "data")}
    for key, value in (overrides or {}).items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = directory / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def tiny_config_path(tmp_path: Path) -> Path:
    return write_config(tmp_path)


@pytest.fixture
def tiny_config(tiny_config_path: Path) -> PipelineConfig:
    return load_config(tiny_config_path)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` (SQLite backend, proxied artifacts) on a loopback port."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mlflow server did not start") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
