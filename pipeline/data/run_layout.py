"""One target layout per run: hidden size, vocabulary, stored layer ids and model family.

The buffer mixes the hidden states of several steps and one drafter trains on all of them, so
every step of a run must come from a target of the same layout. The first step that is checked
records the run's layout; every later step (at the rollouts asset, again when its hidden states
are written, and in the buffer) is compared with it, and a step that differs is refused before
anything of it is stored. A policy of another layout starts a new run.

    <root>/hidden_states/<run>/_target_layout.json   {"layout": {...}, "recorded_by_step": 1}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import BinaryIO

import fsspec

from pipeline.data.keys import MAX_STEP, layout_key
from pipeline.data.local_files import LocalPathError, open_regular
from pipeline.data.rollouts import TargetLimits
from pipeline.data.store import ObjectStore
from pipeline.data.uris import redact


class LayoutError(ValueError):
    """A step whose target layout is not its run's; the message says what differs and what to do."""


@dataclass(frozen=True)
class TargetLayout:
    family: str  # config.json model_type (llama, qwen2, ...)
    hidden_size: int
    vocab_size: int
    num_layers: int
    layer_ids: tuple[int, ...]  # vLLM ids of the layers stored per token

    @classmethod
    def from_config(cls, config: dict, layer_ids: list[int]) -> TargetLayout:
        """From a transformers config.json; LayoutError naming the field when one is missing or not an int."""
        try:
            return cls(str(config["model_type"]), _int(config, "hidden_size"), _int(config, "vocab_size"),
                       _int(config, "num_hidden_layers"), tuple(int(i) for i in layer_ids))
        except KeyError as exc:
            raise LayoutError(f"config.json has no field {exc.args[0]!r}") from None

    @classmethod
    def from_json(cls, data: object) -> TargetLayout:
        """A layout the pipeline stored, read back as untrusted input: LayoutError naming the field that is missing
        or mistyped (callers add the file)."""
        if not isinstance(data, dict):
            raise LayoutError("field layout must be a JSON object")
        missing = [k for k in ("family", "hidden_size", "vocab_size", "num_layers", "layer_ids") if k not in data]
        if missing:
            raise LayoutError(f"field layout lacks {', '.join(missing)}")
        if not isinstance(data["family"], str):
            raise LayoutError("field layout.family must be a string")
        layer_ids = data["layer_ids"]
        if not isinstance(layer_ids, list) or not all(_is_int(i) and 0 <= i <= MAX_STEP for i in layer_ids):
            raise LayoutError("field layout.layer_ids must be a list of layer numbers")
        return cls(data["family"], *(_stored_int(data, name) for name in ("hidden_size", "vocab_size", "num_layers")),
                   tuple(layer_ids))

    def differences(self, other: TargetLayout) -> list[str]:
        """'field: this -> other' for every field that differs."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]} -> {theirs[k]}" for k in mine if mine[k] != theirs[k]]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stored_int(layout: dict, name: str) -> int:
    if not _is_int(layout[name]) or not 1 <= layout[name] <= MAX_STEP:
        raise LayoutError(f"field layout.{name} must be a positive integer")
    return layout[name]


def _int(config: dict, name: str) -> int:
    value = config[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"config.json field {name!r} is {value!r}, expected a positive integer")
    return value


def checkpoint_layout(store: ObjectStore, checkpoint_uri: str,
                      layer_ids_of: Callable[[int], list[int]]) -> TargetLayout:
    """The layout of a policy checkpoint from its config.json alone (no weights are read);
    `layer_ids_of(num_layers)` gives the layer ids stored for a target of that depth."""
    config = _checkpoint_config(store, checkpoint_uri)
    try:
        return TargetLayout.from_config(config, layer_ids_of(_int(config, "num_hidden_layers")))
    except LayoutError as exc:
        raise LayoutError(f"{checkpoint_uri}/{exc}") from None


def checkpoint_limits(store: ObjectStore, checkpoint_uri: str) -> TargetLimits:
    """What the policy checkpoint accepts (its vocabulary, its positions), from its config.json alone: the limits
    a reader enforces on rollouts for it, never the ones a trainer's record claims."""
    config = _checkpoint_config(store, checkpoint_uri)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        vocab = _int(text, "vocab_size")
    except LayoutError as exc:
        raise LayoutError(f"{redact(checkpoint_uri)}/{exc}") from None
    positions = text.get("max_position_embeddings")
    return TargetLimits(vocab, positions if isinstance(positions, int) and not isinstance(positions, bool)
                        and positions > 0 else None)


def _checkpoint_config(store: ObjectStore, checkpoint_uri: str) -> dict:
    fs, path = store.filesystem(store.resolve(checkpoint_uri))
    with _open_config(fs, f"{path}/config.json", f"{redact(checkpoint_uri)}/config.json") as f:
        try:
            config = json.loads(f.read(1 << 20))
        except ValueError as exc:
            raise LayoutError(f"{redact(checkpoint_uri)}/config.json is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LayoutError(f"{redact(checkpoint_uri)}/config.json is not a JSON object")
    return config


def _open_config(fs: fsspec.AbstractFileSystem, path: str, where: str) -> BinaryIO:
    """config.json of a checkpoint; on a local filesystem a regular file, never a symlink out of it."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" not in protocols:
        return fs.open(path, "rb")
    try:
        return open_regular(path, where)
    except LocalPathError as exc:
        raise LayoutError(str(exc)) from None


@dataclass(frozen=True)
class RecordedLayout:
    layout: TargetLayout
    recorded_by_step: int


def run_layout(store: ObjectStore, run: str) -> RecordedLayout | None:
    """The run's recorded layout and the step that recorded it; None before the first step."""
    key = layout_key(run)
    if not store.exists(key):
        return None
    where = store.uri(key)
    try:
        doc = store.read_json_object(key)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None
    try:
        layout = TargetLayout.from_json(doc.get("layout"))
    except LayoutError as exc:
        raise LayoutError(f"{where}: {exc}") from None
    step = doc.get("recorded_by_step")
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        raise LayoutError(f"{where}: field recorded_by_step must be an RL step number")
    return RecordedLayout(layout, step)


def check_step_layout(store: ObjectStore, run: str, step: int, layout: TargetLayout, record: bool = True) -> None:
    """LayoutError when `layout` is not the run's; the first step checked records it (`record`)."""
    found = run_layout(store, run)
    if found is None:
        if record:
            store.write_json(layout_key(run), {"layout": asdict(layout), "recorded_by_step": step})
        return
    differences = found.layout.differences(layout)
    if differences:
        raise LayoutError(
            f"step {step} of run {run!r}: the target's layout differs from the run's (recorded by step "
            f"{found.recorded_by_step} in "
            f"{store.uri(layout_key(run))}): {'; '.join(differences)}. One drafter cannot train across layouts: "
            f"start a new run for this policy (set `run` in the pipeline config to a new name, and point the RL "
            f"trainer's output at rollouts/<new run>/)"
        )


def check_stored(store: ObjectStore, run: str, step: int, hidden_size: int, layer_ids: list[int],
                 layout: TargetLayout | None) -> None:
    """A committed step's manifest against the run's layout (its full layout when it recorded one)."""
    found = run_layout(store, run)
    if found is None:
        return
    expected = found.layout
    if layout is None:  # written without a layout: the fields a manifest always has
        layout = TargetLayout(expected.family, hidden_size, expected.vocab_size, expected.num_layers,
                              tuple(layer_ids))
    check_step_layout(store, run, step, layout, record=False)
