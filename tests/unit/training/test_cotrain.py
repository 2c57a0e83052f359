"""The training stage's decisions: when to train, and what to start from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.config import TrainConfig, load_config
from pipeline.data.shards import HiddenSample
from pipeline.models.checkpoint import save_drafter
from pipeline.models.drafter import fresh_drafter
from pipeline.models.eagle import EagleDrafter
from pipeline.models.eagle3 import Eagle3Drafter
from pipeline.models.target import build_target, tiny_llama_config
from pipeline.registry import DrafterRegistry
from pipeline.training.cotrain import _initial_drafter
from pipeline.training.plan import TrainingDecision, training_decision


@pytest.mark.parametrize(
    ("cfg", "step", "samples", "trained", "reason"),
    [
        (TrainConfig(), 3, 100, True, "buffer holds 100 samples"),
        (TrainConfig(enable_drafter_training=False), 3, 100, False, "train.enable_drafter_training is false"),
        (TrainConfig(training_interval_steps=2), 3, 100, False, "train.training_interval_steps=2"),
        (TrainConfig(training_interval_steps=2), 4, 100, True, "buffer holds 100 samples"),
        (TrainConfig(min_samples=200), 3, 100, False, "fewer than train.min_samples=200"),
    ],
    ids=["train", "disabled", "off-interval", "on-interval", "too-few"],
)
def test_training_decision(cfg: TrainConfig, step: int, samples: int, trained: bool, reason: str) -> None:
    decision = training_decision(step, samples, cfg)
    assert decision.train is trained
    assert reason in decision.reason


def test_a_retraining_request_overrides_the_interval_only() -> None:
    cfg = TrainConfig(training_interval_steps=5, min_samples=50)
    assert training_decision(3, 100, cfg, "live tau 1.4 < 2.0") == TrainingDecision(
        True, "requested (live tau 1.4 < 2.0); buffer holds 100 samples")
    assert training_decision(3, 10, cfg, "live tau 1.4 < 2.0").train is False
    assert training_decision(3, 100, TrainConfig(enable_drafter_training=False), "x").train is False


@pytest.fixture
def target():
    return build_target(tiny_llama_config(32, 32, 2, 2), 0)


def _hidden(n: int = 4) -> list[HiddenSample]:
    g = torch.Generator().manual_seed(0)
    return [HiddenSample(f"s{i}", 1, torch.randint(0, 32, (10,), generator=g), torch.tensor([0] * 4 + [1] * 6),
                         torch.zeros(10, 4, 32, dtype=torch.bfloat16)) for i in range(n)]


def test_warm_start_from_an_external_eagle3_checkpoint(tmp_path: Path, target) -> None:
    """A checkpoint trained elsewhere, in the `layers.0.` variant, starts the first training."""
    cfg = load_config(overrides={"data_dir": str(tmp_path), "drafter": {"kind": "eagle3", "draft_vocab_size": 24}})
    external = fresh_drafter(cfg.drafter, target, torch.arange(32), seed=5)
    directory = save_drafter(external, tmp_path / "specforge")
    tensors = load_file(directory / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, directory / "model.safetensors")

    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.artifact_root)
    cfg = load_config(overrides={"data_dir": str(tmp_path),
                                 "drafter": {"kind": "eagle3", "warm_start": str(directory)}})
    drafter, origin = _initial_drafter(cfg, registry, None, target, _hidden())
    assert isinstance(drafter, Eagle3Drafter)
    assert origin == f"file:{directory}"
    for key, tensor in external.trainable_state_dict().items():
        assert torch.equal(drafter.trainable_state_dict()[key], tensor), key


def test_warm_start_of_the_wrong_kind_is_refused(tmp_path: Path, target) -> None:
    cfg = load_config(overrides={"data_dir": str(tmp_path), "drafter": {"kind": "eagle"}})
    directory = save_drafter(fresh_drafter(cfg.drafter, target, torch.arange(32), seed=0), tmp_path / "eagle")
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.artifact_root)
    cfg = load_config(overrides={"data_dir": str(tmp_path),
                                 "drafter": {"kind": "eagle3", "warm_start": str(directory)}})
    with pytest.raises(ValueError, match="is not a eagle3 checkpoint"):
        _initial_drafter(cfg, registry, None, target, _hidden())


def test_fresh_eagle3_draft_vocab_counts_response_tokens_only(tmp_path: Path, target) -> None:
    cfg = load_config(overrides={"data_dir": str(tmp_path), "drafter": {"kind": "eagle3", "draft_vocab_size": 3}})
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.artifact_root)
    ids = torch.tensor([9, 9, 9, 9, 1, 2, 3, 1, 2, 1])  # prompt: token 9 four times; response: 1 x3, 2 x2, 3 x1
    sample = HiddenSample("s", 1, ids, torch.tensor([0] * 4 + [1] * 6), torch.zeros(10, 4, 32, dtype=torch.bfloat16))
    drafter, origin = _initial_drafter(cfg, registry, None, target, [sample])
    assert origin is None
    assert drafter.draft_to_target.tolist() == [1, 2, 3]


def test_champion_of_another_kind_is_not_a_warm_start(tmp_path: Path, target) -> None:
    cfg = load_config(overrides={"data_dir": str(tmp_path), "drafter": {"kind": "eagle"}})
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.artifact_root)
    run_id = registry.start_run("r", {})
    version = registry.register(run_id, save_drafter(fresh_drafter(cfg.drafter, target, torch.arange(32), 0),
                                                     tmp_path / "c"), {})
    eagle3 = load_config(overrides={"data_dir": str(tmp_path), "drafter": {"kind": "eagle3"}})
    drafter, origin = _initial_drafter(eagle3, registry, version, target, _hidden())
    assert isinstance(drafter, Eagle3Drafter)
    assert origin is None
    same_kind, origin = _initial_drafter(cfg, registry, version, target, _hidden())
    assert isinstance(same_kind, EagleDrafter)
    assert origin == version
