"""The training stage's decisions: when to train, and what to start from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.config import OptimConfig, TrainConfig, load_config
from pipeline.data.shard_format import HiddenSample
from pipeline.models.checkpoint import save_drafter
from pipeline.models.drafter import fresh_drafter
from pipeline.models.eagle import EagleDrafter
from pipeline.models.eagle3 import Eagle3Drafter
from pipeline.models.peagle import PEagleDrafter
from pipeline.registry import DrafterRegistry
from pipeline.training.cotrain import _initial_drafter, training_settings
from pipeline.training.plan import TrainingDecision, training_decision
from tests.support.targets import tiny_target


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
    return tiny_target(32, 32, 2, 2)


def _hidden(n: int = 4) -> list[HiddenSample]:
    g = torch.Generator().manual_seed(0)
    return [HiddenSample(f"s{i}", 1, torch.randint(0, 32, (10,), generator=g), torch.tensor([0] * 4 + [1] * 6),
                         torch.zeros(10, 4, 32, dtype=torch.bfloat16)) for i in range(n)]


@pytest.mark.parametrize(("warm_start", "warm_start_epochs", "warm_start_lr", "epochs", "lr"), [
    (None, 3, 6e-3, 20, 3e-3),  # a fresh drafter trains train.epochs at train.optim.lr
    ("4", 3, 6e-3, 3, 6e-3),  # the champion's successor catches up in train.warm_start_epochs, at a higher rate
    ("file:/drafters/x", 3, 6e-3, 3, 6e-3),  # drafter.warm_start is a warm start too
    ("4", 0, 0.0, 20, 3e-3),  # 0: train.epochs and train.optim.lr for every training
    ("4", 40, 6e-3, 20, 6e-3),  # train.epochs stays the upper bound
])
def test_a_warm_started_training_trains_fewer_epochs_at_its_own_rate(
    warm_start: str | None, warm_start_epochs: int, warm_start_lr: float, epochs: int, lr: float
) -> None:
    cfg = TrainConfig(epochs=20, warm_start_epochs=warm_start_epochs, max_tokens=123_456,
                      optim=OptimConfig(lr=3e-3, warm_start_lr=warm_start_lr))
    settings = training_settings(cfg, warm_start)
    assert (settings.epochs, settings.optim.lr) == (epochs, lr)
    assert settings.max_tokens == 123_456  # the budget bounds both


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
    with pytest.raises(ValueError, match="is a eagle checkpoint, which cannot start a eagle3 drafter"):
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


def test_an_eagle3_champion_warm_starts_a_peagle_training(tmp_path: Path, target) -> None:
    """Switching a run to P-EAGLE starts from the EAGLE-3 champion, not cold; and a P-EAGLE champion
    starts the next P-EAGLE training as it is."""
    cfg = load_config(overrides={"data_dir": str(tmp_path), "drafter": {"kind": "eagle3", "draft_vocab_size": 24}})
    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.artifact_root)
    champion = fresh_drafter(cfg.drafter, target, torch.arange(32), seed=3)
    version = registry.register(registry.start_run("r", {}), save_drafter(champion, tmp_path / "c"), {})
    peagle = load_config(overrides={"data_dir": str(tmp_path), "drafter": {"kind": "peagle", "num_depths": 4}})

    drafter, origin = _initial_drafter(peagle, registry, version, target, _hidden())

    assert isinstance(drafter, PEagleDrafter)
    assert origin == version
    assert torch.equal(drafter.layers[0].mlp.up_proj.weight, champion.midlayer.mlp.up_proj.weight)
    assert torch.equal(drafter.lm_head.weight, champion.lm_head.weight)
    assert torch.equal(drafter.d2t, champion.d2t)

    version2 = registry.register(registry.start_run("r2", {}), save_drafter(drafter, tmp_path / "p"), {})
    again, origin = _initial_drafter(peagle, registry, version2, target, _hidden())
    assert isinstance(again, PEagleDrafter)
    assert origin == version2
    assert torch.equal(again.mask_hidden, drafter.mask_hidden)
