"""Shared fixtures: a tiny pipeline configuration whose data lives in a temporary directory."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

# One torch thread per process (before torch is first imported; the processes tests start inherit it): the
# tests' tensors are tiny, and with several torch processes alive at once (a training, stand-in replicas,
# the test itself) OpenMP's spinning threads cost up to 10x the CPU time of one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.simulation import SimulatedRL
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

_PRETRAINED_ENV = "DRAFTER_TESTS_PRETRAINED_DIR"

TINY = {
    "run": "test",
    "simulation": {
        "vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "pretrain_iters": 30,
        "rl_iters": 5, "rollouts_per_step": 24, "prompt_len": 6, "response_len": 12,
    },
    "train": {"epochs": 2, "min_samples": 4, "batch_size_per_gpu": 8},
    "eval": {"num_prompts": 3, "max_new_tokens": 8, "held_out_fraction": 0.2},
}


# The longest files first (each takes minutes, the others seconds): `make test` runs a file at a time per
# pytest-xdist worker, so these start side by side at once instead of one of them running last, alone.
SLOWEST_FIRST = ["tests/test_ui.py", "tests/test_e2e.py", "tests/test_reliability.py", "tests/test_deploy.py",
                 "tests/test_train_process.py", "tests/test_dagster.py", "tests/test_fleet.py", "tests/test_s3.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # one process: the files in their usual order
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable within a file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(directory: Path, overrides: dict | None = None, pretrained: bool = True) -> Path:
    """A tiny config with its data under `directory`; stand-in replicas (if deployed to) on free ports.

    With `pretrained`, the data dir's cache already holds the simulation's pre-trained target, as after
    a first demo: pre-training (seconds of CPU) then runs once per test process, not once per test."""
    fleet = {"replicas": [{"name": f"standin-{i}", "port": free_port()} for i in range(2)],
             "canary_requests": 2, "canary_tokens": 8}
    data = {**TINY, "fleet": fleet, "data_dir": str(directory / "data")}
    for key, value in (overrides or {}).items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = directory / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    if pretrained:
        _seed_pretrained_target(path)
    return path


def _seed_pretrained_target(config_path: Path) -> None:
    try:
        cfg = load_config(config_path)
    except ConfigError:
        return  # a test of a bad config: nothing will be simulated
    if cfg.rollout_source != "simulated":
        return
    shared_dir = os.environ.get(_PRETRAINED_ENV)
    if not shared_dir:  # one folder per test process (pytest-xdist workers each have their own)
        shared_dir = tempfile.mkdtemp(prefix="drafter-tests-pretrained-")
        os.environ[_PRETRAINED_ENV] = shared_dir
        atexit.register(shutil.rmtree, shared_dir, True)
    shared = SimulatedRL(cfg.simulation, None, cfg.run, Path(shared_dir))
    source = shared._cache_path()  # noqa: SLF001  (the cache's own naming, by the simulation config)
    if not (source / "model.safetensors").exists():
        shared.pretrained()
    shutil.copytree(source, cfg.data_path / "cache" / source.name, dirs_exist_ok=True)


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
