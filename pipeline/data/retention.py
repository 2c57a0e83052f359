"""Retention: delete hidden-state shards that no live buffer and no registered drafter refers to.

Evicting a sample from the buffer never deletes data (the buffer is a manifest over the
shards); this is the one place that does, and it plans before it deletes:

* Live buffers: the newest buffer manifest (what the next training reads: the one the store saw
  written last, as `pipeline.data.order` orders steps) and the buffer
  of every RL step a registered drafter was trained at (its training data, for lineage
  and retraining). Older buffer manifests have expired and are deleted with the data.
* A step's hidden states are kept whole while any live buffer refers to one of its shards
  (its manifest stays consistent), and while the step is inside the current buffer window
  or newer (the next buffer may still select it). Otherwise the step is deleted, its
  manifest first so that no reader ever sees a manifest whose shards are gone.
* Files in a step's directory that its manifest does not list (a crashed or replaced
  write) are deleted once older than a grace period, so a write in progress, whose
  manifest is not committed yet, is never touched.
* A same-step refresh's hidden states and buffer (its own namespace, keys.refresh_data_run)
  live as long as the step's own would inside the buffer window: once the step falls out of
  it they are deleted, buffer manifest first, then the hidden states' manifest, then the
  shards. A refresh trains once, on a subset of the step's rollouts (kept in rollouts/), and
  the step's own training supersedes it, so nothing reads them again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.data import shard_format, shards
from pipeline.data.buffer import read_buffer
from pipeline.data.keys import (
    buffer_key,
    buffer_root,
    hidden_states_manifest_key,
    hidden_states_prefix,
    hidden_states_root,
    parse_refresh_data_name,
    parse_step_key,
    refresh_data_root,
)
from pipeline.data.store import ObjectStore

ORPHAN_GRACE_S = 3600.0


@dataclass(frozen=True)
class Doomed:
    key: str
    bytes: int
    reason: str


@dataclass
class RetentionPlan:
    run: str
    delete: list[Doomed] = field(default_factory=list)  # in deletion order
    live_buffers: list[int] = field(default_factory=list)
    kept_steps: dict[int, str] = field(default_factory=dict)  # hidden-state step -> why kept

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.delete)


def _steps_under(store: ObjectStore, prefix: str) -> list[int]:
    steps = []
    for name in store.list_dirs(prefix):
        try:
            steps.append(parse_step_key(name))
        except ValueError:
            continue  # not a step directory: not ours to judge
    return sorted(steps)


def plan_retention(
    store: ObjectStore, run: str, registered_steps: set[int], buffer_steps: int,
    grace_s: float = ORPHAN_GRACE_S, now: float | None = None,
) -> RetentionPlan:
    """What retention would delete, and why; reads only manifests and listings."""
    now = time.time() if now is None else now
    plan = RetentionPlan(run)
    buffers = [s for s in _steps_under(store, buffer_root(run)) if store.exists(buffer_key(run, s))]
    if not buffers:  # nothing has been buffered yet: nothing can be judged unreferenced
        return plan
    # The newest buffer is the one the store saw written last, never the highest step number: the trainer chose
    # the numbers, and one step numbered 10**12 buffered first must not make the buffer the next training reads
    # look expired, nor every ordinary step fall out of the window.
    latest = max(buffers, key=lambda s: (store.modified(buffer_key(run, s)), s))
    plan.live_buffers = [s for s in buffers if s == latest or s in registered_steps]
    referenced: set[tuple[int, str]] = set()
    for step in plan.live_buffers:
        referenced |= {(e.step, e.shard) for e in read_buffer(store, run, step).entries}

    for step in buffers:
        if step not in plan.live_buffers:
            key = buffer_key(run, step)
            plan.delete.append(Doomed(key, store.size(key), "expired buffer manifest (not the newest, no drafter)"))

    window_start = latest - buffer_steps + 1
    for step in _steps_under(store, hidden_states_root(run)):
        prefix = hidden_states_prefix(run, step)
        files = store.list_files(prefix)
        manifest_key = hidden_states_manifest_key(run, step)
        try:
            manifest = shards.read_manifest(store, run, step) if store.exists(manifest_key) else None
        except shard_format.ShardError as exc:  # e.g. another schema version: not ours to judge
            plan.kept_steps[step] = f"manifest not readable ({exc})"
            continue
        listed = {f"{prefix}/{s.name}" for s in manifest.shards} if manifest else set()
        in_use = manifest is not None and any((step, s.name) in referenced for s in manifest.shards)
        if step >= window_start:
            plan.kept_steps[step] = "inside the current buffer window or newer"
        elif in_use:
            plan.kept_steps[step] = "referenced by a live buffer"
        elif manifest is not None:
            plan.delete.append(Doomed(manifest_key, store.size(manifest_key), "manifest of an unreferenced step"))
            plan.delete += [Doomed(k, n, "shard of an unreferenced step") for k, n, _ in files if k in listed]
        orphan_reason = f"not listed by the step's manifest, older than {grace_s:.0f} s"
        plan.delete += [Doomed(k, n, orphan_reason) for k, n, modified in files
                        if k != manifest_key and k not in listed and now - modified > grace_s]
    plan.delete += _expired_refreshes(store, run, window_start)
    return plan


def _expired_refreshes(store: ObjectStore, run: str, window_start: int) -> list[Doomed]:
    """Every file of the refreshes of steps before `window_start`: manifests first, then the shards."""
    root = refresh_data_root(run)
    names = set(store.list_dirs(hidden_states_root(root))) | set(store.list_dirs(buffer_root(root)))
    doomed: list[Doomed] = []
    for name in sorted(names):
        step = parse_refresh_data_name(name)
        if step is None or step >= window_start:
            continue  # not a refresh namespace, or its step still inside the window
        data_run = f"{root}/{name}"
        reason = f"refresh of a step before the buffer window (step {step} < {window_start})"
        files = [*store.list_files(buffer_root(data_run)), *store.list_files(hidden_states_root(data_run))]
        files.sort(key=lambda f: (not f[0].endswith("_manifest.json"), f[0].startswith("hidden_states/")))
        doomed += [Doomed(k, n, reason) for k, n, _ in files]
    return doomed


def apply_retention(store: ObjectStore, plan: RetentionPlan) -> int:
    """Delete what the plan lists, in its order; the bytes deleted."""
    for doomed in plan.delete:
        store.delete_prefix(doomed.key)
    return plan.bytes


class _Versions(Protocol):
    def search_model_versions(self, filter_string: str) -> list: ...


def registered_training_steps(client: _Versions, model_name: str, run: str) -> set[int]:
    """RL steps whose buffer trained a registered drafter version of this pipeline run."""
    steps = set()
    for version in client.search_model_versions(f"name = '{model_name}'"):
        tags = dict(version.tags or {})
        if tags.get("pipeline_run") == run and tags.get("rl_step", "").isdigit():
            steps.add(int(tags["rl_step"]))
    return steps
