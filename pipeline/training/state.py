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

Saving is two halves. `snapshot` copies the state to the host, on the training thread (a
sharded drafter's ranks gather it there, together); `CheckpointWriter` writes that copy,
in a background thread by default, while training goes on. At most one write is in
flight: the next snapshot waits for it. The files are the same whether the drafter was
replicated or sharded (full tensors, keyed by parameter name), so a resume may change
`train.parallelism`.
"""

from __future__ import annotations

import re
import threading
from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from pipeline.data.store import ObjectStore

LATEST = "latest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
RNG_KEY = "rng.cpu"
_DIRECTORY = re.compile(r"iter-[0-9]{8,}")  # what `write` names a checkpoint's directory


@dataclass
class ResumeState:
    """Where a training stands after `iteration` optimizer steps (the next one to run is `iteration`)."""

    iteration: int
    total_iterations: int
    world_size: int
    tokens: int = 0
    wall_s: float = 0.0
    loss_history: list[float] = field(default_factory=list)
    # Metric records (iteration, {name: value}) not yet known to be in the tracker when this was saved:
    # the checkpoint commits before its records are sent, so a resume sends whichever the tracker lacks.
    unlogged: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    @classmethod
    def from_json(cls, doc: object, where: str) -> ResumeState:
        """The state a save stored, read back as untrusted input: ValueError naming `where` and the field. Measured
        values (losses, metrics) may be NaN as measured; none may be an integer beyond a float (OverflowError)."""
        if not isinstance(doc, dict) or not {"iteration", "total_iterations", "world_size"} <= doc.keys():
            raise ValueError(f"{where}: field resume must be an object with iteration, total_iterations, world_size")
        counts = {name: doc.get(name, 0) for name in ("iteration", "total_iterations", "world_size", "tokens")}
        for name, value in counts.items():
            if not _is_int(value) or not 0 <= value < 2**63:
                raise ValueError(f"{where}: field resume.{name} must be a non-negative integer")
        wall_s = _measured(doc.get("wall_s", 0.0), f"{where}: field resume.wall_s")
        history = doc.get("loss_history", [])
        if not isinstance(history, list):
            raise ValueError(f"{where}: field resume.loss_history must be a list")
        unlogged = doc.get("unlogged", [])
        if not isinstance(unlogged, list) or not all(isinstance(r, list) and len(r) == 2 and _is_int(r[0])
                                                     and isinstance(r[1], dict) for r in unlogged):
            raise ValueError(f"{where}: field resume.unlogged must list [iteration, {{metric: value}}] records")
        return cls(**counts, wall_s=wall_s,
                   loss_history=[_measured(v, f"{where}: field resume.loss_history") for v in history],
                   unlogged=[(i, {str(k): _measured(v, f"{where}: field resume.unlogged") for k, v in m.items()})
                             for i, m in unlogged])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _measured(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must hold numbers")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{where} holds an integer too large for a float") from None


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
        where = self.store.uri(self._key(LATEST))
        pointer = self.store.read_json(self._key(LATEST))
        directory = pointer.get("directory") if isinstance(pointer, dict) else None
        if not isinstance(directory, str) or not _DIRECTORY.fullmatch(directory):
            raise ValueError(f"{where}: field directory must name a checkpoint directory (iter-00000040)")
        doc = self.store.read_json(self._key(directory, STATE_FILE))
        state_where = self.store.uri(self._key(directory, STATE_FILE))
        return SavedCheckpoint(ResumeState.from_json(doc.get("resume") if isinstance(doc, dict) else None, state_where),
                               directory)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ResumeState) -> str:
        """Snapshot and write in this thread (one process, unsharded)."""
        return self.write(snapshot(model, optimizer, state))

    def write(self, snap: Snapshot) -> str:
        """Write a snapshot: the tensors, then state.json, then `latest.json` (the commit), then drop
        every other directory (older checkpoints and any half-written one)."""
        directory = f"iter-{snap.state.iteration:08d}"
        self.store.write_bytes(self._key(directory, MODEL_FILE), save_tensors(snap.weights))
        self.store.write_bytes(self._key(directory, OPTIMIZER_FILE), save_tensors(snap.optimizer))
        self.store.write_json(self._key(directory, STATE_FILE), {"resume": asdict(snap.state),
                                                                 "param_groups": snap.param_groups,
                                                                 "parameters": snap.parameters})
        self.store.write_json(self._key(LATEST), {"iteration": snap.state.iteration, "directory": directory})
        for stale in self.store.list_dirs(self.prefix):
            if stale != directory:
                self.store.delete_prefix(self._key(stale))
        return directory

    def restore(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool = False
    ) -> ResumeState | None:
        """Load the latest checkpoint into `model` and `optimizer` (which must be built as they were);
        `sharded`: the model is FSDP2-sharded, every rank calls this and keeps its shards."""
        found = self.latest()
        if found is None:
            return None
        state, directory = found.state, found.directory
        doc = self.store.read_json(self._key(directory, STATE_FILE))
        names = _optimizer_names(model, optimizer)
        if doc["parameters"] != names:
            raise ValueError(f"{self.store.uri(self._key(directory))}: checkpoint parameters {doc['parameters']} "
                             f"differ from the model's {names}")
        tensors = load_tensors(self.store.read_bytes(self._key(directory, OPTIMIZER_FILE)))
        per_param: dict[str, dict[str, torch.Tensor]] = {}
        for name in names:
            keys = {k.removeprefix(f"{name}."): k for k in tensors if k.startswith(f"{name}.")
                    and "." not in k.removeprefix(f"{name}.")}
            if keys:
                per_param[name] = {short: tensors[full] for short, full in keys.items()}
        groups = doc["param_groups"]
        params_per_group = [len(g["params"]) for g in optimizer.param_groups]
        if len(groups) != len(params_per_group):
            raise ValueError(
                f"checkpoint has {len(groups)} optimizer param groups, the optimizer {len(params_per_group)}"
            )
        start, named_groups = 0, []
        for group, count in zip(groups, params_per_group, strict=True):
            named_groups.append({**group, "params": names[start : start + count]})
            start += count
        weights = self.model_weights(directory)
        if sharded:
            _load_sharded(model, optimizer, weights, per_param, named_groups)
        else:
            model.load_state_dict(weights, strict=False)
            index = {name: i for i, name in enumerate(names)}
            optimizer.load_state_dict({
                "state": {index[name]: value for name, value in per_param.items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named_groups]})
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


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint copied to the host: what a write serializes while training goes on."""

    state: ResumeState
    weights: dict[str, torch.Tensor]  # as in model.safetensors
    optimizer: dict[str, torch.Tensor]  # "<name>.<key>" AdamW state and the RNG state, as in optimizer.safetensors
    param_groups: list[dict]  # hyperparameters per group, without the parameters
    parameters: list[str]  # the optimizer's parameters by name, in its order


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host that later in-place updates of `t` (the optimizer's) cannot reach."""
    return torch.as_tensor(t).detach().to("cpu", copy=True).contiguous()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ResumeState) -> Snapshot:
    """The checkpoint of an unsharded model, copied to the host."""
    names = _optimizer_names(model, optimizer)
    optim_state = optimizer.state_dict()
    tensors = {RNG_KEY: torch.get_rng_state()}
    for index, per_param in optim_state["state"].items():
        for key, value in per_param.items():
            tensors[f"{names[index]}.{key}"] = _host_copy(value)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim_state["param_groups"]]
    return Snapshot(state, {k: _host_copy(v) for k, v in _weights(model).items()}, tensors, groups, names)


def sharded_snapshot(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ResumeState, is_main: bool
) -> Snapshot | None:
    """The checkpoint of an FSDP2-sharded model, gathered whole onto rank 0's host (every rank calls
    this: the gather is a collective); None on the other ranks."""
    names = _optimizer_names(model, optimizer)
    keep = set(_weights(model))  # names only: the drafter's trainable state, as an unsharded one saves it
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not is_main:
        return None
    tensors = {RNG_KEY: torch.get_rng_state()}
    for name, per_param in optim_state["state"].items():
        for key, value in per_param.items():
            tensors[f"{name}.{key}"] = _host_copy(value)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim_state["param_groups"]]
    return Snapshot(state, {k: _host_copy(v) for k, v in weights.items() if k in keep}, tensors, groups, names)


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` is: this rank's shard of it when `like` is a DTensor, cut here from the
    full tensor every rank read (no communication), else the whole tensor on `like`'s device."""
    if isinstance(like, DTensor):
        return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)
    return full.to(like.device, like.dtype)


def _load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
    per_param: dict[str, dict[str, torch.Tensor]], named_groups: list[dict],
) -> None:
    """A full checkpoint into an FSDP2-sharded model and its optimizer: each rank keeps its shards."""
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(_shard_like(value, own[name]))
    params = dict(model.named_parameters())
    for group, saved in zip(optimizer.param_groups, named_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
        on_device = group.get("fused") or group.get("capturable")  # AdamW keeps `step` on the device then
        for name in (n for n in saved["params"] if n in per_param):
            p = params[name]
            optimizer.state[p] = {
                key: (value.to(p.device if on_device else "cpu", torch.float32) if key == "step"
                      else _shard_like(value, p))
                for key, value in per_param[name].items()}


class CheckpointWriter:
    """Writes snapshots, in a background thread (`background`) or in the caller's. At most one write
    is in flight: `submit` waits for the previous one. `poll` and `wait` return the state of a
    write that has committed since they last returned one (and raise what a failed write raised)."""

    def __init__(self, checkpoints: TrainingCheckpoints, background: bool = True) -> None:
        self.checkpoints, self.background = checkpoints, background
        self._thread: threading.Thread | None = None
        self._committed: ResumeState | None = None
        self._error: BaseException | None = None

    def _write(self, snap: Snapshot) -> None:
        try:
            self.checkpoints.write(snap)
            self._committed = snap.state
        except BaseException as error:  # noqa: BLE001 (handed to the training thread, raised at its next poll)
            self._error = error

    def submit(self, snap: Snapshot) -> ResumeState | None:
        """Start writing `snap`; returns the state of the previous write if it committed meanwhile."""
        committed = self.wait()
        if not self.background:
            self._write(snap)
            return committed
        self._thread = threading.Thread(target=self._write, args=(snap,), name="checkpoint-writer", daemon=True)
        self._thread.start()
        return committed

    def poll(self) -> ResumeState | None:
        if self._thread is not None and self._thread.is_alive():
            return None
        return self.wait()

    def wait(self) -> ResumeState | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        committed, self._committed = self._committed, None
        return committed
