"""MLflow: one run per drafter training, every drafter a registered model version.

Aliases, not stages:
    challenger  the newest evaluated drafter
    champion    the drafter that serves (moved by policy or by a person)
    baseline    the first drafter ever registered: the never-retrained reference
    live        the version the serving fleet runs (set by the deploy job)
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.config import PipelineConfig

if TYPE_CHECKING:
    from pipeline.models.drafter import Drafter

ARTIFACT_PATH = "drafter"
ALIASES = ("challenger", "champion", "baseline", "live")


class MetricsBatcher:
    """A `MetricsSink` that sends per-iteration metrics to MLflow in batches."""

    def __init__(self, client: MlflowClient, run_id: str, flush_every: int = 200) -> None:
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self._pending: list[Metric] = []

    def log_dict(self, payload: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, step) for k, v in payload.items()]
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        for start in range(0, len(self._pending), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=self._pending[start : start + 1000])
        self._pending = []

    def log_missing(self, records: list[tuple[int, dict[str, float]]]) -> None:
        """Send the records the run lacks, per metric: a process killed after its checkpoint committed
        and before its records were sent left them out, and none may be logged twice."""
        logged: dict[str, int] = {}
        for _, payload in records:
            for key in payload.keys() - logged.keys():
                logged[key] = max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=-1)
        for step, payload in records:
            missing = {k: v for k, v in payload.items() if step > logged[k]}
            if missing:
                self.log_dict(missing, step)
        self.flush()


class DrafterRegistry:
    def __init__(self, tracking_uri: str, experiment: str, model_name: str, artifact_root: str | None = None) -> None:
        if tracking_uri.startswith("sqlite:///"):
            Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.tracking_uri, self.model_name = tracking_uri, model_name
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=artifact_root or None
        )
        try:
            self.client.get_registered_model(model_name)
        except MlflowException:
            self.client.create_registered_model(model_name, description="EAGLE drafter co-trained with the RL policy")

    # -- runs
    def start_run(self, run_name: str, tags: dict[str, str]) -> str:
        return self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id

    def reopen_run(self, run_id: str, tags: dict[str, str]) -> None:
        """Mark a run of an interrupted training running again, tagged with the attempt that continues it."""
        self.set_run_tags(run_id, tags)
        self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
    def unfinished_run(self, tags: dict[str, str]) -> str | None:
        """The newest run carrying all `tags` that never finished (its process was killed or failed)."""
        query = " and ".join([*(f"tags.`{k}` = '{v}'" for k, v in tags.items()), "attributes.status != 'FINISHED'"])
        runs = self.client.search_runs([self.experiment_id], filter_string=query, order_by=["start_time DESC"],
                                       max_results=1)
        return runs[0].info.run_id if runs else None

    def run_finished(self, run_id: str) -> bool:
        return self.client.get_run(run_id).info.status == RunStatus.to_string(RunStatus.FINISHED)

    def log_params(self, run_id: str, params: dict[str, object]) -> None:
        # A resumed run keeps the params its first attempt logged (MLflow refuses to change them);
        # the rest go in batches, not one request each (each is a round trip to a tracking server).
        logged = self.client.get_run(run_id).data.params
        items = [Param(key, str(value)) for key, value in params.items() if key not in logged]
        for start in range(0, len(items), 100):  # MLflow's batch limit for params
            self.client.log_batch(run_id, params=items[start : start + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        sink = MetricsBatcher(self.client, run_id)
        sink.log_dict(metrics, step)
        sink.flush()

    def set_run_tags(self, run_id: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)

    def end_run(self, run_id: str, ok: bool = True) -> None:
        status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
        self.client.set_terminated(run_id, status=status)

    def run_url(self, run_id: str, ui_base: str) -> str:
        return f"{ui_base.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"

    def version_url(self, version: str, ui_base: str) -> str:
        return f"{ui_base.rstrip('/')}/#/models/{self.model_name}/versions/{version}"

    # -- model versions
    def register(self, run_id: str, checkpoint_dir: Path, tags: dict[str, str], description: str = "",
                 identity: str | None = None) -> str:
        """Log the checkpoint directory as the run's artifacts and register it as a version: one version per
        `tags[identity]` (per run when `identity` is None), however many processes register it at once.

        A version of that identity registered already is returned as it is, nothing logged. Otherwise this
        registrant creates one and settles (`_settle`): registrants that raced past that check all agree on
        one version and remove the others."""
        where = f"tags.`{identity}` = '{tags[identity]}'" if identity else f"run_id = '{run_id}'"
        found = self._versions(where)
        if found:
            return str(min(found))
        self.client.log_artifacts(run_id, str(checkpoint_dir), ARTIFACT_PATH)
        source = f"{self.client.get_run(run_id).info.artifact_uri}/{ARTIFACT_PATH}"
        self.client.create_model_version(self.model_name, source=source, run_id=run_id, tags=tags,
                                         description=description or None)
        return self._settle(where)

    def _versions(self, where: str) -> list[int]:
        return [int(v.version) for v in self.client.search_model_versions(f"name = '{self.model_name}' and {where}")]

    def _settle(self, where: str) -> str:
        """The lowest version matching `where` is the one; the others are deleted.

        MLflow numbers a model's versions in creation order (the next is one more than the highest ever
        created, in the transaction that creates it, tags included), so a registrant that created version
        v sees every matching version below v: each concurrent registrant finds the same lowest one, and
        the others' versions go, whoever deletes them first. This also removes the second version a client
        retry creates when the server's answer to the first was lost."""
        first, *extra = sorted(self._versions(where))
        for version in extra:
            with suppress(MlflowException):  # another registrant deleted it first
                self.client.delete_model_version(self.model_name, str(version))
        return str(first)

    def find_version(self, tags: dict[str, str]) -> str | None:
        """The newest version carrying all `tags`."""
        query = " and ".join([f"name = '{self.model_name}'", *(f"tags.`{k}` = '{v}'" for k, v in tags.items())])
        versions = self.client.search_model_versions(query)
        return str(max(int(v.version) for v in versions)) if versions else None

    def set_version_tags(self, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.model_name, version, key, value)

    def set_alias(self, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(self.model_name, alias, version)

    def alias_version(self, alias: str) -> str | None:
        try:
            return str(self.client.get_model_version_by_alias(self.model_name, alias).version)
        except MlflowException:
            return None

    def version_tags(self, version: str) -> dict[str, str]:
        return dict(self.client.get_model_version(self.model_name, version).tags)

    def download(self, version: str, directory: Path) -> Path:
        """The version's checkpoint directory, copied to `directory/drafter` (where replicas read it).

        Only a version whose source is its run's `drafter` artifact directory is fetched, file by file,
        and only files whose paths stay inside `directory`: a version registered from elsewhere, or an
        artifact listing with `..` or absolute paths, is refused before anything is written."""
        mv = self.client.get_model_version(self.model_name, version)
        where = f"model {self.model_name} version {version}"
        expected = f"{self.client.get_run(mv.run_id).info.artifact_uri}/{ARTIFACT_PATH}"
        if mv.source.rstrip("/") != expected:
            raise ArtifactPathError(f"{where}: source {mv.source!r} is outside its run's artifact root "
                                    f"{expected!r}; refusing to download it")
        files = self._artifact_files(mv.run_id, ARTIFACT_PATH, where)
        root = directory.resolve()
        for path in files:
            if not (root / path).resolve().is_relative_to(root):
                raise ArtifactPathError(f"{where}: artifact {path!r} would be written outside {root}")
        from pipeline.models.checkpoint import share_as_umask_allows  # torch: only where checkpoints are read

        directory.mkdir(parents=True, exist_ok=True)
        for path in files:
            local = Path(self.client.download_artifacts(mv.run_id, path, str(directory / Path(path).parent)))
            share_as_umask_allows(local)  # a version logged by a writer that made its weights owner-only
        return directory / ARTIFACT_PATH

    def _artifact_files(self, run_id: str, path: str, where: str) -> list[str]:
        files = []
        for info in self.client.list_artifacts(run_id, path):
            relative = check_artifact_path(info.path, where)
            if not relative.startswith(f"{path}/"):
                raise ArtifactPathError(f"{where}: artifact {info.path!r} is not under {path}/")
            files += self._artifact_files(run_id, relative, where) if info.is_dir else [relative]
        return files

    def load(self, version: str) -> Drafter:
        """Download a version's checkpoint directory and load it (safetensors only): in the processes that
        run models, never in the orchestrator's."""
        from pipeline.models.checkpoint import load_drafter

        with tempfile.TemporaryDirectory() as tmp:
            return load_drafter(self.download(version, Path(tmp)))


class ArtifactPathError(ValueError):
    """A registry artifact that would be read from, or written to, outside where it belongs."""


def check_artifact_path(path: str, where: str) -> str:
    """`path` if it is relative and has no `..`: artifact listings come from a server we do not control."""
    parts = path.replace("\\", "/").split("/")
    if path.startswith(("/", "\\")) or "://" in path or (len(path) > 1 and path[1] == ":") or ".." in parts:
        raise ArtifactPathError(f"{where}: artifact path {path!r} points outside the artifact root")
    return path


def open_registry(cfg: PipelineConfig) -> DrafterRegistry:
    """The drafter registry a pipeline config names (its MLflow tracking server and registered model)."""
    return DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.artifact_root)


def register_warm_start(registry: DrafterRegistry, cfg: PipelineConfig) -> str:
    """`drafter.warm_start` as the run's first version, before any step: the `baseline` (the never-retrained
    drafter), the `champion` the fleet serves from the first step on, and the `challenger` until a step trains
    one; an alias already set stays. Once per run and checkpoint: a second call finds the version (its identity
    is the run and the weights' SHA-256). The checkpoint is loaded where models run (training, evaluation);
    here only its files are checked."""
    directory = Path(cfg.drafter.warm_start)
    missing = [name for name in ("config.json", "model.safetensors") if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"drafter.warm_start {directory}: no {' or '.join(missing)} (an EAGLE checkpoint "
                                "as vLLM loads it)")
    digest = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    tags = {"pipeline_run": cfg.run, "origin": "drafter.warm_start", "warm_start": str(directory),
            "input_id": f"warm-start:{cfg.run}:{digest[:16]}", "drafter_kind": cfg.drafter.kind}
    version = registry.find_version({"input_id": tags["input_id"]})
    if version is None:
        run_id = registry.start_run("warm start", tags)
        version = registry.register(run_id, directory, tags, identity="input_id",
                                    description=f"drafter.warm_start {directory} of run {cfg.run}, as given: "
                                                "trained before the run, never on its steps.")
        registry.end_run(run_id)
    for alias in ("baseline", "champion", "challenger"):
        if registry.alias_version(alias) is None:
            registry.set_alias(alias, version)
    return version
