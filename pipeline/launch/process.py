"""How a model stage's process is started: its job, its command line and, in production, its pod.

Every stage that runs a model (extraction, training, evaluation, refresh: `pipeline.stages`) runs in a process
of its own, launched through Dagster Pipes as `launch.launcher` says: a subprocess of the Dagster run (or the
stage's warm worker) here, a GPU pod through `PipesK8sClient` in production, each stage with the ranks and
resources of its `launch.<stage>` (what the pods share: `launch.k8s`).

One rank is started as `python -m <worker>` (rank 0 of 1, no torchrun agent: its start-up would
only add a torch import); several as `torchrun --standalone --nproc-per-node=N -m <worker>`; a training on
several nodes as that many torchrun agents on loopback here (`pipeline.launch.multinode`), or as an indexed
Job of pods. All are pure functions of the config, so the Dagster layer and the tests build the same thing.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field, fields

from pipeline.config import PipelineConfig, parse_resolved_config
from pipeline.stages import EXTRACTION, LAUNCHED, TRAINING, Stage

SHM_VOLUME = "dshm"
LOOPBACK_NODES_MODULE = "pipeline.launch.multinode"  # a training's nodes as torchrun agents on this machine


@dataclass(frozen=True)
class StageJob:
    """What a launched extraction, evaluation or refresh process receives (the Pipes extra `job`)."""

    stage: Stage  # extraction | evaluation | refresh
    step: int
    config: dict  # the full PipelineConfig, resolved (a pod may not see the orchestrator's files)
    where: str  # process | pod | ray: where the launcher starts it, for its placement record
    new_version: str | None = None  # evaluation: the drafter version the step's training produced
    spent_s: dict[Stage, float] = field(default_factory=dict)  # evaluation: device-seconds of the earlier stages
    part: int | None = None  # refresh: the qualifying part
    tags: dict[str, str] = field(default_factory=dict)  # refresh: the MLflow tags of its training run

    def to_dict(self) -> dict:
        """The job as JSON (stages by name)."""
        return {"stage": self.stage.name, "step": self.step, "config": self.config, "where": self.where,
                "new_version": self.new_version, "spent_s": {s.name: v for s, v in self.spent_s.items()},
                "part": self.part, "tags": dict(self.tags)}

    @classmethod
    def from_dict(cls, doc: object, stage: Stage | None = None) -> StageJob:
        """The job as `to_dict` wrote it, every field present and of its type (a field left out is refused,
        never taken as a default); `stage`: the stage the reader runs, which the job must name."""
        if not isinstance(doc, dict):
            raise JobError(f"no job: the Pipes extra `job` is a {type(doc).__name__}, not a stage job")
        missing = [f.name for f in fields(cls) if f.name not in doc]
        if missing:
            raise JobError(f"the stage job leaves out {', '.join(missing)}: a stage runs the job it was given, "
                           "never defaults")
        step, part, spent, tags = doc["step"], doc["part"], doc["spent_s"], doc["tags"]
        problems = [
            *([] if doc["stage"] in LAUNCHED_NAMES else
              [f"stage {doc['stage']!r} is not one of {', '.join(LAUNCHED_NAMES)}"]),
            *([] if stage is None or doc["stage"] == stage.name else [f"it is a {doc['stage']} job, sent to {stage}"]),
            *([] if _is_int(step) and step >= 0 else ["step must be an integer >= 0"]),
            *([] if isinstance(doc["config"], dict) else ["config must be a mapping"]),
            *([] if doc["where"] in ("process", "pod", "ray") else ["where must be process, pod or ray"]),
            *([] if doc["new_version"] is None or isinstance(doc["new_version"], str) else
              ["new_version must be a string or null"]),
            *([] if isinstance(spent, dict) and all(k in LAUNCHED_NAMES and _is_seconds(v)
                                                    for k, v in spent.items()) else
              ["spent_s must map stages to seconds"]),
            *([] if part is None or (_is_int(part) and part >= 0) else ["part must be an integer >= 0 or null"]),
            *([] if isinstance(tags, dict) and all(isinstance(v, str) for v in tags.values()) else
              ["tags must map names to strings"]),
        ]
        if problems:
            raise JobError(f"the stage job is malformed: {'; '.join(problems)}")
        return cls(LAUNCHED_NAMES[doc["stage"]], step, dict(doc["config"]), doc["where"], doc["new_version"],
                   {LAUNCHED_NAMES[k]: float(v) for k, v in spent.items()}, part,
                   {str(k): v for k, v in tags.items()})

    @functools.cached_property
    def pipeline_config(self) -> PipelineConfig:
        """The job's configuration, parsed at its first use and kept with the job."""
        return parse_resolved_config(self.config, f"the {self.stage} job of step {self.step}")


class JobError(ValueError):
    """A stage's job that is not one (no job, a field left out or mistyped): refused before any work."""


LAUNCHED_NAMES = {s.name: s for s in LAUNCHED}


def _is_seconds(value: object) -> bool:
    """A finite, non-negative number; float() raises OverflowError on an integer of hundreds of digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return 0 <= float(value) < math.inf
    except OverflowError:
        return False


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stage_ranks(cfg: PipelineConfig, stage: Stage) -> int:
    """The ranks of a stage on one node (a training's: on each of its `launch.training.nnodes`)."""
    return cfg.launch.of(stage).nproc


def worker_command(module: str, nproc: int, python: str = sys.executable) -> list[str]:
    """The command of a stage's worker on one machine or in one pod: itself for one rank, torchrun for several."""
    if nproc < 1:
        raise ValueError(f"a stage needs at least one rank, got {nproc}")
    if nproc == 1:
        return [python, "-m", module]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", module]


def stage_command(cfg: PipelineConfig, stage: Stage, python: str = sys.executable) -> list[str]:
    """The stage's command on this machine; a training on several nodes: their loopback stand-ins."""
    nproc = stage_ranks(cfg, stage)
    if stage == TRAINING and cfg.launch.training.nnodes > 1:
        return [python, "-m", LOOPBACK_NODES_MODULE, f"--nnodes={cfg.launch.training.nnodes}",
                f"--nproc-per-node={nproc}"]
    return worker_command(stage.worker, nproc, python)


def pod_labels(cfg: PipelineConfig, stage: Stage, step: int) -> dict[str, str]:
    return {"app.kubernetes.io/name": stage.app, "drafter-cotraining/run": cfg.run,
            "drafter-cotraining/rl-step": str(step), "drafter-cotraining/stage": stage.name}


def pod_spec(cfg: PipelineConfig, stage: Stage, command: list[str]) -> dict:
    """The PodSpec (camelCase, as in a manifest) of one stage's pod: one GPU per rank (extraction and
    evaluation: `target.split_devices` per rank for a split policy), the stage's CPU and
    memory, `command`, /dev/shm in memory (NCCL's shared-memory transport needs more than the container
    runtime's 64 MB), secrets from the Secret `launch.k8s.env_secret` by reference, never inline."""
    k8s, settings = cfg.launch.k8s, cfg.launch.of(stage)
    if not k8s.image:
        raise ValueError(f"launch.k8s.image is empty: the {stage} pod needs an image with this project installed")
    per_rank = cfg.target.gpus_per_process if stage.policy_per_rank else 1  # a split policy: a block per rank
    amounts = {"cpu": settings.cpu, "memory": settings.memory, k8s.gpu_resource: str(settings.nproc * per_rank)}
    container: dict = {
        "name": stage.container,
        "image": k8s.image,
        "command": command,
        # Extended resources (GPUs) need request == limit; cpu and memory get the same for a Guaranteed pod.
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
    }
    if k8s.env_secret:
        container["envFrom"] = [{"secretRef": {"name": k8s.env_secret}}]
    volumes = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}}]
    if stage == EXTRACTION:  # e.g. the shared volume vLLM's connector writes its files to
        container["volumeMounts"] += [dict(m) for m in cfg.launch.extraction.volume_mounts]
        volumes += [dict(v) for v in cfg.launch.extraction.volumes]
    spec: dict = {
        "restartPolicy": "Never",  # a failed stage is retried by Dagster
        "containers": [container],
        "volumes": volumes,
    }
    if k8s.node_selector:
        spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        spec["tolerations"] = [dict(t) for t in k8s.tolerations]
    if k8s.service_account:
        spec["serviceAccountName"] = k8s.service_account
    return spec


def stage_pod_spec(cfg: PipelineConfig, stage: Stage) -> dict:
    """The pod of one node of a stage: `pod_spec` with the stage's worker command."""
    return pod_spec(cfg, stage, worker_command(stage.worker, stage_ranks(cfg, stage), python="python"))
