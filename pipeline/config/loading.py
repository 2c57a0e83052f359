"""Loading the configuration: `pipeline/defaults.yaml`, a user file over it, overrides over both, validated; the
errors name the key (a key that moved: the key that replaced it), never a value."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.config.pipeline import PipelineConfig

DEFAULTS_PATH = Path(__file__).parents[1] / "defaults.yaml"
CONFIG_ENV = "DRAFTER_PIPELINE_CONFIG"


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
