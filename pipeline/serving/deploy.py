"""Deploying a registered drafter version to the serving fleet, and the fleet's recorded state.

    <data_dir>/fleet/staged/v<version>/   the checkpoint directory replicas read
    <root>/fleet/<run>/state.json         which version runs where, since when, live tau
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.config import PipelineConfig
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.held_out import held_out_prompts
from pipeline.data.keys import fleet_prefix, fleet_state_key, rollouts_root
from pipeline.data.lease import hold
from pipeline.data.records import (
    Deployment,
    DeployReport,
    FleetState,
    ReplicaDeploy,
    read_fleet_policy,
    read_fleet_state,
    write_record,
)
from pipeline.data.store import ObjectStore
from pipeline.registry import DrafterRegistry
from pipeline.serving.fleet import (
    CommandDriver,
    GateConfig,
    GateError,
    ReplicaDriver,
    ReplicaSpec,
    Speculation,
    StagedDrafter,
    StandInDriver,
    rolling_deploy,
    scrape,
)
from pipeline.serving.metrics import SpecCounters
from pipeline.serving.rollouts import FleetRollouts


def replicas(cfg: PipelineConfig) -> list[ReplicaSpec]:
    return [ReplicaSpec(r.name, r.host, r.port, r.served_model_name, r.api_key_env) for r in cfg.fleet.replicas]


def speculation(cfg: PipelineConfig) -> Speculation:
    f = cfg.fleet
    return Speculation(f.draft_sample_method, None if f.speculation_max_batch == "auto" else f.speculation_max_batch)


def make_driver(cfg: PipelineConfig) -> ReplicaDriver:
    k = cfg.eval.num_speculative_tokens
    if cfg.fleet.driver == "command":
        return CommandDriver(cfg.fleet.command, cfg.drafter.kind, k, cfg.fleet.weight_transfer_backend,
                             speculation(cfg))
    # Stand-ins serve the weight-update routes (as vLLM in dev mode) when the fleet updates hot.
    return StandInDriver(k, cfg.data_path / "fleet" / "replicas", dev_mode=cfg.fleet.update == "hot",
                         speculation=speculation(cfg))


def gate_config(cfg: PipelineConfig) -> GateConfig:
    f = cfg.fleet
    return GateConfig(f.ready_timeout_s, f.canary_requests, f.canary_tokens, f.min_live_tau)


@dataclass(frozen=True)
class StagedVersions:
    """Checkpoint directories on local disk: the version to roll out and the one to roll back to."""

    version: str
    directory: Path
    previous: StagedDrafter | None  # `live`, None before the first deploy


def stage_versions(cfg: PipelineConfig, registry: DrafterRegistry, version: str) -> StagedVersions:
    """Download `version` (and `live`, when it is not on disk already) for the replicas to read. A
    checkpoint that would not load (pickle, keys or shapes not matching its config) is refused here,
    before any replica is touched, rather than by a crashed replica and a rollback: checked from its
    config.json and safetensors header alone, no tensor read."""
    from pipeline.models.checkpoint import check_drafter  # the deploy run's only model code: meta-device shapes

    stage = cfg.data_path / "fleet" / "staged"
    drafter_dir = registry.download(version, stage / f"v{version}")
    check_drafter(drafter_dir)
    live = registry.alias_version("live")
    previous = StagedDrafter(live, str(stage / f"v{live}" / "drafter")) if live else None
    if previous and not Path(previous.directory).exists():
        registry.download(live, stage / f"v{live}")
    return StagedVersions(version, drafter_dir, previous)


@dataclass(frozen=True)
class ServedPolicy:
    """What the fleet serves: the newest committed policy, with its held-out prompts as canaries."""

    step: int
    target: str  # the policy checkpoint, as a replica loads it
    canary_prompts: list[list[int]]


def served_policy(store: ObjectStore, cfg: PipelineConfig) -> ServedPolicy:
    steps = rollouts_lib.committed_steps(store, cfg.run)
    if not steps:
        raise ValueError(f"no committed RL step under {rollouts_root(cfg.run)}/: no policy for the fleet to serve")
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, steps[-1])
    return ServedPolicy(steps[-1], store.resolve(pointer.checkpoint_uri),
                        [p.tolist() for p in held_out_prompts(store, cfg, steps[-1])])


def newest_policy(store: ObjectStore, cfg: PipelineConfig, policy: ServedPolicy) -> ServedPolicy:
    """`policy`, or the policy the fleet was pushed for a newer step's rollouts (fleet as the rollout engine):
    a deploy never moves a replica back to an older policy while a newer step's rollouts decode."""
    pushed = read_fleet_policy(store, cfg.run)
    if pushed is None or pushed.step <= policy.step:
        return policy
    return replace(policy, step=pushed.step, target=pushed.target)


def rollout_fleet(cfg: PipelineConfig, store: ObjectStore) -> FleetRollouts:
    """The fleet as the rollout engine of a source that runs beside it (the demo's, the simulate job's)."""
    return FleetRollouts(replicas(cfg), make_driver(cfg), store, cfg.run, cfg.fleet.ready_timeout_s,
                         cfg.storage.step_lease_s, max(cfg.storage.step_lease_wait_s, 300.0))


def record_live(
    store: ObjectStore, run: str, registry: DrafterRegistry, version: str, policy_step: int, report: DeployReport,
    live_counters: dict[str, dict] | None = None,
) -> None:
    """The fleet runs `version` everywhere: the registry's `live` alias and the fleet's state say so; the
    state's history gains the deployment (what the drafter's lag and the cost ledger read), and the replicas'
    spec-decode counters at this moment (`live_counters`), where the fleet's live tau of `version` starts."""
    registry.set_alias("live", version)
    registry.set_version_tags(version, {"deployed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                        "fleet": ",".join(r.replica for r in report.replicas)})
    now = time.time()
    deployment = Deployment(version, now, round(sum(r.deploy_s for r in report.replicas), 3))
    history = (*read_fleet_state(store, run).history, deployment)
    write_record(store, fleet_state_key(run), FleetState(version, policy_step, now, report.replicas, history,
                                                         live_counters or {}))


class DeploySuperseded(RuntimeError):
    """A deploy's fence said the fleet runs something newer than the version: nothing was touched."""


def record_stopped(store: ObjectStore, run: str, replicas_now: tuple[ReplicaDeploy, ...]) -> None:
    """A deploy stopped midway: the fleet's version, `live` and history stay; its replicas say what each runs now
    (the ones updated before the failure the new version, the failed one rolled back)."""
    state = read_fleet_state(store, run)
    now = {r.replica: r for r in replicas_now}
    kept = tuple(r for r in state.replicas if r.replica not in now)
    write_record(store, fleet_state_key(run), replace(state, replicas=(*replicas_now, *kept)))


def deploy(cfg: PipelineConfig, store: ObjectStore, registry: DrafterRegistry, version: str,
           driver: ReplicaDriver | None = None, fence: Callable[[], str | None] | None = None,
           serving: Callable[[], ServedPolicy] | None = None) -> DeployReport:
    """Stage `version`, roll it over the fleet (hot where `fleet.update` allows, else restarts), then record it
    as `live` (registry alias + fleet state). A deploy stopped by a gate records what each replica runs. One
    deploy at a time per fleet (the champion's and a refresh's alike hold the fleet's lease); `fence`, asked
    under the lease, names why the version must not go (DeploySuperseded), or None. `serving`, asked under the
    lease, is the policy to serve (a refresh's: its step's, published with its first part); by default the
    newest committed step's."""
    with hold(store, fleet_prefix(cfg.run), f"deploy-v{version}-{uuid.uuid4().hex[:8]}", cfg.storage.step_lease_s,
              cfg.storage.step_lease_wait_s):
        if fence is not None and (why := fence()):
            raise DeploySuperseded(why)
        staged = stage_versions(cfg, registry, version)
        policy = newest_policy(store, cfg, serving() if serving is not None else served_policy(store, cfg))
        recorded = {r.replica: r for r in read_fleet_state(store, cfg.run).replicas}
        try:
            report = rolling_deploy(replicas(cfg), driver or make_driver(cfg), policy.target, version,
                                    str(staged.directory), staged.previous, gate_config(cfg), policy.canary_prompts,
                                    cfg.fleet.update, recorded)
        except GateError as exc:
            if exc.replicas:
                record_stopped(store, cfg.run, exc.replicas)
            raise
        record_live(store, cfg.run, registry, version, policy.step, report, _counters_now(replicas(cfg)))
    return report


def _counters_now(fleet: list[ReplicaSpec]) -> dict[str, dict]:
    """Each reachable replica's spec-decode counters, as JSON."""
    counters = {}
    for replica in fleet:
        try:
            counters[replica.name] = scrape(replica).to_json()
        except OSError:  # the gates passed moments ago: a replica gone since has no baseline, and no say later
            continue
    return counters


def live_tau(cfg: PipelineConfig, store: ObjectStore, version: str | None) -> float | None:
    """The fleet's live tau of `version`: the mean acceptance length its replicas counted (vLLM's spec-decode
    counters on /metrics) since `version` went live on them, summed over the replicas that run it. A replica
    restarted since counts from its start. None when the fleet does not run `version`, or no replica has counted
    a draft of it."""
    state = read_fleet_state(store, cfg.run)
    if version is None or cfg.fleet.driver == "none" or state.version != version:
        return None
    running = {r.replica for r in state.replicas if r.version == version}
    window = SpecCounters()
    for replica in replicas(cfg):
        if replica.name not in running:
            continue
        try:
            counters = scrape(replica)
        except OSError:  # an unreachable replica has no say; the deploy gates and the sensor report it
            continue
        start = state.live_counters.get(replica.name)
        if start is not None and counters.drafts >= start["drafts"]:
            counters = counters - SpecCounters.from_json(start)
        window = SpecCounters(window.drafts + counters.drafts, window.draft_tokens + counters.draft_tokens,
                              window.accepted + counters.accepted)
    return window.mean_acceptance_length
