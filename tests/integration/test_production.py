"""Production configuration, checked without a cluster: the Postgres/k8s Dagster instance, the
training pod built from the pipeline config (validated by dagster-k8s and the kubernetes
client's models), the `gpu` concurrency pool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import kubernetes
import pytest
import yaml
from dagster._core.instance.config import dagster_instance_config
from dagster_k8s import K8sRunLauncher
from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict
from dagster_k8s.pipes import build_pod_body

from definitions import build_definitions
from pipeline.config import ConfigError, load_config
from pipeline.launch.multinode import torchrun_command, training_job_name, training_job_spec, training_service_spec
from pipeline.launch.process import (
    LOOPBACK_NODES_MODULE,
    pod_labels,
    stage_command,
    stage_pod_spec,
    worker_command,
)
from pipeline.launch.rayjob import quantity as ray_quantity
from pipeline.launch.rayjob import ray_stage_job
from pipeline.stages import LAUNCHED, TRAINING

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GPU_ASSETS = {"hidden_states", "drafter", "acceptance"}


def test_production_instance_config_is_valid(tmp_path: Path) -> None:
    shutil.copyfile(DEPLOY / "dagster.yaml", tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path), "dagster.yaml")  # Dagster's own schema check

    assert set(config["storage"]) == {"postgres"}
    assert config["storage"]["postgres"]["postgres_db"]["password"] == {"env": "DAGSTER_PG_PASSWORD"}
    assert config["run_monitoring"]["enabled"] is True
    assert config["run_monitoring"]["start_timeout_seconds"] >= 900  # GPU nodes scale up from zero
    assert config["concurrency"]["pools"]["default_limit"] == 1
    launcher = config["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    checked = dg._config.validate_config(K8sRunLauncher.config_type(), launcher["config"])
    assert checked.success, checked.errors


def test_training_pod_from_the_production_config_is_a_valid_pod() -> None:
    cfg = load_config(DEPLOY / "pipeline.yaml")
    spec = stage_pod_spec(cfg, TRAINING)
    # What PipesK8sClient.run submits: dagster-k8s merges our spec with the Pipes bootstrap
    # environment and builds the kubernetes client's V1Pod (unknown fields are refused).
    pod = build_pod_body(
        pod_name="dagster-drafter-abc123", image=None, command=None,
        env_vars={"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msg"},
        base_pod_meta={"labels": pod_labels(cfg, TRAINING, 42)}, base_pod_spec=spec,
    )
    assert isinstance(pod, kubernetes.client.V1Pod)
    (container,) = pod.spec.containers
    gpus = str(cfg.launch.training.nproc)
    assert container.resources.limits["nvidia.com/gpu"] == gpus == container.resources.requests["nvidia.com/gpu"]
    assert container.command == worker_command(TRAINING.worker, 8, python="python")
    assert container.command[-2:] == ["-m", "pipeline.training.worker"]
    assert "--nproc-per-node=8" in container.command
    assert container.image == cfg.launch.k8s.image
    assert pod.spec.node_selector == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod.spec.tolerations[0].key == "nvidia.com/gpu"
    assert pod.spec.restart_policy == "Never"
    assert pod.spec.service_account_name == "drafter-training"
    assert container.env_from[0].secret_ref.name == "drafter-pipeline-env"
    assert {e.name for e in container.env} == {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES"}
    shm = next(v for v in pod.spec.volumes if v.name == container.volume_mounts[0].name)
    assert (container.volume_mounts[0].mount_path, shm.empty_dir.medium) == ("/dev/shm", "Memory")
    assert pod.metadata.labels["drafter-cotraining/rl-step"] == "42"
    for quantity in (*container.resources.limits.values(), shm.empty_dir.size_limit):
        kubernetes.utils.parse_quantity(quantity)  # raises on anything Kubernetes would reject


def test_one_rank_starts_the_worker_itself_and_several_go_through_torchrun() -> None:
    one, two = (load_config(None, {"launch": {"training": {"nproc": n}}}) for n in (1, 2))
    assert stage_command(one, TRAINING, python="python") == ["python", "-m", "pipeline.training.worker"]
    assert stage_command(two, TRAINING, python="python") == [
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pipeline.training.worker"]
    with pytest.raises(ValueError, match="at least one rank, got 0"):
        worker_command(TRAINING.worker, 0)
    single = stage_pod_spec(load_config(DEPLOY / "pipeline.yaml", {"launch": {"training": {"nproc": 1}}}), TRAINING)
    assert single["containers"][0]["command"] == ["python", "-m", "pipeline.training.worker"]


def _model(model_class: type, manifest: dict):
    """A manifest (camelCase, as applied) as the kubernetes client's model; unknown fields are refused."""
    return k8s_model_from_dict(model_class, k8s_snake_case_dict(model_class, manifest))


@pytest.mark.parametrize("nnodes", [2, 4])
def test_training_on_several_nodes_is_an_indexed_job_behind_a_headless_service(nnodes: int) -> None:
    """The Job and Service of `launch.training.nnodes` nodes x 8 GPUs, checked as the kubernetes client's models
    (unknown fields refused) and as data: one pod per node, the rendezvous at node 0's DNS name."""
    cfg = load_config(DEPLOY / "pipeline.yaml", {"launch": {"training": {"nnodes": nnodes}}})
    name = training_job_name("0f3c2a9e-5b1d-4c55-9a8e-77d0c1e2f3a4")
    env = {"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msg"}
    job = _model(kubernetes.client.V1Job, training_job_spec(cfg, name, 42, env))
    service = _model(kubernetes.client.V1Service, training_service_spec(cfg, name, 42))

    assert len(f"{name}-{nnodes - 1}") <= 63  # a pod's hostname is a DNS label
    spec = job.spec
    assert (spec.completion_mode, spec.completions, spec.parallelism) == ("Indexed", nnodes, nnodes)
    assert spec.backoff_limit == 0  # one failed pod fails the Job; Dagster retries, and resumes
    pod = spec.template.spec
    assert pod.restart_policy == "Never"
    assert pod.subdomain == service.metadata.name == name
    assert service.spec.cluster_ip == "None"  # headless: DNS names of the pods, no virtual IP
    assert service.spec.publish_not_ready_addresses is True
    assert service.spec.selector.items() <= spec.template.metadata.labels.items()
    assert [p.port for p in service.spec.ports] == [cfg.launch.training.rdzv_port]
    (container,) = pod.containers
    assert container.resources.limits["nvidia.com/gpu"] == "8" == container.resources.requests["nvidia.com/gpu"]
    assert container.command == torchrun_command(8, "python", nnodes, f"{name}-0.{name}:29400", name,
                                                 local_addr="$(NODE_ADDR)")
    assert {f"--nnodes={nnodes}", "--nproc-per-node=8", "--rdzv-backend=c10d", "--max-restarts=0",
            f"--rdzv-endpoint={name}-0.{name}:29400"} <= set(container.command)
    env_names = [e.name for e in container.env]
    # NODE_ADDR refers to NODE_INDEX: Kubernetes expands $(VAR) only from variables listed before it
    assert env_names[:2] == ["NODE_INDEX", "NODE_ADDR"]
    assert container.env[0].value_from.field_ref.field_path == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert container.env[1].value == f"{name}-$(NODE_INDEX).{name}"
    assert set(env) <= set(env_names)  # Dagster Pipes' bootstrap reaches every node
    assert pod.node_selector == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert container.env_from[0].secret_ref.name == "drafter-pipeline-env"
    assert spec.template.metadata.labels["drafter-cotraining/rl-step"] == "42"


def test_loopback_nodes_and_their_rendezvous() -> None:
    nodes = load_config(None, {"launch": {"training": {"nnodes": 2}}})
    assert stage_command(nodes, TRAINING, "python") == ["python", "-m", LOOPBACK_NODES_MODULE, "--nnodes=2",
                                                        "--nproc-per-node=1"]
    with pytest.raises(ValueError, match="rendezvous endpoint and id"):
        torchrun_command(1, "python", 2, "", "")
    single_node = load_config(DEPLOY / "pipeline.yaml")
    assert "--standalone" in stage_pod_spec(single_node, TRAINING)["containers"][0]["command"]


def test_k8s_launcher_needs_storage_and_mlflow_the_pod_can_reach(tmp_path: Path) -> None:
    data = yaml.safe_load((DEPLOY / "pipeline.yaml").read_text())
    for override, key in (
        ({"storage": {"root": ""}}, "storage.root on s3://"),
        ({"mlflow": {"tracking_uri": ""}}, "mlflow.tracking_uri of a tracking server"),
        ({"launch": {**data["launch"], "k8s": {**data["launch"]["k8s"], "image": ""}}}, "launch.k8s.image"),
        ({"launch": {**data["launch"], "training": {"memory": "lots"}}}, "memory 'lots' is not a Kubernetes quantity"),
    ):
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml.safe_dump({**data, **override}))
        with pytest.raises(ConfigError, match=key):
            load_config(path)


def test_every_gpu_asset_is_in_the_gpu_pool(tiny_config_path: Path) -> None:
    defs = build_definitions(str(tiny_config_path))
    pools = {key.to_user_string(): defs.resolve_assets_def(key).op.pool for key in defs.resolve_all_asset_keys()}
    assert {name for name, pool in pools.items() if pool == "gpu"} == GPU_ASSETS


@dg.asset(pool="gpu")
def gpu_step() -> int:
    return 1


def test_the_gpu_pool_lets_one_step_run_at_a_time(tmp_path: Path) -> None:
    """The project's dagster.yaml gives the pool one slot: a GPU step waits while another holds it."""
    shutil.copyfile(ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    try:
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)  # what the default limit allocates when the pool is first used
        assert storage.claim_concurrency_slot("gpu", "other-run", "training").is_claimed  # another GPU step
        finished: list[bool] = []
        worker = threading.Thread(
            target=lambda: finished.append(dg.materialize([gpu_step], instance=instance).success), daemon=True)
        worker.start()
        deadline = time.monotonic() + 120
        while storage.get_concurrency_info("gpu").pending_step_count == 0:  # our step queues for the slot
            assert time.monotonic() < deadline, "the GPU step never asked the pool for a slot"
            time.sleep(0.2)
        time.sleep(1)
        assert finished == []  # still waiting: the only slot is held
        assert storage.get_concurrency_info("gpu").active_run_ids == {"other-run"}
        storage.free_concurrency_slot_for_step("other-run", "training")
        worker.join(timeout=120)
        assert finished == [True]
    finally:
        instance.dispose()


# --- launch.launcher: ray (docs/production.md, "Model stages as Ray jobs") -----------------------------------


def _ray_settings() -> dict:
    """The `launch:` settings docs/production.md gives for deploy/raycluster.yaml, as written there."""
    section = (ROOT / "docs" / "production.md").read_text().split("## Model stages as Ray jobs", 1)[1]
    block = re.search(r"```yaml\n(launch:\n.*?)```", section, re.DOTALL)
    assert block, "docs/production.md's Ray section has no `launch:` block"
    return yaml.safe_load(block.group(1))


def test_the_docs_show_the_ray_manifests_as_they_are() -> None:
    production = (ROOT / "docs" / "production.md").read_text()
    for name in ("raycluster.yaml", "ray-slurm.sbatch"):
        assert (DEPLOY / name).read_text() in production, f"docs/production.md's copy of deploy/{name} differs"


def test_every_stage_job_fits_the_kuberay_drafter_node() -> None:
    """deploy/raycluster.yaml as data: its pod templates are the kubernetes client's models, the trainer's RayJob
    targets this cluster, and the drafter group's node holds each stage's Ray job of deploy/pipeline.yaml with the
    docs' `launch.ray` (its CPUs, GPUs, memory and slot): a job that fits no node waits forever, unreported."""
    cluster, trainer = yaml.safe_load_all((DEPLOY / "raycluster.yaml").read_text())
    cfg = load_config(DEPLOY / "pipeline.yaml", _ray_settings())
    assert (cluster["apiVersion"], cluster["kind"], trainer["kind"]) == ("ray.io/v1", "RayCluster", "RayJob")
    assert trainer["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    spec = cluster["spec"]
    for group in (spec["headGroupSpec"], *spec["workerGroupSpecs"]):
        _model(kubernetes.client.V1PodTemplateSpec, group["template"])
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    dashboard = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert cfg.launch.ray.address.endswith(f":{dashboard['dashboard']}")

    (drafter,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "drafter"]
    limits = drafter["template"]["spec"]["containers"][0]["resources"]["limits"]
    custom = json.loads(json.loads(drafter["rayStartParams"]["resources"]))  # KubeRay's quoted JSON
    gpus = int(drafter["rayStartParams"]["num-gpus"])
    assert gpus == int(limits[cfg.launch.k8s.gpu_resource])
    for stage in LAUNCHED:
        job = ray_stage_job(cfg, stage, ROOT)
        assert job.num_gpus <= gpus, stage
        assert job.num_cpus <= ray_quantity(limits["cpu"]), stage
        assert job.memory <= ray_quantity(limits["memory"]), stage
        assert all(custom.get(name, 0) >= amount for name, amount in job.resources.items()), stage
    for group in spec["workerGroupSpecs"]:  # the slot is the drafter node's alone
        assert group is drafter or "resources" not in group["rayStartParams"]


def test_the_slurm_recipe_starts_ray_with_options_this_ray_has() -> None:
    """deploy/ray-slurm.sbatch: valid bash, every `ray start` option one this Ray's CLI takes, the head's node
    holding the docs' slot, its job API at RAY_ADDRESS."""
    recipe = DEPLOY / "ray-slurm.sbatch"
    subprocess.run(["bash", "-n", str(recipe)], check=True)
    script = recipe.read_text().replace("\\\n", " ")
    commands = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    starts = [line.split("ray start", 1)[1] for line in commands if "ray start" in line]
    assert len(starts) == 2  # the head, then every other node
    help_text = subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--help"], capture_output=True,
                               text=True, check=True).stdout
    known = set(re.findall(r"(--[a-z][a-z-]+)", help_text))
    used = {option for start in starts for option in re.findall(r"(--[a-z][a-z-]+)", start)}
    assert used <= known, f"options this Ray's `ray start` does not take: {sorted(used - known)}"
    head = starts[0]
    assert "--head" in head
    assert "--address" in starts[1]
    slot = json.loads(re.search(r"--resources='([^']+)'", head).group(1))
    assert slot == _ray_settings()["launch"]["ray"]["resources"]
    port = re.search(r"--dashboard-port=(\d+)", head).group(1)
    assert f'RAY_ADDRESS="http://$head_ip:{port}"' in script
