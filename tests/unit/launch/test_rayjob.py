"""A stage's Ray job (`launch.launcher: ray`) as data: its entrypoint, what it asks the cluster for, where its code
is; the wait a queued stage records; the `launch.ray` keys' validation."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import ConfigError, RayConfig, load_config
from pipeline.launch import raygroup
from pipeline.launch.placement import SUBMITTED_AT_ENV
from pipeline.launch.rayjob import RayAuthError, cluster_token, quantity, ray_stage_job
from pipeline.stages import EVALUATION, EXTRACTION, LAUNCHED, REFRESH, TRAINING

PROJECT = Path("/srv/drafter")
CUDA = {"device": "cuda", "launch": {"launcher": "ray", "ray": {"resources": {"drafter_slot": 1}},
                                     "extraction": {"nproc": 2, "cpu": "12", "memory": "96Gi"},
                                     "training": {"nproc": 4, "cpu": "500m", "memory": "512Mi"}}}


@pytest.mark.parametrize(("value", "number"), [("8", 8.0), ("500m", 0.5), ("1.5", 1.5), ("64Gi", 64 * 2**30),
                                               ("2G", 2e9), ("512Mi", 512 * 2**20)])
def test_quantities_are_the_numbers_kubernetes_reads(value: str, number: float) -> None:
    assert quantity(value) == number


def test_a_stage_asks_for_its_cpus_memory_a_gpu_per_rank_and_the_slot() -> None:
    cfg = load_config(overrides=CUDA)
    extraction, training = ray_stage_job(cfg, EXTRACTION, PROJECT, "/venv/bin/python"), ray_stage_job(
        cfg, TRAINING, PROJECT, "/venv/bin/python")
    assert (extraction.num_cpus, extraction.num_gpus, extraction.memory) == (12.0, 2.0, 96 * 2**30)
    assert (training.num_cpus, training.num_gpus, training.memory) == (0.5, 4.0, 512 * 2**20)
    assert extraction.entrypoint == ("cd /srv/drafter && exec /venv/bin/python -m torch.distributed.run "
                                     "--standalone --nproc-per-node=2 -m pipeline.sources.worker")
    assert extraction.runtime_env == {}  # the cluster shares the filesystem: nothing uploaded
    params = training.submit_params()
    assert params["entrypoint_resources"] == {"drafter_slot": 1.0}
    assert params["entrypoint_num_gpus"] == 4.0
    params["runtime_env"]["env_vars"]["X"] = "1"  # the Pipes client adds its variables to its own copy
    assert training.submit_params()["runtime_env"] == {"env_vars": {}}


def test_a_split_policy_asks_for_its_block_per_rank_and_cpu_for_no_gpu() -> None:
    split = load_config(overrides={**CUDA, "target": {"split": "layers", "split_devices": 4}})
    assert [ray_stage_job(split, s, PROJECT).num_gpus for s in (EXTRACTION, TRAINING, EVALUATION, REFRESH)] == [
        8.0, 4.0, 4.0, 4.0]  # extraction: 2 ranks x 4; training: a GPU per rank; evaluation, refresh: one rank
    cpu = load_config(overrides={"launch": {"launcher": "ray"}})
    assert {ray_stage_job(cpu, s, PROJECT).num_gpus for s in LAUNCHED} == {0.0}
    assert "entrypoint_resources" not in ray_stage_job(cpu, EXTRACTION, PROJECT).submit_params()


def test_a_remote_cluster_gets_the_working_dir_and_runs_its_own_python() -> None:
    cfg = load_config(overrides={"launch": {"launcher": "ray", "ray": {"working_dir": "s3://code/drafter.zip"}}})
    job = ray_stage_job(cfg, EVALUATION, PROJECT, "/venv/bin/python")
    assert shlex.split(job.entrypoint) == ["python", "-m", "pipeline.evaluation.worker"]
    assert job.runtime_env == {"working_dir": "s3://code/drafter.zip"}


def test_a_training_on_several_nodes_is_a_placement_group_whose_driver_asks_for_nothing() -> None:
    """Two nodes of four ranks: the job's driver holds no resources (the group's bundles do), each bundle one node's
    CPUs, memory, a GPU per rank and the slot, placed as `launch.ray.placement_strategy` says; every agent runs
    torchrun's c10d rendezvous for eight ranks, its local address filled in on its node."""
    launch = {**CUDA["launch"], "training": {**CUDA["launch"]["training"], "nnodes": 2},
              "ray": {"resources": {"drafter_slot": 1}, "placement_strategy": "PACK"}}
    cfg = load_config(overrides={**CUDA, "launch": launch})
    job = ray_stage_job(cfg, TRAINING, PROJECT, "/venv/bin/python")
    assert (job.num_cpus, job.num_gpus, job.memory, job.resources) == (0.0, 0.0, 0, {})
    cd, driver = job.entrypoint.split(" && exec ")
    assert cd == "cd /srv/drafter"
    args = dict(arg.split("=", 1) for arg in shlex.split(driver)[3:])
    assert shlex.split(driver)[:3] == ["/venv/bin/python", "-m", raygroup.MODULE]
    group = raygroup.NodeGroup(int(args["--nnodes"]), int(args["--nproc-per-node"]), json.loads(args["--bundle"]),
                               args["--strategy"])
    assert group == raygroup.NodeGroup(2, 4, {"CPU": 0.5, "memory": 512 * 2**20, "GPU": 4, "drafter_slot": 1.0},
                                       "PACK")
    assert args["--cwd"] == "/srv/drafter"
    assert group.task_options() == {"num_cpus": 0.5, "num_gpus": 4, "memory": 512 * 2**20,
                                    "resources": {"drafter_slot": 1.0}}
    remote = load_config(overrides={"launch": {"launcher": "ray", "training": {"nnodes": 3},
                                               "ray": {"working_dir": "s3://code/drafter.zip"}}})
    job = ray_stage_job(remote, TRAINING, PROJECT, "/venv/bin/python")
    assert shlex.split(job.entrypoint)[:3] == ["python", "-m", raygroup.MODULE]
    assert "--cwd=" in shlex.split(job.entrypoint)  # each agent in its own node's copy of the working_dir


@pytest.mark.parametrize(("nnodes", "nproc", "strategy", "message"), [
    (1, 2, "PACK", "several nodes"), (2, 0, "PACK", "several nodes"), (2, 1, "ANYWHERE", "placement strategy")])
def test_a_node_group_is_several_nodes_placed_by_a_strategy_ray_has(nnodes: int, nproc: int, strategy: str,
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        raygroup.NodeGroup(nnodes, nproc, {"CPU": 1}, strategy)


def test_the_ray_env_vars_reach_every_stages_job() -> None:
    cfg = load_config(overrides={"launch": {"launcher": "ray", "ray": {"env_vars": {"NCCL_SOCKET_IFNAME": "eth0"}}}})
    params = ray_stage_job(cfg, TRAINING, PROJECT).submit_params()
    assert params["runtime_env"] == {"env_vars": {"NCCL_SOCKET_IFNAME": "eth0"}}
    params["runtime_env"]["env_vars"]["X"] = "1"  # the Pipes client's, on its own copy
    assert cfg.launch.ray.env_vars == {"NCCL_SOCKET_IFNAME": "eth0"}


@pytest.mark.parametrize(("overrides", "message"), [
    pytest.param({"launch": {"ray": {"resources": {"GPU": 1}}}}, "launch.ray.resources", id="builtin-resource",
                 marks=pytest.mark.reliability("bad_input", "launch.ray.resources naming CPU, GPU or memory")),
    pytest.param({"launch": {"ray": {"resources": {"drafter_slot": 0}}}}, "launch.ray.resources", id="zero-slot",
                 marks=pytest.mark.reliability("bad_input", "launch.ray.resources with an amount <= 0")),
    pytest.param({"launch": {"ray": {"placement_strategy": "ANYWHERE"}}}, "launch.ray.placement_strategy",
                 id="strategy", marks=pytest.mark.reliability("bad_input", "a placement strategy Ray does not have")),
    pytest.param({"launch": {"ray": {"env_vars": {"AWS_SECRET_ACCESS_KEY": "hunter2", "HF_HOME": "/hf"}}}},
                 r"launch.ray.env_vars must not carry secrets \(AWS_SECRET_ACCESS_KEY\)", id="secret-env",
                 marks=pytest.mark.reliability("bad_input", "a secret in launch.ray.env_vars, which whoever lists "
                                                            "the cluster's jobs would read")),
])
def test_ray_settings_are_validated_with_the_key_named(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(overrides=overrides)
    assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize(("name", "value", "message"), [
    pytest.param("MLFLOW_TRACKING_URI", "https://ops:hunter2@mlflow.example.com", r"user:password@",
                 id="url-userinfo"),
    pytest.param("DATABASE_URL", "postgresql://drafter:hunter2@db:5432/mlflow", r"user:password@", id="database-url"),
    pytest.param("DATABASE_URL", "postgresql://db:5432/mlflow?sslmode=require&password=hunter2",
                 r"credentials \(password=\.\.\.\)", id="database-url-query"),
    pytest.param("HTTPS_PROXY", "http://ops:hunter2@proxy.internal:3128", r"user:password@", id="proxy"),
    pytest.param("BLOB_STORE", "DefaultEndpointsProtocol=https;AccountName=drafter;AccountKey=hunter2==",
                 r"credentials \(AccountKey=\.\.\.\)", id="connection-string"),
    pytest.param("AZURE_STORAGE_CONNECTION_STRING", "AccountName=drafter",
                 r"secrets \(AZURE_STORAGE_CONNECTION_STRING\)", id="connection-string-name"),
    pytest.param("DB_PASS", "hunter2", r"secrets \(DB_PASS\)", id="pass-name"),
    pytest.param("ARTIFACTS", "s3://bucket/a s3://bucket/b#hunter2", r"a fragment", id="url-in-a-list"),
])
def test_a_secret_in_a_ray_env_var_is_refused_by_its_value_too(name: str, value: str, message: str,
                                                                reliability) -> None:
    """Whatever the variable is called, a URL with a password, a query string or fragment that could hold a
    token, or a connection string's key is refused at load, naming the variable and never the value: whoever
    lists the cluster's jobs reads their runtime environment."""
    reliability.bad_input("a secret in the value of a launch.ray.env_vars variable (a URL's user:password@, "
                          "a token in its query, a connection string's key), whatever its name")
    with pytest.raises(ConfigError, match=f"launch.ray.env_vars.*{message}") as refused:
        load_config(overrides={"launch": {"ray": {"env_vars": {name: value}}}})
    assert name in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_ray_env_vars_without_secrets_still_load() -> None:
    env = {"MLFLOW_TRACKING_URI": "https://mlflow.example.com", "NO_PROXY": "localhost,10.0.0.0/8",
           "HTTPS_PROXY": "http://proxy.internal:3128", "PYTHONPATH": "/srv/a:/srv/b", "NCCL_SOCKET_IFNAME": "eth0",
           "DATABASE_URL": "postgresql://db:5432/mlflow?sslmode=require"}
    assert load_config(overrides={"launch": {"ray": {"env_vars": env}}}).launch.ray.env_vars == env


def _waited_in_child(submitted: str) -> subprocess.CompletedProcess:
    code = "from pipeline.launch.placement import waited_s; print(waited_s())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, SUBMITTED_AT_ENV: submitted},
                          capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[3])


def test_a_queued_process_records_the_wait_from_its_submission_to_its_start() -> None:
    """A process started 2 s after its submission waited 2 s (plus its own spawn), whatever its imports took; to
    Linux's resolution of a process's start, a clock tick."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    started = time.time()
    child = _waited_in_child(repr(started - 2.0))
    ended = time.time()
    assert child.returncode == 0, child.stderr
    assert 2.0 - tick <= float(child.stdout) <= 2.0 + (ended - started)
    bad = _waited_in_child("yesterday")
    assert bad.returncode != 0
    assert f"{SUBMITTED_AT_ENV} is 'yesterday'" in bad.stderr


# -- the cluster's token ------------------------------------------------------------------------------------------

TOKEN = "c2f1e0d9b8a7"


def _token_file(folder: Path, mode: int = 0o600) -> Path:
    path = folder / "auth_token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


def test_the_launcher_sends_the_token_of_its_file_or_of_rays_own_places(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`launch.ray.token_file` first; unset, where Ray's own clients look: RAY_AUTH_TOKEN, then the file
    RAY_AUTH_TOKEN_PATH names, then ~/.ray/auth_token."""
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    _token_file(tmp_path / ".ray")
    assert cluster_token(RayConfig()) == TOKEN
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(_token_file(tmp_path)))
    assert cluster_token(RayConfig()) == TOKEN
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-the-environment")
    assert cluster_token(RayConfig()) == "from-the-environment"
    assert cluster_token(RayConfig(token_file=str(tmp_path / "auth_token"))) == TOKEN


@pytest.mark.parametrize("case", ["missing", "group-readable", "symlink", "empty"])
def test_a_token_that_is_missing_or_not_this_users_alone_is_refused_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, reliability) -> None:
    """The launcher submits nothing without a token (a cluster that takes jobs without one runs anyone's code),
    nor with one from a file others can read or that a symlink points to: the message names the file and the
    setting, never the token."""
    reliability.security("a Ray cluster token missing, or in a file others can read (or a symlink): the launcher "
                         "refuses to submit, naming the file, never the token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    path = tmp_path / "auth_token"
    if case == "group-readable":
        _token_file(tmp_path, 0o640)
    elif case == "symlink":
        (tmp_path / "real").mkdir()
        path.symlink_to(_token_file(tmp_path / "real"))
    elif case == "empty":
        path.write_text("")
        path.chmod(0o600)
    message = {"missing": "does not exist", "group-readable": "mode 0640", "symlink": "never a symlink",
               "empty": "is empty"}[case]
    with pytest.raises(RayAuthError, match=message) as refused:
        cluster_token(RayConfig(token_file=str(path)))
    assert str(path) in str(refused.value)
    assert "launch.ray.token_file" in str(refused.value)
    assert TOKEN not in str(refused.value)
