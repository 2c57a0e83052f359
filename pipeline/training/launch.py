"""How a drafter training process is started: its command line and, in production, its pod.

Both are pure functions of the pipeline config, so the Dagster layer (which hands them to
`PipesSubprocessClient` or `PipesK8sClient`) and the tests build exactly the same thing.

    orchestrator (Dagster step)                 training process(es)
    drafter asset ── Pipes ──> torchrun --nproc-per-node=N -m pipeline.training.worker
                                 ├── rank 0: trains its share, reports back through Pipes, registers
                                 └── rank 1..N-1: train their shares (DDP)
    (N = 1: `python -m pipeline.training.worker`, no torchrun agent in between)
"""

from __future__ import annotations

import sys

from pipeline.config import PipelineConfig

TRAIN_MODULE = "pipeline.training.worker"
CONTAINER_NAME = "trainer"
SHM_VOLUME = "dshm"


def torchrun_command(nproc_per_node: int, python: str = sys.executable) -> list[str]:
    """`torchrun --standalone`: one node, a rendezvous on a free local port (so parallel
    trainings on one machine never collide), one worker process per GPU."""
    if nproc_per_node < 1:
        raise ValueError(f"train.nproc_per_node must be >= 1, got {nproc_per_node}")
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
            "-m", TRAIN_MODULE]


def train_command(nproc_per_node: int, python: str = sys.executable) -> list[str]:
    """The training process's command line: torchrun for several ranks; one process is started
    directly, as rank 0 of 1, because torchrun's agent would only add its own start-up (about
    3.5 CPU seconds importing torch) and a process between Dagster and the training."""
    if nproc_per_node == 1:
        return [python, "-m", TRAIN_MODULE]
    return torchrun_command(nproc_per_node, python)


def pod_labels(cfg: PipelineConfig, step: int) -> dict[str, str]:
    return {"app.kubernetes.io/name": "drafter-training", "drafter-cotraining/run": cfg.run,
            "drafter-cotraining/rl-step": str(step)}


def training_pod_spec(cfg: PipelineConfig) -> dict:
    """The PodSpec (camelCase, as in a manifest) of one training pod: `nproc_per_node` GPUs,
    torchrun as the command (`train_command`), /dev/shm in memory (NCCL's shared-memory transport needs more
    than the container runtime's 64 MB), secrets from a Secret, never inline."""
    k8s, nproc = cfg.train.k8s, cfg.train.nproc_per_node
    if not k8s.image:
        raise ValueError("train.k8s.image is empty: the training pod needs an image with this project installed")
    amounts = {"cpu": k8s.cpu, "memory": k8s.memory, k8s.gpu_resource: str(nproc)}
    container: dict = {
        "name": CONTAINER_NAME,
        "image": k8s.image,
        "command": train_command(nproc, python="python"),
        # Extended resources (GPUs) need request == limit; cpu and memory get the same for a Guaranteed pod.
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
    }
    if k8s.env_secret:
        container["envFrom"] = [{"secretRef": {"name": k8s.env_secret}}]
    spec: dict = {
        "restartPolicy": "Never",  # a failed training is retried by Dagster, which then resumes it
        "containers": [container],
        "volumes": [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}}],
    }
    if k8s.node_selector:
        spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        spec["tolerations"] = [dict(t) for t in k8s.tolerations]
    if k8s.service_account:
        spec["serviceAccountName"] = k8s.service_account
    return spec
