"""The MLflow registry wrapper against a real `mlflow server` on loopback."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pipeline.models.checkpoint import save_drafter
from pipeline.models.eagle import EagleConfig, EagleDrafter
from pipeline.registry import DrafterRegistry

TINY = EagleConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)


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
    assert again.run_finished(run_id)
    assert again.version_tags(version)["rl_step"] == "1"


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


@pytest.fixture(params=[0o022, 0o027])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _modes(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in sorted(directory.iterdir())}


@pytest.mark.reliability("security", "exported drafter weights: readable as the umask allows, like config.json "
                                     "(checkpoint, MLflow artifacts, staged fleet directory)")
def test_exported_weights_get_the_mode_of_the_rest_of_the_checkpoint(tmp_path: Path, umask: int) -> None:
    """A vLLM server running as another user reads model.safetensors as it reads config.json."""
    expected = 0o666 & ~umask
    checkpoint = save_drafter(_drafter(0), tmp_path / "ckpt")
    assert _modes(checkpoint) == {"config.json": expected, "model.safetensors": expected}

    artifacts = tmp_path / "artifacts"
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}", "exp", "drafter", artifacts.as_uri())
    version = registry.register(registry.start_run("run", {}), checkpoint, {})
    [logged] = [p for p in artifacts.rglob("model.safetensors")]
    assert _modes(logged.parent) == {"config.json": expected, "model.safetensors": expected}

    # A version logged by an older writer, weights owner-only: the staged copy is readable all the same.
    logged.chmod(0o600)
    staged = registry.download(version, tmp_path / "fleet" / "staged" / f"v{version}")
    assert _modes(staged) == {"config.json": expected, "model.safetensors": expected}


def _meeting_before_create(registry: DrafterRegistry, barrier: threading.Barrier) -> None:
    """Hold this registrant's create-version request until the other's is sent too: both are past any check
    made before it (the interleaving two Dagster instances training one step can hit)."""
    create = registry.client.create_model_version

    def create_when_both_are_here(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        barrier.wait(timeout=120)
        return create(*args, **kwargs)

    registry.client.create_model_version = create_when_both_are_here


@pytest.mark.reliability("fault", "two processes register the same training at once, both past the existence "
                                  "check (MLflow server): one version, both return it")
def test_two_concurrent_registrations_of_one_training_leave_one_version(mlflow_server: str, tmp_path: Path) -> None:
    checkpoint = save_drafter(_drafter(0), tmp_path / "ckpt")
    for attempt in range(3):
        tags = {"input_id": f"inputs-{attempt}", "rl_step": "3"}
        registries = [DrafterRegistry(mlflow_server, "concurrent", "concurrent-drafter") for _ in range(2)]
        barrier = threading.Barrier(2)
        for registry in registries:
            _meeting_before_create(registry, barrier)
        runs = [r.start_run(f"drafter-step-000003-{i}", {}) for i, r in enumerate(registries)]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(r.register, run_id, checkpoint, tags, identity="input_id")
                       for r, run_id in zip(registries, runs, strict=True)]
            versions = [f.result() for f in futures]
        live = registries[0].client.search_model_versions(
            f"name = 'concurrent-drafter' and tags.`input_id` = 'inputs-{attempt}'")
        assert [v.version for v in live] == [versions[0]], (attempt, versions)
        assert versions[0] == versions[1]

    # A later registrant of a registered training gets its version, and logs nothing.
    registry = DrafterRegistry(mlflow_server, "concurrent", "concurrent-drafter")
    run_id = registry.start_run("late", {})
    assert registry.register(run_id, checkpoint, {"input_id": "inputs-0"}, identity="input_id") == \
        registry.find_version({"input_id": "inputs-0"})
    assert registry.client.list_artifacts(run_id) == []


def test_warm_start_is_the_first_version_once(tmp_path: Path) -> None:
    """drafter.warm_start registered before any step: baseline, champion and challenger, loadable as it was given;
    a second call (a demo restarted on the same run) finds it, and a missing checkpoint is named."""
    from pipeline.config import load_config
    from pipeline.registry import register_warm_start

    given = _drafter(0)
    directory = save_drafter(given, tmp_path / "first")
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}", "exp", "drafter",
                               (tmp_path / "artifacts").as_uri())
    cfg = load_config(overrides={"drafter": {"kind": "eagle", "warm_start": str(directory)}})
    version = register_warm_start(registry, cfg)
    assert [registry.alias_version(a) for a in ("baseline", "champion", "challenger", "live")] == \
        [version, version, version, None]
    assert registry.version_tags(version)["origin"] == "drafter.warm_start"
    loaded = registry.load(version)
    for key, tensor in given.trainable_state_dict().items():
        torch.testing.assert_close(loaded.trainable_state_dict()[key], tensor)
    assert register_warm_start(registry, cfg) == version
    assert registry._versions(f"tags.`pipeline_run` = '{cfg.run}'") == [int(version)]

    missing = load_config(overrides={"drafter": {"warm_start": str(tmp_path / "nothing")}})
    with pytest.raises(FileNotFoundError, match="drafter.warm_start .*nothing: no config.json or model.safetensors"):
        register_warm_start(registry, missing)
