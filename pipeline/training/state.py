"""Resumable training state in the object store: safetensors and JSON, never pickle.

    training/<run>/<input id>/              one directory per training (`keys.training_prefix`)
    ├── latest.json                         commit point: {"iteration": 40, "directory": "iter-00000040"}
    └── iter-00000040/
        ├── model.safetensors               the drafter's trainable state (as in its vLLM checkpoint)
        ├── optimizer.safetensors           AdamW state per parameter name: "<name>.exp_avg", "<name>.exp_avg_sq",
        │                                   "<name>.step"; the CPU RNG state as "rng.cpu"
        └── state.json                      ResumeState + the optimizer's param groups (hyperparameters)

Each object is written atomically and `latest.json` last, so a process killed while saving
leaves the previous checkpoint in force; directories no pointer names are removed by the
next save. The data position is the iteration: batch plans are seeded, so the same
iteration always means the same global batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from pipeline.data.store import ObjectStore

LATEST = "latest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
RNG_KEY = "rng.cpu"


@dataclass
class ResumeState:
    """Where a training stands after `iteration` optimizer steps (the next one to run is `iteration`)."""

    iteration: int
    total_iterations: int
    world_size: int
    tokens: int = 0
    wall_s: float = 0.0
    loss_history: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SavedCheckpoint:
    """A committed checkpoint: its state and its directory under the training's prefix."""

    state: ResumeState
    directory: str


class TrainingCheckpoints:
    """The checkpoints of one training under `prefix`; every rank may read, rank 0 writes."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store, self.prefix = store, prefix.rstrip("/")

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def latest(self) -> SavedCheckpoint | None:
        """The committed checkpoint, or None when this training never saved one."""
        if not self.store.exists(self._key(LATEST)):
            return None
        pointer = self.store.read_json(self._key(LATEST))
        doc = self.store.read_json(self._key(pointer["directory"], STATE_FILE))
        return SavedCheckpoint(ResumeState(**doc["resume"]), pointer["directory"])

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ResumeState) -> str:
        directory = f"iter-{state.iteration:08d}"
        names = _optimizer_names(model, optimizer)
        optim_state = optimizer.state_dict()
        tensors = {RNG_KEY: torch.get_rng_state()}
        for index, per_param in optim_state["state"].items():
            for key, value in per_param.items():
                tensors[f"{names[index]}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
        weights = {k: v.detach().cpu().contiguous() for k, v in _weights(model).items()}
        self.store.write_bytes(self._key(directory, MODEL_FILE), save_tensors(weights))
        self.store.write_bytes(self._key(directory, OPTIMIZER_FILE), save_tensors(tensors))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optim_state["param_groups"]]
        self.store.write_json(self._key(directory, STATE_FILE), {"resume": asdict(state), "param_groups": groups,
                                                                 "parameters": names})
        self.store.write_json(self._key(LATEST), {"iteration": state.iteration, "directory": directory})
        for stale in self.store.list_dirs(self.prefix):  # older checkpoints and any half-written one
            if stale != directory:
                self.store.delete_prefix(self._key(stale))
        return directory

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ResumeState | None:
        """Load the latest checkpoint into `model` and `optimizer` (which must be built as they were)."""
        found = self.latest()
        if found is None:
            return None
        state, directory = found.state, found.directory
        doc = self.store.read_json(self._key(directory, STATE_FILE))
        names = _optimizer_names(model, optimizer)
        if doc["parameters"] != names:
            raise ValueError(f"{self.store.uri(self._key(directory))}: checkpoint parameters {doc['parameters']} "
                             f"differ from the model's {names}")
        model.load_state_dict(self.model_weights(directory), strict=False)
        tensors = load_tensors(self.store.read_bytes(self._key(directory, OPTIMIZER_FILE)))
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for index, name in enumerate(names):
            keys = {k.removeprefix(f"{name}."): k for k in tensors if k.startswith(f"{name}.")
                    and "." not in k.removeprefix(f"{name}.")}
            if keys:
                per_param[index] = {short: tensors[full] for short, full in keys.items()}
        groups = doc["param_groups"]
        params_per_group = [len(g["params"]) for g in optimizer.state_dict()["param_groups"]]
        if len(groups) != len(params_per_group):
            raise ValueError(
                f"checkpoint has {len(groups)} optimizer param groups, the optimizer {len(params_per_group)}"
            )
        start, restored_groups = 0, []
        for group, count in zip(groups, params_per_group, strict=True):
            restored_groups.append({**group, "params": list(range(start, start + count))})
            start += count
        optimizer.load_state_dict({"state": per_param, "param_groups": restored_groups})
        torch.set_rng_state(tensors[RNG_KEY])
        return state

    def model_weights(self, directory: str) -> dict[str, torch.Tensor]:
        """The weights saved in `directory` (e.g. to rebuild what depends on them before training)."""
        return load_tensors(self.store.read_bytes(self._key(directory, MODEL_FILE)))

    def clear(self) -> None:
        """Drop every checkpoint of this training (after its drafter is registered)."""
        self.store.delete_prefix(self.prefix)


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the parameters the optimizer holds, in its order (group by group): the optimizer's
    state is indexed by that order."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What changes during training: the trainable parameters, plus the drafter's own extra state
    (EAGLE-3's vocabulary maps) where it has it."""
    own = getattr(model, "trainable_state_dict", None)
    weights = dict(own()) if callable(own) else {}
    weights.update({name: p for name, p in model.named_parameters() if p.requires_grad})
    return weights
