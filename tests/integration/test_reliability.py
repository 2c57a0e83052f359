"""Faults injected into real processes and servers, then the stored state checked; bad inputs refused.

Every test records its row of docs/reliability.md (see tests/support/reliability.py). The crashes are real
SIGKILLs of a child process doing the step's work (tests/support/crash_child.py); S3 and MLflow faults come
from a fault-injecting proxy (tests/support/fault_proxy.py) in front of a moto server and a `mlflow server`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs
import torch
import yaml
from mlflow.exceptions import MlflowException

from pipeline.config import PipelineConfig, load_config
from pipeline.data import buffer, shard_format, shards
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.fleet_state import read_fleet_state
from pipeline.data.keys import fleet_state_key, hidden_states_prefix
from pipeline.data.store import ObjectStore, StorageFullError, open_store, storage_options_for
from pipeline.models import drafter as drafters
from pipeline.models import target as target_lib
from pipeline.models.checkpoint import save_drafter
from pipeline.registry import DrafterRegistry
from pipeline.serving import deploy
from pipeline.serving.drivers import StandInDriver
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from pipeline.training import cotrain
from tests.integration.test_s3 import BUCKET, s3_endpoint  # noqa: F401  (the moto server fixture)
from tests.support.config import write_config
from tests.support.fault_proxy import FaultProxy
from tests.unit.data.test_shards import H, make_samples

ROOT = Path(__file__).resolve().parents[2]


# -- a small loop shared by the crash tests: steps 1 and 2 simulated, step 1's hidden states and buffer


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory, mlflow_server: str) -> tuple[Path, PipelineConfig, ObjectStore]:
    directory = tmp_path_factory.mktemp("loop")
    path = write_config(directory, {"mlflow": {"tracking_uri": mlflow_server}})
    cfg = load_config(path)
    store = open_store(cfg)
    simulator = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    simulator.run_step(1)
    simulator.run_step(2)
    extract.extract_hidden_states(store, cfg, 1)
    buffer.build_buffer(store, cfg.run, 1, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)
    return path, cfg, store


def _variant(path: Path, name: str, overrides: dict) -> Path:
    """The loop's config with its own MLflow experiment and model (and `overrides`), in a new file."""
    data = yaml.safe_load(path.read_text())
    data["mlflow"] = {**data.get("mlflow", {}), "experiment": f"reliability-{name}", "model_name": f"drafter-{name}"}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    out = path.with_name(f"{name}.yaml")
    out.write_text(yaml.safe_dump(data))
    return out


def _crash(work: str, config: Path, step: int, *args: str) -> subprocess.CompletedProcess:
    """Run `work` in a child that SIGKILLs itself at its kill point; return once it is dead."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.support.crash_child", work, str(config), str(step), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, f"{work} was not killed at its kill point:\n{done.stderr[-3000:]}"
    return done


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# -- SIGKILL of the step's process ------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_during_a_shard_write_leaves_no_partial_step(loop, reliability) -> None:
    reliability.fault("SIGKILL during a shard write (first write and rewrite of a step), then rerun")
    path, cfg, store = loop
    step1_dir = Path(store.uri(hidden_states_prefix(cfg.run, 1)).removeprefix("file://"))
    step2_dir = Path(store.uri(hidden_states_prefix(cfg.run, 2)).removeprefix("file://"))
    committed = shards.read_manifest(store, cfg.run, 1)

    # A rewrite of step 1 killed halfway through its shard: readers still get the old, whole step.
    _crash("hidden_states", path, 1)
    assert any(".tmp-" in name for name in _files(step1_dir)), "the kill left no partial file: no fault injected"
    assert shards.read_manifest(store, cfg.run, 1) == committed
    assert len(list(shards.iter_samples(store, cfg.run, committed))) == committed.num_samples

    # The first write of step 2 killed: the step is not visible at all.
    _crash("hidden_states", path, 2)
    assert not shards.has_manifest(store, cfg.run, 2)
    with pytest.raises(FileNotFoundError, match="hidden states of step 2 are not committed"):
        buffer.build_buffer(store, cfg.run, 2, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)

    # Rerun: the step commits, what the killed writes left behind is gone, the buffer has each sample once.
    manifest = extract.extract_hidden_states(store, cfg, 2)
    assert _files(step2_dir) == sorted([shard_format.MANIFEST, *(s.name for s in manifest.shards)])
    extract.extract_hidden_states(store, cfg, 1)
    assert not any(".tmp-" in name for name in _files(step1_dir))
    # Step 1's buffer was built before the rewrite: it still reads every sample (by id).
    assert len(list(buffer.iter_buffer_samples(store, cfg.run, buffer.read_buffer(store, cfg.run, 1).entries))) == \
        committed.num_samples
    built = buffer.build_buffer(store, cfg.run, 2, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)
    ids = [(e.step, e.sample_id) for e in built.entries]
    assert len(ids) == len(set(ids)) == committed.num_samples + manifest.num_samples
    assert len(list(buffer.iter_buffer_samples(store, cfg.run, built.entries))) == len(ids)


def _runs(registry: DrafterRegistry) -> list:
    return registry.client.search_runs([registry.experiment_id], run_view_type=3)  # active and deleted alike


def _versions(registry: DrafterRegistry) -> list[str]:
    return sorted(v.version for v in registry.client.search_model_versions(f"name = '{registry.model_name}'"))


@pytest.mark.slow
@pytest.mark.parametrize("point", ["unregistered", "registered"])
def test_sigkill_during_registration_then_rerun_gives_one_run_and_one_version(
    loop, reliability, point: str
) -> None:
    reliability.fault(f"SIGKILL during model registration ({'before' if point == 'unregistered' else 'after'} "
                      "the version is created), then rerun")
    path, cfg, store = loop
    config = _variant(path, f"kill-{point}", {})
    cfg = load_config(config)
    _crash(f"train_{point}", config, 1)
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    [killed] = _runs(registry)
    assert killed.info.status == "RUNNING"  # what a SIGKILL leaves: nobody ended the run
    assert len(_versions(registry)) == (1 if point == "registered" else 0)
    assert registry.alias_version("challenger") is None

    tags = {"rl_step": "step-000001", "attempt": "rerun"}
    outcome = cotrain.train_step(store, cfg, 1, registry, tags)
    again = cotrain.train_step(store, cfg, 1, registry, tags)

    [run] = _runs(registry)
    assert run.info.run_id == killed.info.run_id == outcome.run_id == again.run_id
    assert run.info.status == "FINISHED"
    assert _versions(registry) == [outcome.version] == [again.version]
    assert registry.alias_version("challenger") == registry.alias_version("baseline") == outcome.version
    assert again.reason.startswith("reused version")
    registry.load(outcome.version)  # the registered checkpoint is whole


def _register_fresh(registry: DrafterRegistry, cfg: PipelineConfig, store: ObjectStore, seed: int,
                    directory: Path) -> str:
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, 1)
    target = target_lib.load_policy(store, pointer.checkpoint_uri)
    counts = torch.ones(target.config.vocab_size, dtype=torch.int64)
    drafter = drafters.fresh_drafter(cfg.drafter, target, counts, seed)
    run_id = registry.start_run(f"fresh-{seed}", {"seed": str(seed)})
    version = registry.register(run_id, save_drafter(drafter, directory / f"seed-{seed}"), {"seed": str(seed)})
    registry.end_run(run_id)
    return version


def _served_drafter(driver: StandInDriver, replica) -> str:
    """The drafter directory the replica's running process serves: started with, or hot-updated to since."""
    serving = driver.serving(replica)
    assert serving is not None, f"{replica.name} is not running"
    return serving[1]


@pytest.mark.slow
def test_sigkill_during_a_deploy_then_rerun_serves_one_drafter(loop, reliability, tmp_path: Path) -> None:
    reliability.fault("SIGKILL during a rolling deploy (after the first replica), then rerun")
    path, _, store = loop
    config = _variant(path, "kill-deploy", {"fleet": {"replicas": [{"name": f"rel-{i}", "port": p} for i, p in
                                                                    enumerate(_ports(2))]}})
    cfg = load_config(config)
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    v1 = _register_fresh(registry, cfg, store, 1, tmp_path)
    v2 = _register_fresh(registry, cfg, store, 2, tmp_path)
    driver = StandInDriver(cfg.eval.num_speculative_tokens, cfg.data_path / "fleet" / "replicas")
    replicas = deploy.replicas(cfg)
    try:
        # v1 serves on both replicas (started directly: a deploy's gates are tested elsewhere).
        staged = registry.download(v1, cfg.data_path / "fleet" / "staged" / f"v{v1}")
        target = store.resolve(rollouts_lib.read_policy_pointer(store, cfg.run, 2).checkpoint_uri)
        for replica in replicas:
            driver.restart(replica, target, str(staged))
        registry.set_alias("live", v1)

        _crash("deploy", config, 0, v2)
        # Mid-rollout: the first replica already runs v2; the record still says v1.
        assert [f"/v{v2}/" in _served_drafter(driver, r) for r in replicas] == [True, False]
        assert registry.alias_version("live") == v1
        assert not store.exists(fleet_state_key(cfg.run))

        first_pid = int((cfg.data_path / "fleet" / "replicas" / f"{replicas[0].name}.pid").read_text())
        deploy.deploy(cfg, store, registry, v2, driver)
        assert all(f"/v{v2}/" in _served_drafter(driver, r) for r in replicas)
        assert registry.alias_version("live") == v2
        state = read_fleet_state(store, cfg.run)
        assert state.version == v2
        assert [r.version for r in state.replicas] == [v2, v2]
        # The replica the killed deploy had already moved to v2 keeps its process and is only gated; the other,
        # on the same policy, gets v2 in place.
        assert [(r.update, r.restarted) for r in state.replicas] == [("none", False), ("hot", False)]
        assert int((cfg.data_path / "fleet" / "replicas" / f"{replicas[0].name}.pid").read_text()) == first_pid
        for replica in replicas:
            with urllib.request.urlopen(f"{replica.url}/health", timeout=10) as response:
                assert response.status == 200
    finally:
        driver.stop_all(replicas)


def _ports(n: int) -> list[int]:
    from tests.support.config import free_port

    return [free_port() for _ in range(n)]


# -- S3 answering errors or slowly ------------------------------------------------------------------------------


def test_s3_errors_and_slow_answers_are_retried(s3_endpoint: str, reliability) -> None:  # noqa: F811
    reliability.fault("S3 server answering 500/503 and slowly for a while (shards + manifest)")
    prefix = f"faults-{uuid.uuid4().hex[:6]}"
    root = f"s3://{BUCKET}/{prefix}"
    samples = make_samples(3, [5, 7, 6, 4, 8])
    with FaultProxy(s3_endpoint) as proxy:
        store = ObjectStore(root, storage_options_for(root, proxy.url))
        proxy.fail_next(1, status=500)
        proxy.fail_next(2, status=503)
        proxy.slow(seconds=0.3, requests=3)
        manifest = shards.write_hidden_states(store, "r", 3, samples, hidden_size=H, layer_ids=[0],
                                              target={"model_id": "t"}, samples_per_shard=2)
        assert proxy.failed() == 3
        proxy.down(seconds=0.5)
        read = list(shards.iter_samples(store, "r", shards.read_manifest(store, "r", 3)))
        assert proxy.failed() > 3
    assert [s.sample_id for s in read] == [s.sample_id for s in samples]
    direct = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    objects = sorted(p.rsplit("/", 1)[-1] for p in direct.find(f"{BUCKET}/{prefix}"))
    assert objects == sorted([shard_format.MANIFEST, *(s.name for s in manifest.shards)])  # each object once


# -- MLflow down in the middle of a step ------------------------------------------------------------------------


@pytest.mark.slow
def test_mlflow_down_mid_registration(loop, mlflow_server: str, reliability, monkeypatch) -> None:
    reliability.fault("MLflow server down for a while at registration: the client waits and retries")
    reliability.fault("MLflow server down longer than the retries: clear error, the rerun resumes the run")
    reliability.fault("MLflow answer to create-version lost after the server acted (client retry)")
    path, _, store = loop
    with FaultProxy(mlflow_server) as proxy:
        config = _variant(path, "mlflow-down", {"mlflow": {"tracking_uri": proxy.url}})
        cfg = load_config(config)
        registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
        tags = {"rl_step": "step-000001"}

        # Longer than the client's retries: the step fails and says which server and why; nothing registered.
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        proxy.trip("/model-versions/create", seconds=60)
        with pytest.raises(MlflowException) as failure:
            cotrain.train_step(store, cfg, 1, registry, tags)
        message = str(failure.value)
        assert proxy.url in message
        assert "503" in message
        proxy.down(0)
        assert _versions(registry) == []
        monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
        monkeypatch.delenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR")

        # Down for 3 s at the same moment of the rerun: the client's backoff rides it out, and the
        # answer to the create call is then lost once, so the client sends it twice.
        proxy.trip("/model-versions/create", seconds=3)
        proxy.lose_response("/model-versions/create", 1)
        outcome = cotrain.train_step(store, cfg, 1, registry, tags)
        assert sum(1 for _, p, s in proxy.log if "/model-versions/create" in p and s == -503) >= 2

    direct = DrafterRegistry(mlflow_server, cfg.mlflow.experiment, cfg.mlflow.model_name)
    [run] = _runs(direct)
    assert run.info.run_id == outcome.run_id
    assert run.info.status == "FINISHED"
    assert _versions(direct) == [outcome.version]
    assert direct.alias_version("challenger") == outcome.version


# -- disk full --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _small_filesystem(directory: Path, size: str) -> Iterator[str]:
    """A size-limited tmpfs at `directory` (needs root); yields how the limit is imposed."""
    directory.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                          capture_output=True)
    if done.returncode != 0:
        yield "none"
        return
    try:
        yield "tmpfs"
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """Where no tmpfs can be mounted: files larger than `limit` fail with EFBIG (RLIMIT_FSIZE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_disk_full_while_writing_shards(tmp_path: Path, reliability) -> None:
    reliability.fault("disk full while writing shards")
    with _small_filesystem(tmp_path / "small", "4m") as kind:
        store = ObjectStore((tmp_path / "small" / "store").as_uri())
        good = shards.write_hidden_states(store, "r", 1, make_samples(1, [4, 5]), hidden_size=H, layer_ids=[0],
                                          target={"model_id": "t"})
        big = make_samples(2, [4096] * 4, seed=3, layers=4)  # 4 x 256 KiB of hidden states
        filler = tmp_path / "small" / "filler"
        if kind == "tmpfs":  # leave less room than the step needs
            free = os.statvfs(filler.parent).f_bavail * os.statvfs(filler.parent).f_frsize
            filler.write_bytes(b"\0" * (free - 300_000))
            limit = contextlib.nullcontext()
        else:
            limit = _file_size_limit(300_000)
        with limit, pytest.raises(StorageFullError) as failure:
            shards.write_hidden_states(store, "r", 2, big, hidden_size=H, layer_ids=[0, 1, 2, 3],
                                       target={"model_id": "t"}, samples_per_shard=2)
        assert failure.value.errno in (errno.ENOSPC, errno.EFBIG)
        assert "the storage is full or over a size limit" in str(failure.value)
        assert hidden_states_prefix("r", 2) in str(failure.value)
        assert not shards.has_manifest(store, "r", 2)
        assert _names(store, hidden_states_prefix("r", 2)) == []  # no shard, no temporary file
        assert shards.read_manifest(store, "r", 1) == good
        assert len(list(shards.iter_samples(store, "r", good))) == 2

        filler.unlink(missing_ok=True)  # space again: the rerun commits
        manifest = shards.write_hidden_states(store, "r", 2, big, hidden_size=H, layer_ids=[0, 1, 2, 3],
                                              target={"model_id": "t"}, samples_per_shard=2)
        assert _names(store, hidden_states_prefix("r", 2)) == sorted(
            [shard_format.MANIFEST, *(s.name for s in manifest.shards)])


def _names(store: ObjectStore, prefix: str) -> list[str]:
    return sorted(key.rsplit("/", 1)[-1] for key, _, _ in store.list_files(prefix))


# -- the registry's artifacts stay inside their root ------------------------------------------------------------


@pytest.fixture(scope="module")
def sqlite_registry(tmp_path_factory: pytest.TempPathFactory) -> DrafterRegistry:
    """One file-backed registry for the tests that need no server (creating its schema takes seconds)."""
    directory = tmp_path_factory.mktemp("sqlite-registry")
    return DrafterRegistry(f"sqlite:///{directory / 'mlflow.db'}", "reliability", "bad-inputs",
                           (directory / "artifacts").as_uri())


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("{artifacts}/drafter/../../../../etc", id="dotdot"),
        pytest.param("/etc", id="absolute-path"),
        pytest.param("file:///etc", id="file-uri"),
        pytest.param("{artifacts}/other", id="other-artifact"),
    ],
)
def test_registry_refuses_artifact_uris_outside_the_artifact_root(
    sqlite_registry: DrafterRegistry, tmp_path: Path, reliability, source: str
) -> None:
    reliability.bad_input("registry artifact URI outside the artifact root (.., absolute path, other directory)")
    registry = sqlite_registry
    run_id = registry.start_run("r", {})
    registry.client.log_text(run_id, "{}", "drafter/config.json")
    artifacts = registry.client.get_run(run_id).info.artifact_uri
    version = registry.client.create_model_version(registry.model_name, source=source.format(artifacts=artifacts),
                                                   run_id=run_id)
    target = tmp_path / "staged"
    with pytest.raises(ValueError, match=f"version {version.version}: source .* outside its run's artifact root"):
        registry.download(version.version, target)
    assert not target.exists()


@pytest.mark.parametrize("path", ["../evil", "drafter/../../evil", "/etc/passwd", "C:/x", "s3://b/k", "a/../../b"])
def test_artifact_listing_paths_outside_the_root_are_refused(path: str, reliability) -> None:
    from pipeline.registry import ArtifactPathError, check_artifact_path

    reliability.bad_input("registry artifact listing with .. or absolute paths")
    with pytest.raises(ArtifactPathError, match="points outside the artifact root"):
        check_artifact_path(path, "model m version 1")
    assert check_artifact_path("drafter/model.safetensors", "v") == "drafter/model.safetensors"


# -- bad checkpoints at warm start and deploy -------------------------------------------------------------------


def _edit_weights(directory: Path, key: str, tensor: torch.Tensor | None) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    if tensor is None:
        tensors.pop(key)
    else:
        tensors[key] = tensor
    save_file(tensors, directory / "model.safetensors")


@pytest.mark.parametrize("bad", ["pickle", "wrong-shape", "missing-key"])
def test_deploy_refuses_a_bad_checkpoint_before_touching_a_replica(
    loop, reliability, tmp_path: Path, bad: str
) -> None:
    reliability.bad_input(f"deploy checkpoint: {'a pickle' if bad == 'pickle' else 'keys/shapes not its config'}")
    path, _, store = loop
    cfg = load_config(_variant(path, f"bad-deploy-{bad}", {"data_dir": str(tmp_path / "data")}))
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, 1)
    target = target_lib.load_policy(store, pointer.checkpoint_uri)
    drafter = drafters.fresh_drafter(cfg.drafter, target, torch.ones(target.config.vocab_size, dtype=torch.int64), 0)
    directory = save_drafter(drafter, tmp_path / "ckpt")
    if bad == "pickle":
        torch.save(drafter.trainable_state_dict(), directory / "model.safetensors")
    elif bad == "wrong-shape":
        _edit_weights(directory, "fc.weight", torch.zeros(3, 3))
    else:
        _edit_weights(directory, "fc.weight", None)
    run_id = registry.start_run("bad", {})
    version = registry.register(run_id, directory, {})
    driver = StandInDriver(cfg.eval.num_speculative_tokens, cfg.data_path / "fleet" / "replicas")
    state = read_fleet_state(store, cfg.run)

    message = "not a readable safetensors file" if bad == "pickle" else "fc.weight"
    with pytest.raises(ValueError, match=message):
        deploy.deploy(cfg, store, registry, version, driver)
    assert not driver.state_dir.exists()  # no replica was started or stopped
    assert registry.alias_version("live") is None
    assert read_fleet_state(store, cfg.run) == state


def test_warm_start_checkpoint_that_does_not_match_its_config(loop, reliability, tmp_path: Path) -> None:
    reliability.bad_input("warm-start checkpoint whose safetensors shapes do not match its config")
    path, _, store = loop
    pointer = rollouts_lib.read_policy_pointer(store, load_config(path).run, 1)
    target = target_lib.load_policy(store, pointer.checkpoint_uri)
    base = load_config(path)
    drafter = drafters.fresh_drafter(base.drafter, target, torch.ones(target.config.vocab_size, dtype=torch.int64), 0)
    directory = save_drafter(drafter, tmp_path / "warm")
    _edit_weights(directory, "fc.weight", torch.zeros(3, 3))
    cfg = load_config(_variant(path, "bad-warm-start", {"drafter": {"warm_start": str(directory)}}))
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    with pytest.raises(ValueError, match=r"fc\.weight has shape \(3, 3\)"):
        cotrain.train_step(store, cfg, 1, registry, {})
    assert _runs(registry) == []
    assert _versions(registry) == []


# -- bad rollouts -------------------------------------------------------------------------------------------------


def test_loss_mask_all_zero_is_refused(store: ObjectStore, tmp_path: Path, reliability) -> None:
    from pipeline.data.rollouts import PolicyPointer, Rollout, RolloutsError, is_committed, write_rollouts

    reliability.bad_input("loss mask all zero")
    rows = [Rollout("a", [1, 2, 3], [0, 1, 1], 1.0, 0), Rollout("b", [1, 2, 3], [0, 0, 0], 1.0, 0)]
    with pytest.raises(RolloutsError, match="sample 'b': field loss_mask: all zeros"):
        write_rollouts(store, "r", 1, rows, PolicyPointer(0, "x", "m"))
    assert not is_committed(store, "r", 1)
    assert not (tmp_path / "store").exists() or not any(p.is_file() for p in (tmp_path / "store").rglob("*"))

    sample = make_samples(1, [4])[0]
    zero = shard_format.HiddenSample(sample.sample_id, 1, sample.input_ids, torch.zeros_like(sample.loss_mask),
                               sample.hidden)
    with pytest.raises(shard_format.ShardError, match="loss mask is all zero"):
        shards.write_hidden_states(store, "r", 1, [zero], hidden_size=H, layer_ids=[0], target={})
    assert not shards.has_manifest(store, "r", 1)


# -- secrets in the config are refused ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        pytest.param({"mlflow": {"tracking_uri": "http://ops:hunter2@mlflow:5000"}}, "mlflow.tracking_uri",
                     id="mlflow"),
        pytest.param({"storage": {"endpoint_url": "http://AKIA:hunter2@minio:9000"}}, "storage.endpoint_url",
                     id="s3"),
    ],
)
def test_credentials_in_config_uris_are_refused_without_echoing_them(overrides: dict, key: str, reliability) -> None:
    from pipeline.config import ConfigError

    reliability.bad_input("credentials written into a config URI (user:password@)")
    with pytest.raises(ConfigError, match=f"{key} must not carry credentials") as failure:
        load_config(overrides=overrides)
    assert "hunter2" not in str(failure.value)


# -- the Dagster daemon restarted between sensor ticks ----------------------------------------------------------


def _daemon(home: Path, config: Path, clocks: list[float], crash_point: str = "") -> int:
    env = dict(os.environ, DAGSTER_HOME=str(home), DRAFTER_PIPELINE_CONFIG=str(config), PYTHONPATH=str(ROOT))
    ticks = ",".join(str(c) for c in clocks)
    argv = [sys.executable, "-m", "tests.support.daemon_child", ticks, *([crash_point] if crash_point else [])]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, -signal.SIGKILL), done.stderr[-3000:]
    return done.returncode


@pytest.mark.slow
def test_daemon_restarted_between_sensor_ticks_requests_each_step_once(tmp_path: Path, reliability) -> None:
    import dagster as dg
    from dagster._core.storage.tags import RUN_KEY_TAG

    from tests.integration.test_dagster import _fake_step

    reliability.fault("Dagster daemon killed mid-tick (after creating a run) and restarted between ticks")
    config = write_config(tmp_path, {"fleet": {"driver": "none"}})
    cfg = load_config(config)
    store = open_store(cfg)
    home = tmp_path / "dagster_home"
    home.mkdir()
    # Runs are queued, not launched: this test is about what the sensor requests.
    (home / "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster._core.run_coordinator\n  class: QueuedRunCoordinator\n"
        "telemetry:\n  enabled: false\n")
    for step in (1, 2):
        _fake_step(store, cfg.run, step)

    start = 2_000_000_000.0
    # Killed right after the first run was created: no launch, no cursor saved.
    assert _daemon(home, config, [start], "RUN_CREATED") == -signal.SIGKILL
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert [r.tags[RUN_KEY_TAG] for r in instance.get_runs()] == ["step-000001"]
    _fake_step(store, cfg.run, 3)  # committed while the daemon was down
    # Restarted: the interrupted tick is resumed (its requests again, deduped by run key), then the next.
    assert _daemon(home, config, [start + 60, start + 120]) == 0

    with dg.DagsterInstance.from_config(str(home)) as instance:
        keys = sorted(r.tags[RUN_KEY_TAG] for r in instance.get_runs())
        partitions = sorted(instance.get_dynamic_partitions("rl_step"))
    assert keys == ["step-000001", "step-000002", "step-000003"]  # each once, none skipped
    assert partitions == keys


# -- secrets -----------------------------------------------------------------------------------------------------

SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "sentinel-s3-secret-7c1f0e",
    "MLFLOW_TRACKING_TOKEN": "sentinel-mlflow-token-4b2d9a",
    "REPLICA_API_KEY": "sentinel-replica-key-91ae3c",
}


def _leaks(*roots: Path) -> list[str]:
    """Files under `roots` (databases, logs, JSON, artifacts: every byte) holding a secret."""
    found = []
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                found += [f"{p}: {name}" for name, value in SECRETS.items() if value.encode() in data]
    return found


@pytest.mark.slow
def test_secrets_stay_out_of_logs_metadata_and_errors(
    s3_endpoint: str, mlflow_server: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture,
    reliability,
) -> None:
    import traceback

    import dagster as dg

    from definitions import build_definitions
    from jobs.sensors import LIVE_TAU_SENSOR_NAME, live_tau_sensor
    from pipeline.serving.drivers import ReplicaSpec
    from pipeline.serving.gates import GateError, check_replica
    from tests.support.config import free_port

    reliability.security("S3 secret key, MLflow token, replica API key: none in logs, metadata, MLflow, errors")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    caplog.set_level("DEBUG")
    prefix = f"secrets-{uuid.uuid4().hex[:6]}"
    path = write_config(tmp_path, {
        "storage": {"root": f"s3://{BUCKET}/{prefix}", "endpoint_url": s3_endpoint},
        "mlflow": {"tracking_uri": mlflow_server, "experiment": "secrets", "model_name": "secrets-drafter"},
        "fleet": {"replicas": [{"name": "keyed", "port": free_port(), "api_key_env": "REPLICA_API_KEY"}]},
    })
    cfg = load_config(path)
    SimulatedRL(cfg.simulation, open_store(cfg), cfg.run, cfg.data_path / "cache").run_step(1)
    errors: list[BaseException] = []
    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        defs = build_definitions(str(path))
        instance.add_dynamic_partitions("rl_step", ["step-000001"])
        assert defs.resolve_job_def("rl_step_job").execute_in_process(
            instance=instance, partition_key="step-000001").success
        # Failures with the secrets in play: a bucket that does not exist, an unreachable replica.
        bad = build_definitions(str(path), {"storage": {"root": f"s3://missing-{prefix}/x"}})
        failed = bad.resolve_job_def("rl_step_job").execute_in_process(
            instance=instance, partition_key="step-000001", raise_on_error=False)
        assert not failed.success
        tick = live_tau_sensor(dg.build_sensor_context(instance=instance, sensor_name=LIVE_TAU_SENSOR_NAME,
                                                       definitions=defs, resources=defs.resources))
        events = [str(e) for e in instance.all_logs(failed.run_id)] + [str(tick.asset_events), str(tick.cursor)]
    replica = ReplicaSpec("keyed", "127.0.0.1", free_port(), "policy", api_key_env="REPLICA_API_KEY")
    with pytest.raises(GateError) as gate:
        check_replica(replica, dataclasses.replace(deploy.gate_config(load_config()), ready_timeout_s=0.5), [[1, 2]])
    errors.append(gate.value)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(MlflowException) as unreachable:
        DrafterRegistry(f"http://127.0.0.1:{free_port()}", "secrets", "m")
    errors.append(unreachable.value)

    texts = events + ["".join(traceback.format_exception(e)) for e in errors]
    texts += [r.getMessage() for r in caplog.records] + list(capfd.readouterr())
    registry = DrafterRegistry(mlflow_server, "secrets", "secrets-drafter")
    for run in _runs(registry):
        texts += [json.dumps(run.data.params), json.dumps(run.data.tags)]
    texts += [json.dumps(v.tags) for v in registry.client.search_model_versions("name = 'secrets-drafter'")]
    direct = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    texts += [direct.cat_file(p).decode(errors="replace") for p in direct.find(f"{BUCKET}/{prefix}")
              if p.endswith((".json", ".yaml"))]
    assert len(texts) > 20
    assert [name for name, value in SECRETS.items() if any(value in t for t in texts)] == []
    mlflow_roots = list(tmp_path_factory.getbasetemp().glob("mlflow*"))
    assert _leaks(tmp_path, cfg.warm_path, *mlflow_roots) == []  # the stage workers' logs too


UNSAFE = [
    (r"\bimport pickle\b|\bpickle\.loads?\(|\bcloudpickle\b|\bjoblib\.load\(|\bdill\b", "a pickle loader"),
    (r"torch\.load\((?![^)]*weights_only=True)", "torch.load without weights_only=True"),
    (r"allow_pickle\s*=\s*True", "numpy allow_pickle=True"),
    (r"yaml\.(unsafe_)?load\((?![^)]*Loader=yaml\.SafeLoader)", "yaml.load (not safe_load)"),
    (r"\.extractall\(|shutil\.unpack_archive\(", "archive extraction without a path check"),
    (r"trust_remote_code\s*=\s*True", "trust_remote_code=True"),
]


def test_no_unsafe_loading_in_the_product(reliability) -> None:
    import re

    reliability.security("no pickle loading, torch.load only weights_only=True, no unchecked archive extraction")
    sources = [p for d in ("pipeline", "assets", "resources", "jobs", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    sources += [ROOT / "cli.py", ROOT / "definitions.py"]
    found = [f"{p.relative_to(ROOT)}:{n}: {what}" for p in sources
             for n, line in enumerate(p.read_text().splitlines(), 1) for pattern, what in UNSAFE
             if re.search(pattern, line)]
    assert len(sources) > 20
    assert found == []
