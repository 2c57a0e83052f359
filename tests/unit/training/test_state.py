"""Resumable training state: a resumed training ends exactly where an uninterrupted one does."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.config import OptimConfig, TrainConfig
from pipeline.data.keys import training_prefix
from pipeline.data.store import ObjectStore
from pipeline.models import target_forward
from pipeline.registry import DrafterRegistry, MetricsBatcher
from pipeline.training import loop
from pipeline.training.dataset import InMemoryDataset, Sample
from pipeline.training.loop import train_drafter
from pipeline.training.state import LATEST, CheckpointWriter, ResumeState, TrainingCheckpoints, snapshot
from tests.support.targets import tiny_target
from tests.unit.training.test_loop import drafter_for as _drafter

V, H, HEADS = 32, 32, 2


def _samples(target) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(10):
        n = int(torch.randint(8, 16, (1,), generator=g))
        ids = (int(torch.randint(0, V, (1,), generator=g)) + 3 * torch.arange(n)) % V
        mask = torch.ones(n, dtype=torch.int64)
        mask[:3] = 0
        out.append((ids, target_forward.forward(target, ids[None]).features[0].float(), mask))
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_target(V, H, 1, HEADS)


@pytest.fixture(scope="module")
def samples(target) -> list[Sample]:
    return _samples(target)



CFG = TrainConfig(epochs=3, batch_size_per_gpu=3, max_seq_len=128, window_tokens=64, seed=2, checkpoint_every=4,
                  optim=OptimConfig(lr=3e-3, lr_warmup_steps=2, weight_decay=0.01))


def test_resume_from_the_last_checkpoint_reproduces_the_uninterrupted_training(
    store: ObjectStore, target, samples: list[Sample]
) -> None:
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


class _DiedAfterCommit(Exception):
    pass


def test_records_of_a_committed_checkpoint_reach_mlflow_once_when_the_process_dies_before_sending_them(
    store: ObjectStore, tmp_path: Path, target, samples: list[Sample]
) -> None:
    """The checkpoint commits before its iterations' metrics are sent; a process killed between the
    two leaves them out of MLflow, and the resume sends them, each iteration exactly once."""
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}", "exp", "drafter")
    run_id = registry.start_run("drafter", {})
    checkpoints = TrainingCheckpoints(store, training_prefix("test", "abc"))
    first = MetricsBatcher(registry.client, run_id, flush_every=1 << 62)

    def die_after_the_second_commit(state: ResumeState) -> None:
        if state.iteration == 8:
            raise _DiedAfterCommit
        first.flush()

    with pytest.raises(_DiedAfterCommit):
        train_drafter(_drafter(target), InMemoryDataset(samples), CFG, first, checkpoints=checkpoints,
                      on_checkpoint=die_after_the_second_commit)

    def steps() -> list[int]:
        return sorted(m.step for m in registry.client.get_metric_history(run_id, "loss"))

    assert steps() == [0, 1, 2, 3]  # iterations 4-7 are in the checkpoint at 8, not in MLflow
    saved = checkpoints.latest().state
    resumed = MetricsBatcher(registry.client, run_id, flush_every=1 << 62)
    resumed.log_missing(saved.unlogged)
    resumed.log_missing(saved.unlogged)  # a second resume from the same checkpoint sends nothing
    assert steps() == list(range(8))
    train_drafter(_drafter(target), InMemoryDataset(samples), CFG, resumed, checkpoints=checkpoints,
                  on_checkpoint=lambda _: resumed.flush())
    resumed.flush()
    assert steps() == list(range(12))
    for key in ("vloss", "ploss", "accuracy", "grad_norm", "lr", "tokens_per_s"):
        assert len(registry.client.get_metric_history(run_id, key)) == 12, key


def test_optimizer_state_round_trips_bit_exactly(store: ObjectStore, target, samples: list[Sample]) -> None:
    model = _drafter(target)
    train_drafter(model, InMemoryDataset(samples), CFG.model_copy(update={"epochs": 1}))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    checkpoints = TrainingCheckpoints(store, "training/x/y")
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


def test_no_pickle_in_a_checkpoint(store: ObjectStore, tmp_path: Path, target) -> None:
    model = _drafter(target)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    checkpoints = TrainingCheckpoints(store, "training/x/y")
    checkpoints.save(model, optimizer, ResumeState(iteration=3, total_iterations=5, world_size=1))
    files = sorted(p.name for p in (tmp_path / "store" / "training/x/y").rglob("*") if p.is_file())
    assert files == ["latest.json", "model.safetensors", "optimizer.safetensors", "state.json"]


def test_a_checkpoint_of_another_training_shape_is_refused(store: ObjectStore, target, samples) -> None:
    checkpoints = TrainingCheckpoints(store, "training/x/y")
    train_drafter(_drafter(target), InMemoryDataset(samples), CFG, checkpoints=checkpoints)
    longer = CFG.model_copy(update={"epochs": 4})
    with pytest.raises(ValueError, match="of a training of 12 iterations on 1 ranks, this one has 16 on 1"):
        train_drafter(_drafter(target), InMemoryDataset(samples), longer, checkpoints=checkpoints)


def test_a_half_written_checkpoint_is_ignored_and_cleaned(store: ObjectStore, target, samples) -> None:
    """A process killed after writing weights but before `latest.json` leaves the previous checkpoint in force."""
    checkpoints = TrainingCheckpoints(store, "training/x/y")
    train_drafter(_drafter(target), InMemoryDataset(samples), CFG, checkpoints=checkpoints)
    store.write_bytes("training/x/y/iter-00000012/model.safetensors", b"half")
    latest = checkpoints.latest()
    assert (latest.state.iteration, latest.directory) == (8, "iter-00000008")
    model = _drafter(target)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    checkpoints.save(model, optimizer, ResumeState(iteration=9, total_iterations=12, world_size=1))
    assert store.list_dirs("training/x/y") == ["iter-00000009"]


def _train_and_die_writing_the_second_checkpoint(root: str) -> None:
    """A training whose background write of its second checkpoint (iteration 8) is killed (SIGKILL)
    once the training thread has gone two iterations past it: the kill lands between that
    checkpoint's weights and its optimizer state, before its commit. The hooks are installed in
    this process only, by wrapping the product's own functions; the product has no crash hook."""
    torch.set_num_threads(1)
    optimizer_steps = [0]
    apply_gradients = loop.apply_gradients

    def counted(*args, **kwargs):
        optimizer_steps[0] += 1
        return apply_gradients(*args, **kwargs)

    write_bytes = ObjectStore.write_bytes

    def write_then_die(self: ObjectStore, key: str, data: bytes) -> None:
        write_bytes(self, key, data)
        if key.endswith("iter-00000008/model.safetensors"):
            while optimizer_steps[0] < 10:  # training goes on while the checkpoint is written
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)

    loop.apply_gradients = counted
    ObjectStore.write_bytes = write_then_die
    target = tiny_target(V, H, 1, HEADS)
    checkpoints = TrainingCheckpoints(ObjectStore(root), "training/x/y")
    train_drafter(_drafter(target), InMemoryDataset(_samples(target)), CFG, checkpoints=checkpoints)


@pytest.mark.reliability("fault", "SIGKILL during a background checkpoint write, training two iterations past it: "
                                  "the previous checkpoint stays in force and the resume is exact")
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(
    tmp_path: Path, target, samples: list[Sample]
) -> None:
    root = (tmp_path / "store").as_uri()
    child = mp.get_context("spawn").Process(target=_train_and_die_writing_the_second_checkpoint, args=(root,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    store = ObjectStore(root)
    checkpoints = TrainingCheckpoints(store, "training/x/y")
    assert store.read_json(f"{checkpoints.prefix}/{LATEST}") == {"iteration": 4, "directory": "iter-00000004"}
    assert store.exists("training/x/y/iter-00000008/model.safetensors")  # the half-written one
    assert not store.exists("training/x/y/iter-00000008/state.json")

    resumed_model = _drafter(target)
    resumed = train_drafter(resumed_model, InMemoryDataset(samples), CFG, checkpoints=checkpoints)
    reference = _drafter(target)
    full = train_drafter(reference, InMemoryDataset(samples), CFG)

    assert resumed.resumed_from_iteration == 4
    assert resumed.loss_history == full.loss_history
    for key, value in reference.trainable_state_dict().items():
        assert torch.equal(resumed_model.trainable_state_dict()[key], value), key
    assert store.list_dirs(checkpoints.prefix) == ["iter-00000008"]  # the resume's own, the torn one replaced


def test_a_background_write_is_a_copy_and_at_most_one_is_in_flight(store: ObjectStore, target, samples) -> None:
    """The snapshot is the state when it was taken, whatever the training does to the model meanwhile;
    a second submit waits for the first write to commit."""
    model = _drafter(target)
    train_drafter(model, InMemoryDataset(samples), CFG.model_copy(update={"epochs": 1}))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    before = {k: v.clone() for k, v in model.trainable_state_dict().items()}
    snap = snapshot(model, optimizer, ResumeState(iteration=1, total_iterations=5, world_size=1))
    with torch.no_grad():
        model.fc.weight.add_(1.0)  # training goes on after the snapshot
    checkpoints = TrainingCheckpoints(store, "training/x/y")
    entered, release = [0], [False]
    write = checkpoints.write

    def slow_write(s):
        entered[0] += 1
        while not release[0]:
            time.sleep(0.005)
        return write(s)

    checkpoints.write = slow_write
    writer = CheckpointWriter(checkpoints)
    assert writer.submit(snap) is None
    time.sleep(0.05)
    assert writer.poll() is None  # in flight, not committed
    assert entered[0] == 1
    assert checkpoints.latest() is None
    release[0] = True
    second = snapshot(model, optimizer, ResumeState(iteration=2, total_iterations=5, world_size=1))
    assert writer.submit(second).iteration == 1  # waited for the first, which committed
    assert writer.wait().iteration == 2
    assert entered[0] == 2
    restored = _drafter(target)
    checkpoints.write = write
    latest = checkpoints.latest()
    assert (latest.state.iteration, latest.directory) == (2, "iter-00000002")
    restored.load_state_dict(checkpoints.model_weights(latest.directory), strict=False)
    assert not torch.equal(restored.fc.weight, before["fc.weight"])  # the second snapshot, after the change
    first = snap.weights["fc.weight"]
    assert torch.equal(first, before["fc.weight"])  # the first snapshot kept the state it was taken at


@pytest.mark.parametrize(("file", "change", "field"), [
    ("latest", {"directory": "../../rollouts/r/step-000001"}, "directory"),
    ("latest", {"directory": 40}, "directory"),
    ("state", {"iteration": 10**400}, "resume.iteration"),
    ("state", {"world_size": "2"}, "resume.world_size"),
    ("state", {"wall_s": 10**400}, "resume.wall_s"),
    ("state", {"loss_history": [1.0, "low"]}, "resume.loss_history"),
    ("state", {"unlogged": [[3, {"loss": 10**400}]]}, "resume.unlogged"),
], ids=["directory-path", "directory-number", "iteration-400-digits", "world-size-string", "wall-400-digits",
        "loss-string", "metric-400-digits"])
def test_a_stored_checkpoint_pointer_or_state_is_read_back_as_untrusted_input(
    store: ObjectStore, file: str, change: dict, field: str, reliability
) -> None:
    """latest.json and state.json are the training's own, read back as any stored record: a field of the wrong type
    or a number of hundreds of digits is refused naming the file and the field, and a resume never starts from it."""
    reliability.bad_input(f"a training checkpoint's {file}.json with a bad {field}: refused naming the file and "
                          "field, nothing resumed")
    checkpoints = TrainingCheckpoints(store, "training/r/abc")
    store.write_json("training/r/abc/iter-00000002/state.json", {"resume": {
        "iteration": 2, "total_iterations": 4, "world_size": 1, "tokens": 64, "wall_s": 1.5,
        "loss_history": [2.0, 1.5], "unlogged": [[2, {"loss": 1.5}]]}, "param_groups": [], "parameters": []})
    store.write_json("training/r/abc/latest.json", {"iteration": 2, "directory": "iter-00000002"})
    assert checkpoints.latest().state == ResumeState(2, 4, 1, 64, 1.5, [2.0, 1.5], [(2, {"loss": 1.5})])
    key = "training/r/abc/latest.json" if file == "latest" else "training/r/abc/iter-00000002/state.json"
    doc = store.read_json(key)
    store.write_json(key, {**doc, **change} if file == "latest" else {**doc, "resume": {**doc["resume"], **change}})

    with pytest.raises(ValueError, match=rf"{key}: field {field}"):
        checkpoints.latest()
