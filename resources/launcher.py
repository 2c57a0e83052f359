"""Starting the drafter training as its own process through Dagster Pipes."""

from __future__ import annotations

import warnings
from pathlib import Path

import dagster as dg

from pipeline.config import PipelineConfig
from pipeline.training.launch import pod_labels, train_command, training_pod_spec
from pipeline.training.plan import TrainJob


class TrainingLauncher:
    """torchrun (for one process, the worker itself) on this machine (`train.launcher: subprocess`)
    or a GPU pod (`train.launcher: k8s`, needs dagster-k8s)."""

    def __init__(self, cfg: PipelineConfig, working_dir: Path, mlflow_ui_url: str) -> None:
        self.cfg, self.working_dir, self.mlflow_ui_url = cfg, working_dir, mlflow_ui_url

    def launch(self, context: dg.AssetExecutionContext, job: TrainJob) -> dg.PipesClientCompletedInvocation:
        cfg = self.cfg
        extras = {"job": job.to_dict(), "mlflow_ui_url": self.mlflow_ui_url}
        with warnings.catch_warnings():
            # Dagster's Pipes clients call a preview API of Dagster's own: nothing a user can act on.
            warnings.filterwarnings("ignore", message=".*expected_writer_count", category=dg.PreviewWarning)
            if cfg.train.launcher == "k8s":
                from dagster_k8s import PipesK8sClient  # only deployments that launch pods install dagster-k8s

                return PipesK8sClient().run(
                    context=context, extras=extras, namespace=cfg.train.k8s.namespace or None,
                    base_pod_meta={"labels": pod_labels(cfg, job.step)}, base_pod_spec=training_pod_spec(cfg),
                )
            return dg.PipesSubprocessClient(cwd=str(self.working_dir)).run(
                context=context, extras=extras, command=train_command(cfg.train.nproc_per_node)
            )
