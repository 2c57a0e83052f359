"""`launch`: how every model stage's process starts (a subprocess, a warm worker, a Kubernetes pod, a Ray job), its
ranks, CPU and memory; what the pods share and the Ray cluster the jobs go to."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from pipeline.config.section import TRACKING_QUERY_NAMES, Section, no_credentials
from pipeline.stages import Stage

_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")


class K8sConfig(Section):
    """What every stage's pod shares under `launch.launcher: k8s` (its CPU and memory are the stage's own)."""

    image: str = Field(default="", description="Container image with this project installed (required for k8s).")
    namespace: str = Field(default="", description="Namespace of the pods; the orchestrator's own when empty.")
    service_account: str = Field(default="", description="Service account of the pods (e.g. one with S3 access).")
    gpu_resource: str = Field(default="nvidia.com/gpu", description="Extended resource name of one GPU.")
    shm_size: str = Field(default="16Gi", description="Size of /dev/shm (NCCL and data loading need more than 64M).")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods must match (e.g. the GPU node pool)."
    )
    tolerations: list[dict[str, str]] = Field(
        default_factory=list, description="Pod tolerations, e.g. for the nvidia.com/gpu taint of GPU nodes."
    )
    env_secret: str = Field(
        default="", description="Secret whose keys become the pods' environment (AWS_*, MLFLOW_TRACKING_TOKEN)."
    )

    @field_validator("shm_size")
    @classmethod
    def _quantity(cls, value: str) -> str:
        return _quantity(value, "launch.k8s.shm_size")


def _quantity(value: str, key: str) -> str:
    if not _QUANTITY.fullmatch(value):
        raise ValueError(f"{key} {value!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
    return value


_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASS|CREDENTIAL|PRIVATE|SIGNATURE|CONNECTION_STRING|(^|_)(KEY|DSN)($|_)")
# A `name=value` pair inside a value whose name holds a secret: a connection string's AccountKey=, Password=,
# SharedAccessSignature=, a URL's ?sig= or &token=.
_SECRET_PAIR = re.compile(r"(?:^|[;&?\s])([A-Za-z_]*(?:KEY|SECRET|TOKEN|PASS|PWD|SIGNATURE|SIG|CREDENTIAL)[A-Za-z_]*)=",
                          re.IGNORECASE)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
_ENV_VARS_FIX = ("a job's runtime environment is visible to whoever can list the cluster's jobs; give it to the "
                 "nodes' environment")


def _no_secret_in_env_value(name: str, value: str) -> None:
    """A variable's value checked as a configured URI is (`no_credentials`): whatever its name, a URL in it
    carries no user:password@, no query string but connection settings, no fragment, and no `name=value` pair
    names a secret. The message names the variable, never the value."""
    where = f"launch.ray.env_vars.{name}"
    pair = _SECRET_PAIR.search(value)
    if pair:
        raise ValueError(f"{where} must not carry credentials ({pair.group(1)}=...); {_ENV_VARS_FIX}")
    for url in _URL.findall(value):
        no_credentials(url.rstrip(",;"), where, TRACKING_QUERY_NAMES, fix=_ENV_VARS_FIX)


class RayConfig(Section):
    """The Ray cluster every model stage is submitted to as a Ray job under `launch.launcher: ray`."""

    address: str = Field(
        default="", description="The cluster's dashboard (job submission) address, e.g. http://head:8265; "
                                "`RAY_ADDRESS` when empty.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources every stage's job asks for besides its CPUs, GPUs and memory, e.g. "
                    "{drafter_slot: 1}, a slot an RL trainer sharing the cluster leaves free: a job waits for it, "
                    "never preempts.")
    working_dir: str = Field(
        default="",
        description="Empty: the cluster shares this machine's filesystem (a cluster on it, or nodes that mount "
                    "the project at the same path) and a stage runs this process's Python in its project "
                    "directory; otherwise the Ray runtime_env working_dir of a remote cluster (a local folder Ray "
                    "uploads, or a zip's URI) run with the nodes' `python`.")
    placement_strategy: Literal["STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"] = Field(
        default="STRICT_SPREAD",
        description="A training on `launch.training.nnodes` > 1: Ray's strategy for its placement group of one "
                    "bundle per node (`launch.training`'s CPUs, memory and GPUs, and `resources`): STRICT_SPREAD "
                    "puts every bundle on a node of its own, as pods; PACK fills as few nodes as fit them.")
    token_file: str = Field(
        default="",
        description="The file holding the token the cluster requires (Ray's token authentication, "
                    "RAY_AUTH_MODE=token), this user's alone (mode 0600): every request to its job API carries it. "
                    "Empty: where Ray's own clients look, RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH names, "
                    "then ~/.ray/auth_token. The token itself never goes in the config.")
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables every stage's job gets (its runtime_env `env_vars`) over the nodes' "
                    "own, e.g. {NCCL_SOCKET_IFNAME: eth0}. Never a secret, by name or in a value (a URL's "
                    "user:password@, a token in its query, a connection string's key): whoever can list the "
                    "cluster's jobs reads them; secrets come from the nodes' environment.")

    @field_validator("env_vars")
    @classmethod
    def _no_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        secret = sorted(name for name in value if _SECRET_NAME.search(name.upper()))
        if secret:
            raise ValueError(f"launch.ray.env_vars must not carry secrets ({', '.join(secret)}): a job's runtime "
                             "environment is visible to whoever can list the cluster's jobs; give them to the "
                             "nodes' environment")
        for name, text in value.items():
            _no_secret_in_env_value(name, text)
        return value

    @field_validator("resources")
    @classmethod
    def _amounts(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {name: amount for name, amount in value.items() if amount <= 0 or name in ("CPU", "GPU", "memory")}
        if bad:
            raise ValueError(f"launch.ray.resources {bad} must be custom resources with amounts > 0: a stage's "
                             "CPU, GPU and memory come from launch.<stage>")
        return value


class PodConfig(Section):
    """A launched stage's pod (or Ray job): its CPU and memory (requests = limits: a Guaranteed pod)."""

    cpu: str = Field(default="8", description="CPU request (and limit) of the stage's pod; its Ray job's CPUs.")
    memory: str = Field(default="64Gi", description="Memory request (and limit) of the stage's pod, its Ray job's "
                                                    "memory: the policy is loaded there (its weights, in "
                                                    "`target.dtype`, plus batches).")

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, value: str, info: ValidationInfo) -> str:
        return _quantity(value, info.field_name)


class StageLaunchConfig(PodConfig):
    """A model stage's ranks and its pod."""

    nproc: int = Field(default=1, ge=1, description="Ranks of the stage (torchrun --nproc-per-node); in a pod, "
                                                    "one GPU each.")


class ExtractionLaunchConfig(StageLaunchConfig):
    """The `hidden_states` stage's process (or pod): the step's policy runs forward there."""

    volumes: list[dict[str, Any]] = Field(
        default_factory=list, description="Volumes of the extraction pod (Kubernetes objects), e.g. the "
                                          "shared volume vLLM's connector writes `hidden_states.vllm_path` to.")
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, description="Where the extraction pod's container mounts `launch.extraction.volumes`.")


class TrainingLaunchConfig(StageLaunchConfig):
    """The drafter training's processes: `nproc` per node (one per GPU) on `nnodes` nodes."""

    nnodes: int = Field(
        default=1, ge=1,
        description="Nodes of the training (torchrun --nnodes, c10d rendezvous); world size = nnodes x nproc.",
    )
    rdzv_port: int = Field(
        default=29400, ge=1, le=65535, description="Port of the c10d rendezvous on node 0 when nnodes > 1."
    )


class RefreshLaunchConfig(PodConfig):
    """The same-step refresh's process: one rank."""

    @property
    def nproc(self) -> int:
        return 1


class LaunchConfig(Section):
    """How every model stage's process starts, through Dagster Pipes (pipeline/launch/)."""

    launcher: Literal["subprocess", "warm", "k8s", "ray"] = Field(
        default="warm",
        description="`subprocess`: a process per stage (torchrun for several ranks) on the orchestrator's machine; "
                    "`warm`: a one-rank stage on its stage's long-lived worker there, several ranks as `subprocess`; "
                    "`k8s`: a GPU pod; `ray`: a Ray job on the cluster of `launch.ray` (Dagster Pipes all four).",
    )
    warm_idle_s: float = Field(
        default=300.0, gt=0,
        description="`launcher: warm`: a stage's worker exits after this many seconds without a job.",
    )
    warm_dir: str = Field(
        default="",
        description="`launcher: warm`: the folder of the stage workers' sockets, locks and logs (`<data_dir>/stages` "
                    "when empty). Pipelines on one machine that name the same folder share their stages' workers: a "
                    "job carries its own configuration, and a worker serves any.",
    )
    retries: int = Field(
        default=1, ge=0,
        description="Times Dagster retries a model stage whose launched process(es) failed (a rank killed, a node or "
                    "pod lost), after `retry_delay_s`: a training resumes from its last checkpoint, and a failed "
                    "attempt has committed nothing. A worker's own error (bad input) fails each attempt alike.",
    )
    retry_delay_s: float = Field(default=10.0, ge=0, description="Seconds before a model stage's retry.")
    k8s: K8sConfig = Field(default_factory=K8sConfig, description="What the stages' pods share (`launcher: k8s`).")
    ray: RayConfig = Field(default_factory=RayConfig,
                           description="The cluster of the stages' Ray jobs (`launcher: ray`).")
    extraction: ExtractionLaunchConfig = Field(default_factory=ExtractionLaunchConfig,
                                               description="The extraction stage's ranks and pod.")
    training: TrainingLaunchConfig = Field(default_factory=TrainingLaunchConfig,
                                           description="The training's ranks per node, nodes and pods.")
    evaluation: StageLaunchConfig = Field(default_factory=StageLaunchConfig,
                                          description="The evaluation stage's ranks and pod.")
    refresh: RefreshLaunchConfig = Field(default_factory=RefreshLaunchConfig, description="The refresh's pod.")

    def of(self, stage: Stage) -> StageLaunchConfig | RefreshLaunchConfig:
        """The launch settings of a launched stage."""
        if not stage.launched:
            raise ValueError(f"the {stage} stage runs in the Dagster run: it has no launch settings")
        return getattr(self, stage.name)
