"""Checks on what was stored, read back from the object store (what a reader will see)."""

from __future__ import annotations

import json

from pipeline.data import rollouts as rollouts_lib
from pipeline.data import run_layout, shard_file, shard_format, shards
from pipeline.data.store import ObjectStore


def target_hidden_size(store: ObjectStore, run: str, step: int) -> int:
    pointer = rollouts_lib.read_policy_pointer(store, run, step)
    fs, path = store.filesystem(pointer.checkpoint_uri)
    with fs.open(f"{path}/config.json") as f:
        return int(json.load(f)["hidden_size"])


def check_shards(store: ObjectStore, run: str, step: int) -> list[str]:
    """Problems found in the step's committed shards; empty when they are sound."""
    manifest = shards.read_manifest(store, run, step)
    problems = []
    expected = target_hidden_size(store, run, step)
    if manifest.hidden_size != expected:
        problems.append(f"manifest hidden_size {manifest.hidden_size} != target hidden_size {expected}")
    try:
        run_layout.check_stored(store, run, step, manifest.hidden_size, manifest.layer_ids, manifest.layout)
    except run_layout.LayoutError as exc:
        problems.append(str(exc))
    rows = 0
    for shard in manifest.shards:
        try:
            for sample in shards.iter_shard(store, run, manifest, shard.name):
                rows += 1
                try:
                    shard_file.validate_sample(sample, expected, len(manifest.layer_ids))
                except shard_format.ShardError as exc:
                    problems.append(str(exc))
        except shard_format.CorruptShardError as exc:
            problems.append(str(exc))
    if rows != manifest.num_samples:
        problems.append(f"{rows} rows stored, manifest says {manifest.num_samples}")
    return problems
