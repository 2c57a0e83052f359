"""The whole configuration: every section, the checks across sections, and the paths the configuration resolves."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.data import CaptureConfig, HiddenStatesConfig, StorageConfig
from pipeline.config.evaluation import EvalConfig, PromotionConfig
from pipeline.config.fleet import FleetConfig
from pipeline.config.launch import LaunchConfig
from pipeline.config.refresh import RefreshConfig
from pipeline.config.section import Section
from pipeline.config.simulation import SimulationConfig
from pipeline.config.target import TargetConfig
from pipeline.config.tracking import MlflowConfig
from pipeline.config.training import DrafterConfig, TrainConfig

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class PipelineConfig(Section):
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
