"""Resumable training state: a resumed training ends exactly where an uninterrupted one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import OptimConfig, TrainConfig
from pipeline.data.keys import training_prefix
from pipeline.data.store import ObjectStore
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.training.dataset import InMemoryDataset, Sample
from pipeline.training.loop import train_drafter
from pipeline.training.state import LATEST, ResumeState, TrainingCheckpoints
from tests.unit.training.test_loop import drafter_for as _drafter

V, H, HEADS = 32, 32, 2


@pytest.fixture(scope="module")
def target():
    return target_lib.build_target(target_lib.tiny_llama_config(V, H, 1, HEADS), seed=0)


@pytest.fixture(scope="module")
def samples(target) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(10):
        n = int(torch.randint(8, 16, (1,), generator=g))
        ids = (int(torch.randint(0, V, (1,), generator=g)) + 3 * torch.arange(n)) % V
        mask = torch.ones(n, dtype=torch.int64)
        mask[:3] = 0
        out.append((ids, target_forward.forward(target, ids[None]).features[0].float(), mask))
    return out



CFG = TrainConfig(epochs=3, batch_size_per_gpu=3, max_seq_len=128, window_tokens=64, seed=2, checkpoint_every=4,
                  optim=OptimConfig(lr=3e-3, lr_warmup_steps=2, weight_decay=0.01))


def test_resume_from_the_last_checkpoint_reproduces_the_uninterrupted_training(
    tmp_path: Path, target, samples: list[Sample]
) -> None:
    store = ObjectStore(tmp_path.as_uri())
    checkpoints = TrainingCheckpoints(store, training_prefix("test", "abc"))
    saved: list[int] = []
    reference = _drafter(target)
    full = train_drafter(reference, InMemoryDataset(samples), CFG, checkpoints=checkpoints,
                         on_checkpoint=lambda s: saved.append(s.iteration))
    assert full.iterations == 12
    assert full.resumed_from_iteration == 0
    assert saved == [4, 8]  # every 4 iterations, none at the very end
    # only the newest checkpoint is kept; it is what a killed process would leave behind
    assert store.list_dirs(checkpoints.prefix) == ["iter-00000008"]
    assert store.read_json(f"{checkpoints.prefix}/{LATEST}") == {"iteration": 8, "directory": "iter-00000008"}

    resumed_model = _drafter(target)
    resumed = train_drafter(resumed_model, InMemoryDataset(samples), CFG, checkpoints=checkpoints)

    assert resumed.resumed_from_iteration == 8
    assert resumed.iterations == full.iterations
    assert resumed.loss_history == full.loss_history  # the first 8 from the checkpoint, the rest recomputed
    for key, value in reference.trainable_state_dict().items():
        assert torch.equal(resumed_model.trainable_state_dict()[key], value), key


def test_optimizer_state_round_trips_bit_exactly(tmp_path: Path, target, samples: list[Sample]) -> None:
    model = _drafter(target)
    train_drafter(model, InMemoryDataset(samples), CFG.model_copy(update={"epochs": 1}))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    checkpoints = TrainingCheckpoints(ObjectStore(tmp_path.as_uri()), "training/x/y")
    checkpoints.save(model, optimizer, ResumeState(iteration=1, total_iterations=5, world_size=1))

    other = _drafter(target)
    other_params = [p for p in other.parameters() if p.requires_grad]
    other_optimizer = torch.optim.AdamW(other_params, lr=5.0, weight_decay=0.0)
    state = checkpoints.restore(other, other_optimizer)

    assert state == ResumeState(iteration=1, total_iterations=5, world_size=1)
    assert other_optimizer.param_groups[0]["lr"] == 1e-3
    assert other_optimizer.param_groups[0]["weight_decay"] == 0.01
    for a, b in zip(params, other_params, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[a][key], other_optimizer.state[b][key]), key


def test_no_pickle_in_a_checkpoint(tmp_path: Path, target) -> None:
    model = _drafter(target)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    checkpoints = TrainingCheckpoints(ObjectStore(tmp_path.as_uri()), "training/x/y")
    checkpoints.save(model, optimizer, ResumeState(iteration=3, total_iterations=5, world_size=1))
    files = sorted(p.name for p in (tmp_path / "training/x/y").rglob("*") if p.is_file())
    assert files == ["latest.json", "model.safetensors", "optimizer.safetensors", "state.json"]


def test_a_checkpoint_of_another_training_shape_is_refused(tmp_path: Path, target, samples) -> None:
    checkpoints = TrainingCheckpoints(ObjectStore(tmp_path.as_uri()), "training/x/y")
    train_drafter(_drafter(target), InMemoryDataset(samples), CFG, checkpoints=checkpoints)
    longer = CFG.model_copy(update={"epochs": 4})
    with pytest.raises(ValueError, match="of a training of 12 iterations on 1 ranks, this one has 16 on 1"):
        train_drafter(_drafter(target), InMemoryDataset(samples), longer, checkpoints=checkpoints)


def test_a_half_written_checkpoint_is_ignored_and_cleaned(tmp_path: Path, target, samples) -> None:
    """A process killed after writing weights but before `latest.json` leaves the previous checkpoint in force."""
    store = ObjectStore(tmp_path.as_uri())
    checkpoints = TrainingCheckpoints(store, "training/x/y")
    train_drafter(_drafter(target), InMemoryDataset(samples), CFG, checkpoints=checkpoints)
    store.write_bytes("training/x/y/iter-00000012/model.safetensors", b"half")
    latest = checkpoints.latest()
    assert (latest.state.iteration, latest.directory) == (8, "iter-00000008")
    model = _drafter(target)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    checkpoints.save(model, optimizer, ResumeState(iteration=9, total_iterations=12, world_size=1))
    assert store.list_dirs("training/x/y") == ["iter-00000009"]
