"""`mlflow`: where training runs and the registered drafter versions are tracked."""

from __future__ import annotations

from pydantic import Field, field_validator

from pipeline.config.section import TRACKING_QUERY_NAMES, Section, no_credentials


class MlflowConfig(Section):
    tracking_uri: str = Field(default="", description="MLflow tracking URI; SQLite under data_dir when empty.")
    experiment: str = Field(default="drafter-cotraining", description="MLflow experiment name.")
    model_name: str = Field(default="eagle-drafter", description="Registered model name of the drafter.")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return no_credentials(value, "mlflow.tracking_uri", TRACKING_QUERY_NAMES)
