"""Deploying a registered drafter version to the serving fleet, and the fleet's recorded state.

    <data_dir>/fleet/staged/v<version>/   the checkpoint directory replicas read
    <root>/fleet/<run>/state.json         which version runs where, since when, live tau
"""

from __future__ import annotations

import functools
import ipaddress
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.config import PROJECT_ROOT, PipelineConfig
from pipeline.data import order
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.fleet_state import (
    Deployment,
    DeployReport,
    FleetState,
    ReplicaDeploy,
    read_fleet_policy,
    read_fleet_state,
)
from pipeline.data.held_out import held_out_prompts
from pipeline.data.keys import fleet_policy_key, fleet_prefix, fleet_state_key, rollouts_root
from pipeline.data.lease import hold
from pipeline.data.records import write_record
from pipeline.data.store import ObjectStore
from pipeline.registry import DrafterRegistry
from pipeline.serving import agreement
from pipeline.serving import live_tau as live_tau_lib
from pipeline.serving.drivers import (
    CommandDriver,
    ReplicaDriver,
    ReplicaSpec,
    Speculation,
    StandInDriver,
    VllmDriver,
    VllmServer,
)
from pipeline.serving.fleet import StagedDrafter, rolling_deploy
from pipeline.serving.gates import GateConfig, GateError
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
    if cfg.fleet.driver == "vllm":
        v = cfg.fleet.vllm
        server = VllmServer(PROJECT_ROOT / v.python, v.dtype, v.max_model_len, v.kv_cache_gib, tuple(v.extra_args))
        return VllmDriver(server, cfg.drafter.kind, k, cfg.data_path / "fleet" / "replicas",
                          dev_mode=cfg.fleet.update == "hot", speculation=speculation(cfg))
    # Stand-ins serve the weight-update routes (as vLLM in dev mode) when the fleet updates hot.
    return StandInDriver(k, cfg.data_path / "fleet" / "replicas", dev_mode=cfg.fleet.update == "hot",
                         speculation=speculation(cfg))


class ExposedRoutes(ValueError):
    """The fleet's configuration would leave a replica's control routes (vLLM's dev-mode weight-update routes,
    which pause serving and load weights) or its key-guarded routes open to whoever reaches its port."""


def exposed_routes(cfg: PipelineConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """Why each replica's routes would be open (none: the deploy may go). A replica naming a key variable must
    have the key; with hot updates, a replica off loopback needs a key, and a real vLLM's (whose key covers only
    /v1/*) needs `fleet.dev_routes_guarded`: the operator's statement that only the orchestrator reaches them."""
    environ = os.environ if environ is None else environ
    fleet = cfg.fleet
    hot = fleet.driver != "none" and fleet.update == "hot"
    problems = []
    for r in fleet.replicas:
        keyed = bool(environ.get(r.api_key_env)) if r.api_key_env else False
        if r.api_key_env and not keyed:
            problems.append(f"replica {r.name}: fleet.replicas[].api_key_env names {r.api_key_env}, which is not set "
                            "here: the replica would serve without its key")
        elif hot and not _loopback(r.host) and not keyed:
            problems.append(f"replica {r.name} on {r.host}: hot updates use the dev-mode routes, which pause serving "
                            "and load weights; off loopback they need an API key (fleet.replicas[].api_key_env)")
        if hot and fleet.driver == "command" and not _loopback(r.host) and not fleet.dev_routes_guarded:
            problems.append(f"replica {r.name} on {r.host}: vLLM's API key guards /v1/* only, not its dev-mode "
                            "routes; put them behind an authenticating proxy or a network policy that admits the "
                            "orchestrator alone and set fleet.dev_routes_guarded (docs/production.md), or use "
                            "fleet.update restart")
    return problems


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost: whatever it resolves to, reachable beyond this machine


def check_exposure(cfg: PipelineConfig) -> None:
    """ExposedRoutes naming every replica whose routes the configuration leaves open."""
    if problems := exposed_routes(cfg):
        raise ExposedRoutes("the fleet's configuration exposes control routes; nothing was deployed: "
                            + "; ".join(problems))


def gate_config(cfg: PipelineConfig) -> GateConfig:
    """The gates of `fleet.*`; a `vllm` fleet's live tau is held to the product's count of the canaries' rounds
    (a stand-in decodes with the product's own rule: nothing to hold it to)."""
    f = cfg.fleet
    count = None
    if f.driver == "vllm" and f.tau_agreement is not None:
        count = functools.partial(agreement.counted_tau, k=cfg.eval.num_speculative_tokens)
    return GateConfig(f.ready_timeout_s, f.canary_requests, f.canary_tokens, f.min_live_tau,
                      f.tau_agreement or 0.0, count)


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
    """The policy of the step committed last (by the store's commit time, not the step's number)."""
    step = order.newest_committed(store, cfg.run)
    if step is None:
        raise ValueError(f"no committed RL step under {rollouts_root(cfg.run)}/: no policy for the fleet to serve")
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    return ServedPolicy(step, store.resolve(pointer.checkpoint_uri),
                        [p.tolist() for p in held_out_prompts(store, cfg, step)])


def recorded_replicas(store: ObjectStore, cfg: PipelineConfig, replicas: tuple[ReplicaDeploy, ...],
                      serving: str) -> dict[str, ReplicaDeploy]:
    """What the fleet's state says each replica runs, read as untrusted input: a recorded policy is kept only if
    it is one this run committed (a step's policy pointer, resolved) or the one being served; any other path is
    dropped (the replica's policy then counts as unknown, and it restarts), so no path written into
    state.json reaches /update_weights or a `vllm serve` command line."""
    known = {serving}
    for step in rollouts_lib.committed_steps(store, cfg.run):
        try:
            known.add(store.resolve(rollouts_lib.read_policy_pointer(store, cfg.run, step).checkpoint_uri))
        except ValueError:  # a step refused at its commit point was never served
            continue
    return {r.replica: r if r.target in known else replace(r, target="") for r in replicas}


def newest_policy(store: ObjectStore, cfg: PipelineConfig, policy: ServedPolicy) -> ServedPolicy:
    """`policy`, or the policy the fleet was pushed for a newer step's rollouts (fleet as the rollout engine):
    a deploy never moves a replica back to an older policy while a newer step's rollouts decode."""
    pushed = read_fleet_policy(store, cfg.run)
    if pushed is None or pushed.target == policy.target:
        return policy
    # Newer by when the store saw the push and the served step, never by the step numbers. A refresh serves a
    # step still open (no commit point yet), so the step counts from when the store first saw it: its first
    # part's record, else its commit.
    seen = order.first_seen_at(store, cfg.run, policy.step)
    if seen is not None and store.modified(fleet_policy_key(cfg.run)) <= seen:
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
    newest committed step's. A configuration that exposes a replica's control routes is refused before anything
    is touched (`exposed_routes`)."""
    check_exposure(cfg)
    with hold(store, fleet_prefix(cfg.run), f"deploy-v{version}-{uuid.uuid4().hex[:8]}", cfg.storage.step_lease_s,
              cfg.storage.step_lease_wait_s):
        if fence is not None and (why := fence()):
            raise DeploySuperseded(why)
        staged = stage_versions(cfg, registry, version)
        policy = newest_policy(store, cfg, serving() if serving is not None else served_policy(store, cfg))
        recorded = recorded_replicas(store, cfg, read_fleet_state(store, cfg.run).replicas, policy.target)
        try:
            report = rolling_deploy(replicas(cfg), driver or make_driver(cfg), policy.target, version,
                                    str(staged.directory), staged.previous, gate_config(cfg), policy.canary_prompts,
                                    cfg.fleet.update, recorded)
        except GateError as exc:
            if exc.replicas:
                record_stopped(store, cfg.run, exc.replicas)
            raise
        # the gates passed moments ago: a replica gone since has no baseline, and no say later
        counters = live_tau_lib.read_counters(replicas(cfg)).to_json()
        record_live(store, cfg.run, registry, version, policy.step, report, counters)
    return report


def live_tau(cfg: PipelineConfig, store: ObjectStore, version: str | None) -> float | None:
    """The fleet's live tau of `version` since it went live on its replicas (`live_tau.since_live`); None when the
    fleet does not run `version`, or no replica has counted a draft of it."""
    state = read_fleet_state(store, cfg.run)
    if version is None or cfg.fleet.driver == "none" or state.version != version:
        return None
    running = {r.replica for r in state.replicas if r.version == version}
    reading = live_tau_lib.read_counters([r for r in replicas(cfg) if r.name in running])
    return live_tau_lib.since_live(state, reading, version)
