"""One typed configuration for the whole pipeline.

Loaded from YAML (`pipeline/defaults.yaml` ships the embedded defaults; a user file
given by `--config` or `$DRAFTER_PIPELINE_CONFIG` is merged over it). Dagster
resources and run config are built from this object, never from a second source.

Keys under `train` mirror FastRL's `speculative.train` where FastRL has them.
Secrets never live here: they come from the environment (see `resources/`).

One module per section group (launch, training, data, tracking, target, evaluation, fleet,
simulation, refresh), the whole in `pipeline.py`, its loading in `loading.py`; the names
every caller uses are imported from here.
"""

from pipeline.config.data import CaptureConfig, HiddenStatesConfig, StorageConfig
from pipeline.config.evaluation import EvalConfig, PromotionConfig, SamplingConfig
from pipeline.config.fleet import FleetConfig, ReplicaConfig, VllmServerConfig
from pipeline.config.launch import (
    ExtractionLaunchConfig,
    K8sConfig,
    LaunchConfig,
    PodConfig,
    RayConfig,
    RefreshLaunchConfig,
    StageLaunchConfig,
    TrainingLaunchConfig,
)
from pipeline.config.loading import (
    CONFIG_ENV,
    DEFAULTS_PATH,
    ConfigError,
    load_config,
    parse_config,
    parse_resolved_config,
)
from pipeline.config.pipeline import PROJECT_ROOT, PipelineConfig
from pipeline.config.refresh import RefreshConfig
from pipeline.config.simulation import SimulationConfig
from pipeline.config.target import TargetConfig
from pipeline.config.tracking import MlflowConfig
from pipeline.config.training import DrafterConfig, OptimConfig, ScheduleConfig, TrainConfig

__all__ = [
    "CONFIG_ENV",
    "DEFAULTS_PATH",
    "PROJECT_ROOT",
    "CaptureConfig",
    "ConfigError",
    "DrafterConfig",
    "EvalConfig",
    "ExtractionLaunchConfig",
    "FleetConfig",
    "HiddenStatesConfig",
    "K8sConfig",
    "LaunchConfig",
    "MlflowConfig",
    "OptimConfig",
    "PipelineConfig",
    "PodConfig",
    "PromotionConfig",
    "RayConfig",
    "RefreshConfig",
    "RefreshLaunchConfig",
    "ReplicaConfig",
    "SamplingConfig",
    "ScheduleConfig",
    "SimulationConfig",
    "StageLaunchConfig",
    "StorageConfig",
    "TargetConfig",
    "TrainConfig",
    "TrainingLaunchConfig",
    "VllmServerConfig",
    "load_config",
    "parse_config",
    "parse_resolved_config",
]
