"""A registered drafter as the pipeline leaves one, for tests that read the registry (the MLflow UI tests):
a training run named by its RL step, a version with the pipeline's tags, the `champion` alias. Each such
test registers its own, so it passes run alone (`pytest -m ui`, one node id) as in the whole suite."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from pipeline.models.checkpoint import save_drafter
from pipeline.models.eagle import EagleConfig, EagleDrafter
from pipeline.registry import DrafterRegistry

TINY = EagleConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)


def register_champion(tracking_uri: str, experiment: str, model: str, step: int) -> str:
    """A tiny drafter trained "at" `step` (on steps step-1 and step), registered and promoted; its version.
    Registering it again returns the same version (one per input identity)."""
    registry = DrafterRegistry(tracking_uri, experiment, model)
    input_id = f"{experiment}-{model}-step-{step}"
    version = registry.find_version({"input_id": input_id})
    if version is None:
        torch.manual_seed(step)
        run_id = registry.start_run(f"drafter-step-{step:06d}", {"rl_step": str(step)})
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = save_drafter(EagleDrafter(TINY), Path(tmp) / "drafter")
            tags = {"rl_step": str(step), "trained_on_steps": json.dumps([max(step - 1, 1), step]),
                    "train_samples": "96", "input_id": input_id, "drafter_kind": "eagle"}
            version = registry.register(run_id, checkpoint, tags, identity="input_id")
        registry.end_run(run_id)
        registry.set_version_tags(version, {"tau": "2.50"})
    registry.set_alias("champion", version)
    return version
