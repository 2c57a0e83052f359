"""The trainer-side client of the rollouts contract: an RL trainer publishes each step with it.

Importable with pyarrow, fsspec (s3fs for s3://) and safetensors alone: no Dagster, and torch
only inside `publish_checkpoint`. What the pipeline would refuse when it reads a step, the
client refuses before it writes anything, with the same validators (`pipeline.data.rollouts`),
so a trainer hears about a mistake at the step that made it:

    from pipeline.client import Rollout, publish_checkpoint, publish_step

    staging = publish_checkpoint(model, "/tmp/policy-step-7")          # safetensors, sharded when large
    rollouts = [Rollout.from_prompt_and_response(f"s7-{i}", prompt, response, reward, policy_version=6)
                for i, (prompt, response, reward) in enumerate(batch)]
    publish_step("s3://bucket/drafter", "my-run", 7, rollouts, staging, policy_version=6,
                 model_id="my-policy", tokenizer_vocab_size=len(tokenizer))

A step is written rollouts first, then the checkpoint, then policy.json (the commit point).
Publishing a committed step again with the same content is a no-op (a retried call); with
other content it is refused and nothing stored changes.

A trainer whose groups of rollouts finish over minutes publishes the step in parts as they
finish, then commits it (`pipeline.data.parts`); the checkpoint goes up with the first part,
so the pipeline can start on the step's first rollouts while the tail is still generating:

    for part, group in enumerate(finished_groups()):                  # as the rollout engine returns them
        publish_rollouts_part(root, "my-run", 7, part, group, staging, policy_version=6,
                              model_id="my-policy", expected_rollouts=512)
    commit_rollouts_parts(root, "my-run", 7)                            # policy.json lists the parts
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.data import parts as parts_lib
from pipeline.data.keys import policy_pointer_key, policy_prefix, rollouts_key, rollouts_prefix, step_key
from pipeline.data.rollouts import (
    PolicyPointer,
    Rollout,
    RolloutsError,
    TargetLimits,
    check_policy_version,
    check_step,
    is_committed,
    pointer_record,
    read_policy_pointer,
    read_rollouts,
    validate_pointer,
    validate_rollouts,
    write_rollouts_file,
)
from pipeline.data.store import ObjectStore
from pipeline.sampling import SamplingParams

__all__ = ["PublishedStep", "Rollout", "RolloutsError", "StagedCheckpoint", "commit_rollouts_parts",
           "publish_checkpoint", "publish_rollouts_part", "publish_step", "stage_checkpoint"]

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# A tokenizer published beside the weights lets vLLM serve the policy as it is; only these files travel.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class StagedCheckpoint:
    """A transformers checkpoint directory on the trainer's disk, checked: config.json and safetensors weights."""

    directory: Path
    files: tuple[str, ...]  # config.json first, the tokenizer's files, then the weight files
    limits: TargetLimits


@dataclass(frozen=True)
class PublishedStep:
    rollouts_uri: str
    checkpoint_uri: str
    pointer: PolicyPointer
    written: bool  # False when the identical step was already committed


def publish_checkpoint(model: Any, directory: str | Path, max_shard_size: str | int = "2GB",
                       tokenizer: Any = None) -> StagedCheckpoint:
    """Save a transformers model as config.json + safetensors (sharded above `max_shard_size`), with its
    tokenizer's files when given (what a vLLM replica of the policy reads), into a local staging directory
    for `publish_step`. torch is needed here only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    return stage_checkpoint(directory)


def stage_checkpoint(directory: str | Path) -> StagedCheckpoint:
    """Check a checkpoint directory before anything is uploaded: a config.json with the vocabulary
    size, and safetensors weights whose headers parse (pickled weights are refused, never read)."""
    directory = Path(directory)
    where = f"policy checkpoint {directory}"
    if not directory.is_dir():
        raise RolloutsError(where, "not a directory", None, "checkpoint")
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLED_WEIGHTS)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise RolloutsError(where, "has no config.json", None, "checkpoint")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RolloutsError(where, "config.json is not JSON", None, "checkpoint") from None
    vocab = config.get("vocab_size") if isinstance(config, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise RolloutsError(where, "config.json has no positive integer vocab_size", None, "checkpoint")
    positions = config.get("max_position_embeddings")
    limits = TargetLimits(vocab, positions if isinstance(positions, int) and not isinstance(positions, bool)
                          else None)
    weights = _weight_files(directory, where)
    if not weights:
        found = f": found {', '.join(pickled)}, pickled weights are not accepted" if pickled else ""
        raise RolloutsError(where, f"has no safetensors weights ({SINGLE_WEIGHTS} or {WEIGHTS_INDEX}){found}",
                            None, "checkpoint")
    for name in weights:
        if name.endswith(".safetensors"):
            _check_safetensors(directory / name, where)
    tokenizer = [n for n in TOKENIZER_FILES if (directory / n).is_file() and not (directory / n).is_symlink()]
    return StagedCheckpoint(directory, (CONFIG_FILE, *tokenizer, *weights), limits)


def _weight_files(directory: Path, where: str) -> list[str]:
    if (directory / SINGLE_WEIGHTS).is_file():
        return [SINGLE_WEIGHTS]
    index_path = directory / WEIGHTS_INDEX
    if not index_path.is_file():
        return []
    try:
        shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise RolloutsError(where, f"{WEIGHTS_INDEX} has no readable weight_map", None, "checkpoint") from None
    bad = [s for s in shards if not isinstance(s, str) or "/" in s or not s.endswith(".safetensors")]
    if bad:
        raise RolloutsError(where, f"{WEIGHTS_INDEX} names {len(bad)} file(s) that are not safetensors files in "
                                   "the directory", None, "checkpoint")
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise RolloutsError(where, f"shard(s) {', '.join(missing)} named by {WEIGHTS_INDEX} are missing", None,
                            "checkpoint")
    return [WEIGHTS_INDEX, *shards]


def _check_safetensors(path: Path, where: str) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except (SafetensorError, OSError) as exc:
        raise RolloutsError(where, f"{path.name} is not a safetensors file ({type(exc).__name__})", None,
                            "checkpoint") from None


def publish_step(
    store: ObjectStore | str,
    run: str,
    step: int,
    rollouts: Sequence[Rollout],
    checkpoint: StagedCheckpoint | str | Path,
    *,
    policy_version: int,
    model_id: str,
    sampling: SamplingParams | None = None,
    tokenizer_vocab_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> PublishedStep:
    """Validate, then write the step: rollouts.parquet, the checkpoint under policies/<run>/<step>/,
    policy.json last. `store` is an ObjectStore or a root URI (`storage_options` for fsspec, e.g. an
    S3 endpoint; credentials come from the AWS environment variables). `sampling`: how the rollouts were
    sampled (temperature, top_p, top_k), at which every tau of the step is measured. `tokenizer_vocab_size` is
    len(tokenizer): a tokenizer with more ids than the policy's embedding is refused."""
    store = store if isinstance(store, ObjectStore) else ObjectStore(store, storage_options)
    check_step(step, f"{store.uri(f'rollouts/{run}')}/step-?")
    rollouts_where = store.uri(rollouts_key(run, step))
    pointer_where = store.uri(policy_pointer_key(run, step))
    staged = checkpoint if isinstance(checkpoint, StagedCheckpoint) else stage_checkpoint(checkpoint)
    _check_tokenizer(step, staged, tokenizer_vocab_size)
    check_policy_version(policy_version, pointer_where)
    rollouts = list(rollouts)
    validate_rollouts(rollouts, rollouts_where, staged.limits)
    checkpoint_key = policy_prefix(run, step)
    pointer = validate_pointer(pointer_record(PolicyPointer(policy_version, checkpoint_key, model_id, sampling)),
                               pointer_where)

    if is_committed(store, run, step):
        _refuse_other_content(store, run, step, rollouts, pointer, staged)
        return PublishedStep(rollouts_where, store.uri(checkpoint_key), pointer, written=False)

    write_rollouts_file(store, run, step, rollouts)
    _upload_checkpoint(store, staged, checkpoint_key)
    store.write_json(policy_pointer_key(run, step), pointer_record(pointer))
    return PublishedStep(rollouts_where, store.uri(checkpoint_key), pointer, written=True)


def _upload_checkpoint(store: ObjectStore, staged: StagedCheckpoint, checkpoint_key: str) -> None:
    for name in staged.files:
        with (staged.directory / name).open("rb") as src, store.open_write(f"{checkpoint_key}/{name}") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)


def publish_rollouts_part(
    store: ObjectStore | str,
    run: str,
    step: int,
    part: int,
    rollouts: Sequence[Rollout],
    checkpoint: StagedCheckpoint | str | Path,
    *,
    policy_version: int,
    model_id: str,
    expected_rollouts: int,
    sampling: SamplingParams | None = None,
    tokenizer_vocab_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    now: float | None = None,
) -> parts_lib.PublishedPart:
    """Validate, then write one part of a step before its commit: with the first part the checkpoint under
    policies/<run>/<step>/ and the step's record (policy pointer, `expected_rollouts`), then the part's
    rollouts, its manifest last. The same part again is a no-op; another content for a published part,
    a sample id another part holds, another policy pointer, or any new part once the step is committed is
    refused by name. `now`: the part's publication time (epoch seconds; the clock's by default)."""
    store = store if isinstance(store, ObjectStore) else ObjectStore(store, storage_options)
    check_step(step, f"{store.uri(f'rollouts/{run}')}/step-?")
    staged = checkpoint if isinstance(checkpoint, StagedCheckpoint) else stage_checkpoint(checkpoint)
    _check_tokenizer(step, staged, tokenizer_vocab_size)
    where = store.uri(policy_pointer_key(run, step))
    check_policy_version(policy_version, where)
    checkpoint_key = policy_prefix(run, step)
    pointer = validate_pointer(pointer_record(PolicyPointer(policy_version, checkpoint_key, model_id, sampling)), where)
    if parts_lib.read_step_parts(store, run, step) is None and not is_committed(store, run, step):
        validate_rollouts(list(rollouts), store.uri(rollouts_key(run, step)), staged.limits)  # before any upload
        _upload_checkpoint(store, staged, checkpoint_key)  # the pointer names it from the first part on
    return parts_lib.write_part(store, run, step, part, rollouts, pointer, expected_rollouts, staged.limits,
                                time.time() if now is None else now)


def commit_rollouts_parts(store: ObjectStore | str, run: str, step: int,
                          storage_options: dict[str, Any] | None = None) -> list[int]:
    """Commit a step published in parts: rollouts.parquet of every part, then policy.json listing the parts
    (the commit point). Again: a no-op. Returns the parts the step consists of."""
    store = store if isinstance(store, ObjectStore) else ObjectStore(store, storage_options)
    check_step(step, f"{store.uri(f'rollouts/{run}')}/step-?")
    return parts_lib.commit_parts(store, run, step)


def _check_tokenizer(step: int, staged: StagedCheckpoint, tokenizer_vocab_size: int | None) -> None:
    if tokenizer_vocab_size is not None and tokenizer_vocab_size > staged.limits.vocab_size:
        raise RolloutsError(
            f"{step_key(step)}: policy checkpoint {staged.directory}",
            f"the tokenizer has {tokenizer_vocab_size} ids, more than the policy's vocabulary "
            f"({staged.limits.vocab_size}): the policy has no embedding for the ids above it", None, "vocab_size")


def _refuse_other_content(store: ObjectStore, run: str, step: int, rollouts: list[Rollout], pointer: PolicyPointer,
                          staged: StagedCheckpoint) -> None:
    """A committed step is never rewritten: the same content again is a retry, anything else an error."""
    where = f"{store.uri(rollouts_prefix(run, step))} (committed)"
    stored_pointer = read_policy_pointer(store, run, step)
    if stored_pointer != pointer:
        differs = [f for f in ("policy_version", "checkpoint_uri", "model_id")
                   if getattr(stored_pointer, f) != getattr(pointer, f)]
        raise RolloutsError(where, "already committed with another policy pointer", None, ", ".join(differs))
    stored = {r.sample_id: r for r in read_rollouts(store, run, step)}
    for r in rollouts:
        old = stored.pop(r.sample_id, None)
        if old is None:
            raise RolloutsError(where, "already committed without this sample", r.sample_id, "sample_id")
        field = next((f for f in ("input_ids", "loss_mask", "reward", "policy_version")
                      if _stored_value(getattr(r, f), f) != getattr(old, f)), None)
        if field is not None:
            raise RolloutsError(where, "already committed with another value", r.sample_id, field)
    if stored:
        raise RolloutsError(where, f"already committed with {len(stored)} more sample(s)", next(iter(stored)),
                            "sample_id")
    for name in staged.files:
        key = f"{pointer.checkpoint_uri}/{name}"
        if not store.exists(key) or _digest(store, key) != _file_digest(staged.directory / name):
            raise RolloutsError(where, f"already committed with another policy checkpoint ({name} differs)", None,
                                "checkpoint")


def _stored_value(value: Any, field: str) -> Any:
    """What a value reads back as from Parquet (rewards are float32)."""
    if field != "reward":
        return list(value) if isinstance(value, tuple) else value
    import numpy as np

    return float(np.float32(value))


def _digest(store: ObjectStore, key: str) -> str:
    h = hashlib.sha256()
    fs, path = store.filesystem(store.uri(key))
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
