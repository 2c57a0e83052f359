"""Starting a model stage (extraction, training, evaluation, refresh) as its own process(es) through Dagster
Pipes: the commands and pods come from `pipeline.launch.process` (and `pipeline.launch.multinode` for several
nodes), a Ray job's from `pipeline.launch.rayjob`, a one-rank stage's warm worker from `resources.warm`."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from pipeline.config import PipelineConfig
from pipeline.launch.multinode import (
    NODE_INDEX_ANNOTATION,
    training_job_name,
    training_job_spec,
    training_service_spec,
)
from pipeline.launch.process import StageJob, pod_labels, stage_command, stage_pod_spec, stage_ranks
from pipeline.launch.rayjob import cluster_token, ray_stage_job
from pipeline.launch.warm import WarmWorker
from pipeline.stages import TRAINING, Stage
from pipeline.training.plan import TrainJob
from resources.pipes_messages import PipesWholeLineTempFileMessageReader
from resources.warm import PipesWarmClient

POD_START_TIMEOUT_S = 1800  # node 0's pod: a GPU node scaling up from zero, then a multi-GB image pull


class StageLauncher:
    """Every model stage through one launcher (`launch.launcher`): a subprocess of this run (`subprocess`:
    the worker itself for one rank, torchrun for several; a training on several nodes as loopback nodes), the
    stage's warm worker for one rank and a subprocess for several (`warm`), a GPU pod (`k8s`, through
    `PipesK8sClient`), or for a training on several nodes an indexed Job of `launch.training.nnodes` GPU pods
    (`k8s`), which need dagster-k8s; or a Ray job on the cluster of `launch.ray` (`ray`, through dagster-ray's
    `PipesRayJobClient`)."""

    def __init__(self, cfg: PipelineConfig, working_dir: Path, mlflow_ui_url: str) -> None:
        self.cfg, self.working_dir, self.mlflow_ui_url = cfg, working_dir, mlflow_ui_url
        self.launch = cfg.launch

    @property
    def where(self) -> str:
        """Where a stage runs: `pod`, `ray` (a Ray job) or `process` (a subprocess of the Dagster run)."""
        return {"k8s": "pod", "ray": "ray"}.get(self.launch.launcher, "process")

    def stage_job(self, stage: Stage, step: int, **fields: object) -> StageJob:
        return StageJob(stage, step, self.cfg.model_dump(mode="json"), self.where, **fields)

    def prestart(self, stages: list[Stage]) -> list[Stage]:
        """Start the warm workers of `stages` now, one after the other (those that run on one, under
        `launch.launcher: warm`), so their first jobs find them listening; returns the stages started or found."""
        if self.launch.launcher != "warm":
            return []
        started = [stage for stage in stages if self.ranks(stage) == 1]
        for stage in started:
            WarmWorker(stage, self.cfg.warm_path, self.working_dir, self.launch.warm_idle_s).prestart()
        return started

    def ranks(self, stage: Stage) -> int:
        """The ranks a stage's job runs on: a training's on every node."""
        return stage_ranks(self.cfg, stage) * (self.launch.training.nnodes if stage == TRAINING else 1)

    def run_stage(self, context: dg.AssetExecutionContext, job: StageJob) -> dg.PipesClientCompletedInvocation:
        """Extraction, evaluation or refresh: the stage's worker with its ranks, reporting back over Pipes."""
        with self._retried():
            return self._run(context, job.stage, job.step, {"job": job.to_dict()},
                             f"launching {job.stage} ({self.where}, {self.ranks(job.stage)} rank(s))")

    def train(self, context: dg.AssetExecutionContext, job: TrainJob) -> dg.PipesClientCompletedInvocation:
        extras = {"job": job.to_dict(), "mlflow_ui_url": self.mlflow_ui_url, "where": self.where}
        with self._retried():
            if self.launch.launcher == "k8s" and self.launch.training.nnodes > 1:
                with _quiet_preview():
                    return _run_indexed_job(context, self.cfg, job, extras)
            return self._run(context, TRAINING, job.step, extras)

    @contextmanager
    def _retried(self) -> Iterator[None]:
        """A launched stage that failed, as Dagster's retry of its step (`launch.retries`): what failed there (a
        rank killed, a node or pod lost) may not fail again, and the failed attempt committed nothing."""
        try:
            yield
        except Exception as error:
            if not self.launch.retries:
                raise
            raise dg.RetryRequested(max_retries=self.launch.retries,
                                    seconds_to_wait=self.launch.retry_delay_s) from error

    def _run(self, context: dg.AssetExecutionContext, stage: Stage, step: int, extras: dict,
             announce: str = "") -> dg.PipesClientCompletedInvocation:
        """`announce`, a line for the run's log, is logged before the launch, or on a warm worker once the job
        is handed over (while it works, not on the step's time)."""
        warm = self.launch.launcher == "warm" and self.ranks(stage) == 1
        if announce and not warm:
            context.log.info(announce)
        with _quiet_preview():
            if self.launch.launcher == "k8s":
                from dagster_k8s import PipesK8sClient  # only deployments that launch pods install dagster-k8s

                return PipesK8sClient().run(
                    context=context, extras=extras, namespace=self.launch.k8s.namespace or None,
                    base_pod_meta={"labels": pod_labels(self.cfg, stage, step)},
                    base_pod_spec=stage_pod_spec(self.cfg, stage),
                )
            if self.launch.launcher == "ray":
                from resources.ray_jobs import PipesRayStageClient  # only deployments on Ray import dagster-ray

                job = ray_stage_job(self.cfg, stage, self.working_dir)
                return PipesRayStageClient(self.launch.ray.address, cluster_token(self.launch.ray)).run(
                    context=context, extras=extras, submit_job_params=job.submit_params())
            if warm:
                return PipesWarmClient(stage, self.cfg.warm_path, self.working_dir,
                                       self.launch.warm_idle_s).run(context=context, extras=extras,
                                                                    announce=announce)
            return dg.PipesSubprocessClient(cwd=str(self.working_dir),
                                            message_reader=PipesWholeLineTempFileMessageReader()).run(
                context=context, extras=extras, command=stage_command(self.cfg, stage))


@contextmanager
def _quiet_preview() -> Iterator[None]:
    with warnings.catch_warnings():
        # Dagster's Pipes clients call a preview API of Dagster's own: nothing a user can act on.
        warnings.filterwarnings("ignore", message=".*expected_writer_count", category=dg.PreviewWarning)
        yield


def _run_indexed_job(
    context: dg.AssetExecutionContext, cfg: PipelineConfig, job: TrainJob, extras: dict
) -> dg.PipesClientCompletedInvocation:
    """A training on several nodes: the headless Service and the indexed Job of `pipeline.launch.multinode`,
    Pipes' context in every pod's environment and its messages read from node 0's log (rank 0's),
    as `PipesK8sClient` reads its one pod's. The Job and Service are deleted however it ends."""
    import kubernetes
    from dagster_k8s.client import DagsterKubernetesClient, WaitForPodState
    from dagster_k8s.pipes import PipesK8sPodLogsMessageReader
    from dagster_k8s.utils import detect_current_namespace

    kubernetes.config.load_incluster_config() if _in_cluster() else kubernetes.config.load_kube_config()
    client = DagsterKubernetesClient.production_client()
    reader = PipesK8sPodLogsMessageReader()
    namespace = cfg.launch.k8s.namespace or detect_current_namespace(None) or "default"
    name = training_job_name(context.run_id)
    with dg.open_pipes_session(context=context, extras=extras, context_injector=dg.PipesEnvContextInjector(),
                               message_reader=reader) as session:
        client.core_api.create_namespaced_service(namespace, training_service_spec(cfg, name, job.step))
        try:
            client.batch_api.create_namespaced_job(
                namespace, training_job_spec(cfg, name, job.step, session.get_bootstrap_env_vars()))
            node0 = _node_zero_pod(client, name, namespace)
            client.wait_for_pod(node0, namespace, wait_for_state=WaitForPodState.Ready,
                                wait_timeout=POD_START_TIMEOUT_S)
            reader.consume_pod_logs(context=context, core_api=client.core_api, pod_name=node0, namespace=namespace)
            # raises on failure
            client.wait_for_job_success(name, namespace, num_pods_to_wait_for=cfg.launch.training.nnodes)
        finally:
            client.batch_api.delete_namespaced_job(name, namespace, propagation_policy="Foreground")
            client.core_api.delete_namespaced_service(name, namespace)
    return dg.PipesClientCompletedInvocation(session)


def _in_cluster() -> bool:
    return bool(os.getenv("KUBERNETES_SERVICE_HOST"))


def _node_zero_pod(client, job_name: str, namespace: str, timeout_s: float = POD_START_TIMEOUT_S) -> str:
    """The name of the Job's pod of completion index 0 (node 0, which runs rank 0), once it exists."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pod in client.get_pods_in_job(job_name, namespace):
            if (pod.metadata.annotations or {}).get(NODE_INDEX_ANNOTATION) == "0":
                return pod.metadata.name
        time.sleep(2)
    raise TimeoutError(f"no pod of index 0 for Job {job_name} in namespace {namespace} after {timeout_s} s")
