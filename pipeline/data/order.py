"""Which RL step is newer: the order the store observed, never the step numbers a trainer chose.

A step number is the trainer's to choose: one step numbered 10**12 committed first must not make every
later ordinary step look older (its training "superseded", its refresh behind a cursor, its policy never
served). So "newer" is decided by when the store saw the step, the times the store itself sets on the
step's files (S3's LastModified, the file system's modification time on `file://`):

    committed_at   its policy.json, the commit point: committed steps in commit order
    first_seen_at  its first part's record (parts/_step.json) for a step published in parts, else its
                   commit: open and committed steps compared where a step is seen before its commit
                   (a refresh trained on a step's first parts)

Two steps the store saw at the same time (S3 keeps whole seconds) are ordered by their numbers.
"""

from __future__ import annotations

from pipeline.data.keys import parts_step_key, policy_pointer_key
from pipeline.data.rollouts import committed_steps
from pipeline.data.store import ObjectStore


def committed_at(store: ObjectStore, run: str, step: int) -> float:
    """When the store saw the step's commit point (epoch seconds)."""
    return store.modified(policy_pointer_key(run, step))


def first_seen_at(store: ObjectStore, run: str, step: int) -> float | None:
    """When the store first saw the step: its first part's record, else its commit; None for neither."""
    for key in (parts_step_key(run, step), policy_pointer_key(run, step)):
        if store.exists(key):
            return store.modified(key)
    return None


def commit_order(store: ObjectStore, run: str) -> list[int]:
    """The run's committed steps, oldest commit first."""
    return [s for _, s in sorted((committed_at(store, run, s), s) for s in committed_steps(store, run))]


def newest_committed(store: ObjectStore, run: str) -> int | None:
    """The step committed last; None before the first commit."""
    order = commit_order(store, run)
    return order[-1] if order else None


def committed_after(store: ObjectStore, run: str, step: int) -> list[int]:
    """The steps committed after `step` (which must be committed), oldest first."""
    order = commit_order(store, run)
    return order[order.index(step) + 1:] if step in order else []


def committed_before(store: ObjectStore, run: str, step: int) -> list[int]:
    """The steps committed before `step`, oldest first; every committed step when `step` is not committed."""
    order = commit_order(store, run)
    return order[:order.index(step)] if step in order else order


def seen_rank(store: ObjectStore, run: str, step: int) -> tuple[float, int]:
    """A step's place among the steps the store has seen (first seen, then its number for ties); a step it
    never saw ranks first."""
    seen = first_seen_at(store, run, step)
    return (seen if seen is not None else float("-inf"), step)
