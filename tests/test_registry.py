"""The MLflow registry wrapper against a real `mlflow server` on loopback."""

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
import torch

from pipeline.checkpoint import save_drafter
from pipeline.eagle import EagleConfig, EagleDrafter
from pipeline.registry import DrafterRegistry

TINY = EagleConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
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


def _drafter(seed: int) -> EagleDrafter:
    torch.manual_seed(seed)
    return EagleDrafter(TINY)


def test_register_alias_and_load_through_server(mlflow_server: str, tmp_path: Path) -> None:
    registry = DrafterRegistry(mlflow_server, "exp", "drafter")
    first = _drafter(0)
    run_id = registry.start_run("drafter-step-000001", {"rl_step": "step-000001"})
    registry.log_metrics(run_id, {"loss": 1.5}, step=0)
    version = registry.register(run_id, save_drafter(first, tmp_path / "ckpt"), {"rl_step": "1"})
    registry.end_run(run_id)
    assert version == "1"

    assert registry.alias_version("champion") is None
    registry.set_alias("champion", version)
    assert registry.alias_version("champion") == "1"
    assert registry.version_tags(version)["rl_step"] == "1"

    loaded = registry.load(version)
    for key, tensor in first.trainable_state_dict().items():
        torch.testing.assert_close(loaded.trainable_state_dict()[key], tensor)

    # A second registry object (another process in production) sees the same state.
    again = DrafterRegistry(mlflow_server, "exp", "drafter")
    assert again.alias_version("champion") == "1"
    assert again.find_run({"rl_step": "step-000001"}) == run_id
    assert again.find_run({"rl_step": "step-000002"}) is None


def test_sqlite_registry_versions_increase(tmp_path: Path) -> None:
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}", "exp", "drafter",
                               (tmp_path / "artifacts").as_uri())
    versions = []
    for seed in range(2):
        run_id = registry.start_run(f"run-{seed}", {})
        versions.append(registry.register(run_id, save_drafter(_drafter(seed), tmp_path / f"c{seed}"), {}))
    assert versions == ["1", "2"]
    registry.set_alias("champion", "2")
    assert registry.alias_version("champion") == "2"
