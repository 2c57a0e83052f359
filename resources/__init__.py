"""Dagster resources: thin, typed adapters that build the domain objects of `pipeline/`.

All of them are built from one `PipelineConfig` (see `build_resources`), so the YAML
config stays the single source of truth. Secrets are read from the environment only.
"""

import json
import os
import warnings
from pathlib import Path

import dagster as dg
from pydantic import Field

from pipeline.config import PROJECT_ROOT, PipelineConfig, load_config
from pipeline.data.store import ObjectStore, storage_options_for
from pipeline.data.uris import UriPolicy
from pipeline.registry import DrafterRegistry
from pipeline.sources.simulation import SimulatedRL
from pipeline.training.cotrain import TrainJob
from pipeline.training.launch import pod_labels, train_command, training_pod_spec


class PipelineConfigResource(dg.ConfigurableResource):
    """The pipeline's YAML config (embedded defaults when `config_path` is empty)."""

    config_path: str = Field(default="", description="YAML file merged over pipeline/defaults.yaml.")
    overrides_json: str = Field(default="", description="JSON mapping merged last (e.g. the CLI's --drafter).")

    def load(self) -> PipelineConfig:
        return load_config(self.config_path or None, json.loads(self.overrides_json) if self.overrides_json else None)


class ObjectStoreResource(dg.ConfigurableResource):
    """Object storage for rollouts, hidden-state shards, buffer manifests and acceptance records."""

    root: str = Field(description="Root URI: file:///... or s3://bucket/prefix.")
    endpoint_url: str = Field(default="", description="S3-compatible endpoint; AWS when empty.")
    region: str = Field(default="", description="S3 region.")
    checkpoint_prefixes: list[str] = Field(default=[], description="Allowed checkpoint_uri prefixes.")
    allow_http_checkpoints: bool = Field(default=False, description="checkpoint_uri may be http(s).")

    def store(self) -> ObjectStore:
        # Credentials come from the standard AWS environment variables, never from config.
        return ObjectStore(self.root, storage_options_for(self.root, self.endpoint_url, self.region),
                           UriPolicy(tuple(self.checkpoint_prefixes), self.allow_http_checkpoints))


class MlflowResource(dg.ConfigurableResource):
    """MLflow tracking and model registry (a token, if any, comes from MLFLOW_TRACKING_TOKEN)."""

    tracking_uri: str = Field(description="MLflow tracking URI (sqlite:///... or http://...).")
    experiment: str = Field(description="Experiment that holds one run per drafter training.")
    model_name: str = Field(description="Registered model of the drafter.")
    artifact_root: str = Field(default="", description="Artifact location for a new experiment.")
    ui_url: str = Field(default="http://127.0.0.1:5000", description="MLflow UI base URL, for links.")

    def registry(self) -> DrafterRegistry:
        return DrafterRegistry(self.tracking_uri, self.experiment, self.model_name, self.artifact_root or None)


class TrainingLauncherResource(dg.ConfigurableResource):
    """Starts the drafter training as its own process through Dagster Pipes: torchrun (for one
    process, the worker itself) on this machine (`train.launcher: subprocess`) or a GPU pod
    (`train.launcher: k8s`, needs dagster-k8s)."""

    working_dir: str = Field(default=str(PROJECT_ROOT),
                             description="Where the training process starts (the project root).")

    def launch(
        self, context: dg.AssetExecutionContext, cfg: PipelineConfig, job: TrainJob, mlflow_ui_url: str
    ) -> dg.PipesClientCompletedInvocation:
        extras = {"job": job.to_dict(), "mlflow_ui_url": mlflow_ui_url}
        with warnings.catch_warnings():
            # Dagster's Pipes clients call a preview API of Dagster's own: nothing a user can act on.
            warnings.filterwarnings("ignore", message=".*expected_writer_count", category=dg.PreviewWarning)
            if cfg.train.launcher == "k8s":
                from dagster_k8s import PipesK8sClient  # only deployments that launch pods install dagster-k8s

                return PipesK8sClient().run(
                    context=context, extras=extras, namespace=cfg.train.k8s.namespace or None,
                    base_pod_meta={"labels": pod_labels(cfg, job.step)}, base_pod_spec=training_pod_spec(cfg),
                )
            return dg.PipesSubprocessClient(cwd=self.working_dir).run(
                context=context, extras=extras, command=train_command(cfg.train.nproc_per_node)
            )


class RolloutSourceResource(dg.ConfigurableResource):
    """Where RL steps come from: the built-in simulated RL source or an external trainer."""

    kind: str = Field(description="`simulated` or `external`.")
    cache_dir: str = Field(description="Cache of expensive simulation artefacts (the pre-trained target).")

    def simulator(self, cfg: PipelineConfig, store: ObjectStore) -> SimulatedRL:
        if self.kind != "simulated":
            raise ValueError(f"rollout_source is {self.kind!r}: steps come from an external RL trainer")
        return SimulatedRL(cfg.simulation, store, cfg.run, Path(self.cache_dir))


def build_resources(
    config_path: str | None = None, overrides: dict | None = None
) -> dict[str, dg.ConfigurableResource]:
    cfg = load_config(config_path, overrides)
    return {
        "settings": PipelineConfigResource(
            config_path=config_path or os.environ.get("DRAFTER_PIPELINE_CONFIG", ""),
            overrides_json=json.dumps(overrides) if overrides else "",
        ),
        "object_store": ObjectStoreResource(
            root=cfg.storage_root, endpoint_url=cfg.storage.endpoint_url, region=cfg.storage.region,
            checkpoint_prefixes=cfg.storage.checkpoint_prefixes,
            allow_http_checkpoints=cfg.storage.allow_http_checkpoints,
        ),
        "mlflow": MlflowResource(
            tracking_uri=cfg.tracking_uri,
            experiment=cfg.mlflow.experiment,
            model_name=cfg.mlflow.model_name,
            artifact_root=cfg.artifact_root,
            # A tracking server serves its own UI; the embedded SQLite store is shown by `make ui` on :5000.
            ui_url=os.environ.get("MLFLOW_UI_URL") or (
                cfg.tracking_uri if cfg.tracking_uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
            ),
        ),
        "trainer": TrainingLauncherResource(),
        "rollout_source": RolloutSourceResource(kind=cfg.rollout_source, cache_dir=str(cfg.data_path / "cache")),
    }
