"""The rolling update of the serving fleet: one replica at a time, so the fleet keeps serving.

With `fleet.update: hot` (the default) a replica that runs the deploy's policy already gets the new drafter's
weights in place (`pipeline.serving.hot_update`); a replica without the weight-update routes, or on a policy that
is not a local directory, is restarted with the new `--speculative-config` instead (the one way that works on
every vLLM version, `pipeline.serving.drivers`), never more than one down. A hot update that fails once weights
may have changed puts the previous drafter (and policy) back, then the replica takes the restart path. A replica
the driver knows runs that very drafter and policy already (a rerun of a deploy stopped midway, the same version
again) is not touched, only gated. Every replica passes the gates (`pipeline.serving.gates`); a replica that
fails is restarted with the previous drafter and the deploy stops.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Literal

from pipeline.data.fleet_state import DeployReport, ReplicaDeploy, UpdateKind
from pipeline.serving.drivers import ReplicaDriver, ReplicaSpec, local_directory
from pipeline.serving.gates import GateConfig, GateError, Served, check_replica, wait_healthy
from pipeline.serving.hot_update import HotUpdateFailed, HotUpdateUnsupported, Weights, hot_update

UpdateMode = Literal["hot", "restart"]


@dataclass(frozen=True)
class StagedDrafter:
    """A drafter version's checkpoint directory, as replicas read it."""

    version: str
    directory: str


def roll_back(replica: ReplicaSpec, driver: ReplicaDriver, target: str, previous: StagedDrafter,
              gates: GateConfig, alive: Callable[[], bool], policy_dir: str | None = None) -> str:
    """The previous drafter again (on the policy in `policy_dir`, the one `target` names, when the update sent a
    policy too), hot if the replica takes it, else by a restart on `target` (a replica left paused included).
    Returns how ("hot" or "restart")."""
    try:
        hot_update(replica, previous.directory, previous.version, policy_dir)
        driver.updated(replica, previous.directory, target if policy_dir else None)
        return "hot"
    except (HotUpdateFailed, HotUpdateUnsupported):
        driver.restart(replica, target, previous.directory)
        wait_healthy(replica, gates.ready_timeout_s, alive)
        return "restart"


@dataclass
class _Attempt:
    """How one replica's update went so far (becomes its ReplicaDeploy)."""

    update: UpdateKind = "restart"
    note: str = ""
    paused_s: float = 0.0


def _try_hot(replica: ReplicaSpec, driver: ReplicaDriver, target: str, version: str, drafter_dir: str,
             previous: StagedDrafter, gates: GateConfig, canary_prompts: list[list[int]],
             alive: Callable[[], bool], attempt: _Attempt, served: str) -> float | None:
    """The hot update and its gates; the live tau, or None when the replica is to be restarted instead (with
    `attempt.note` saying why, and the previous drafter back on it when the update may have changed it).
    `served`: the policy the replica runs; when it is not `target`, the new policy goes first, in place."""
    new_policy = local_directory(target) if served != target else None
    old_policy = local_directory(served) if new_policy else None
    try:
        attempt.paused_s = hot_update(replica, drafter_dir, version, new_policy,
                                      Weights(previous.directory, previous.version, old_policy))
    except HotUpdateUnsupported as exc:
        attempt.note = f"no hot update ({exc}); restarted"
        return None
    except HotUpdateFailed as exc:
        how = "hot"
        if exc.rolled_back:
            driver.updated(replica, previous.directory, served if old_policy else None)
        else:  # still paused on weights it may have half: restarted on what it had
            driver.restart(replica, served, previous.directory)
            wait_healthy(replica, gates.ready_timeout_s, alive)
            how = "restart"
        attempt.note = f"hot update failed ({exc}); rolled back to version {previous.version} by {how}; restarted"
        return None
    driver.updated(replica, drafter_dir, target if new_policy else None)
    try:
        tau = check_replica(replica, gates, canary_prompts, alive, Served(local_directory(target), drafter_dir))
    except GateError as exc:
        how = roll_back(replica, driver, served, previous, gates, alive, old_policy)
        attempt.note = f"hot-updated replica failed a gate ({exc}); rolled back to version {previous.version} " \
                       f"by {how}; restarted"
        return None
    attempt.update = "hot"
    if new_policy:
        attempt.note = "the new policy and the drafter sent in place"
    return tau


def rolling_deploy(
    replicas: list[ReplicaSpec],
    driver: ReplicaDriver,
    target: str,
    version: str,
    drafter_dir: str,
    previous: StagedDrafter | None,
    gates: GateConfig,
    canary_prompts: list[list[int]],
    update: UpdateMode = "hot",
    recorded: dict[str, ReplicaDeploy] | None = None,
) -> DeployReport:
    """Update replicas one at a time; on a failed gate restore `previous` there and stop.

    A replica already running `drafter_dir` on `target` keeps running: it only passes the gates (and is
    updated like the others if it fails them). With `update="hot"` and a `previous` to roll back to, a replica
    whose policy is known (from the driver, else from `recorded`, the fleet's recorded state) is hot-updated:
    the drafter alone when it serves `target`, `target` first when it serves another policy and both are local
    directories. Any other, and one whose hot update fails (rolled back to `previous` first, on the policy it
    served), is restarted."""
    recorded = recorded or {}
    served = Served(local_directory(target), drafter_dir)
    done: list[ReplicaDeploy] = []
    for i, replica in enumerate(replicas):
        start = time.monotonic()
        alive = functools.partial(driver.alive, replica)
        attempt, tau = _Attempt(), None
        serving = driver.serving(replica)
        if serving == (target, drafter_dir):
            with suppress(GateError):  # failing while already serving it: updated like the others
                tau = check_replica(replica, gates, canary_prompts, alive, served)
                attempt.update = "none"
        # The policy it serves: what the driver sees, else what the fleet's state recorded.
        policy = serving[0] if serving else (recorded[replica.name].target if replica.name in recorded else "")
        try:
            if tau is None and update == "hot":
                if not policy:
                    attempt.note = "the policy it serves is not known: restarted"
                elif policy != target and (local_directory(target) is None or local_directory(policy) is None):
                    attempt.note = "it serves another policy, not both on local disk: restarted"
                elif previous is None:
                    attempt.note = "no previous version to roll back to: restarted"
                else:
                    tau = _try_hot(replica, driver, target, version, drafter_dir, previous, gates, canary_prompts,
                                   alive, attempt, policy)
            if tau is None:
                driver.restart(replica, target, drafter_dir)
                tau = check_replica(replica, gates, canary_prompts, alive, served)
        except GateError as exc:
            rolled_back = ()
            if previous is not None:
                driver.restart(replica, target, previous.directory)
                wait_healthy(replica, gates.ready_timeout_s, alive)
                earlier = recorded.get(replica.name)
                rolled_back = (ReplicaDeploy(replica.name, previous.version, earlier.live_tau if earlier else 0.0,
                                             time.monotonic() - start, True, "rolled back",
                                             f"{attempt.note + '; ' if attempt.note else ''}{exc}", attempt.paused_s,
                                             target),)
            untouched = tuple(recorded[r.name] for r in replicas[i + 1:] if r.name in recorded)
            raise GateError(
                f"{exc}; rolled back to version {previous.version if previous else 'none'}; deploy of "
                f"version {version} stopped after {len(done)} of {len(replicas)} replicas",
                (*done, *rolled_back, *untouched),
            ) from None
        done.append(ReplicaDeploy(replica.name, version, tau, time.monotonic() - start,
                                  attempt.update == "restart", attempt.update, attempt.note, attempt.paused_s,
                                  target))
    return DeployReport(version, tuple(done))
