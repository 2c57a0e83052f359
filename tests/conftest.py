"""Shared fixtures: a tiny pipeline configuration whose data lives in a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

# One torch thread per process (before torch is first imported; the processes tests start inherit it): the
# tests' tensors are tiny, and with several torch processes alive at once (a training, stand-in replicas,
# the test itself) OpenMP's spinning threads cost up to 10x the CPU time of one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from pipeline.config import PipelineConfig, load_config
from tests.support.config import free_port, write_config
from tests.support.reliability import (  # noqa: F401  (the report's fixture and hooks)
    pytest_configure,
    pytest_deselected,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    reliability,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

# The longest files first (each takes minutes, the others seconds): `make test` runs a file at a time per
# pytest-xdist worker, so these start side by side at once instead of one of them running last, alone.
SLOWEST_FIRST = ["tests/integration/test_ui.py", "tests/integration/test_e2e.py",
                 "tests/integration/test_reliability.py", "tests/integration/test_deploy.py",
                 "tests/integration/test_train_process.py", "tests/integration/test_dagster.py",
                 "tests/unit/serving/test_fleet.py", "tests/integration/test_s3.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # one process: the files in their usual order
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable within a file


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
