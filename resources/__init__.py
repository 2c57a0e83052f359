"""The Dagster layer's one resource: the pipeline configuration, read once per run, and the
domain objects built from it (object store, drafter registry, the stages' launcher, simulator).

The YAML file is read when a run (or a sensor tick) starts, never when the code location
loads: a run sees one configuration from its first asset to its last, and an edited file
takes effect at the next run without reloading the code location. Secrets come from the
environment only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
from pydantic import Field, PrivateAttr

from pipeline.config import CONFIG_ENV, PROJECT_ROOT, PipelineConfig, load_config
from pipeline.data.store import ObjectStore, open_store
from pipeline.registry import DrafterRegistry, open_registry
from resources.launcher import StageLauncher

if TYPE_CHECKING:
    from pipeline.sources.simulation import SimulatedRL

EMBEDDED_MLFLOW_UI = "http://127.0.0.1:5000"  # `make ui` serves the embedded SQLite store here


class PipelineResource(dg.ConfigurableResource):
    """The pipeline's YAML config (embedded defaults when `config_path` is empty) and what it names."""

    config_path: str = Field(default="", description="YAML file merged over pipeline/defaults.yaml.")
    overrides_json: str = Field(default="", description="JSON mapping merged last (e.g. the CLI's --drafter).")
    working_dir: str = Field(default=str(PROJECT_ROOT),
                             description="Where a training process starts (the project root).")
    _config: PipelineConfig | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._config = self._load()

    def _load(self) -> PipelineConfig:
        return load_config(self.config_path or None, json.loads(self.overrides_json) if self.overrides_json else None)

    @property
    def config(self) -> PipelineConfig:
        if self._config is None:  # used outside a run (a direct call): read now, and keep it
            self._config = self._load()
        return self._config

    def store(self) -> ObjectStore:
        return open_store(self.config)

    def registry(self) -> DrafterRegistry:
        return open_registry(self.config)

    @property
    def mlflow_ui_url(self) -> str:
        """MLflow UI base URL, for links: a tracking server serves its own UI."""
        tracking = self.config.tracking_uri
        return os.environ.get("MLFLOW_UI_URL") or (
            tracking if tracking.startswith(("http://", "https://")) else EMBEDDED_MLFLOW_UI)

    def launcher(self) -> StageLauncher:
        return StageLauncher(self.config, Path(self.working_dir), self.mlflow_ui_url)

    def simulator(self) -> SimulatedRL:
        """The built-in simulated RL trainer (`rollout_source: simulated`); its model code is imported only
        by the run that simulates."""
        from pipeline.sources.simulation import SimulatedRL

        cfg = self.config
        if cfg.rollout_source != "simulated":
            raise ValueError(f"rollout_source is {cfg.rollout_source!r}: steps come from an external RL trainer")
        engine = None
        if cfg.fleet.driver != "none":  # the fleet generates the rollouts, each step's policy pushed to it first
            from pipeline.serving.deploy import rollout_fleet

            engine = rollout_fleet(cfg, self.store()).engine()
        return SimulatedRL(cfg.simulation, self.store(), cfg.run, cfg.data_path / "cache", engine)


def pipeline_resource(config_path: str | None = None, overrides: dict | None = None) -> PipelineResource:
    """The resource of a code location: `config_path`, else $DRAFTER_PIPELINE_CONFIG, else the defaults."""
    return PipelineResource(config_path=config_path or os.environ.get(CONFIG_ENV, ""),
                            overrides_json=json.dumps(overrides) if overrides else "")
