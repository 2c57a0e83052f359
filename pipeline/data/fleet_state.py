"""The fleet's records: what a rolling deploy did on each replica, which drafter version the fleet runs and ran
before (fleet/<run>/state.json), and the policy last pushed to it for rollouts (fleet/<run>/policy.json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, get_args

from pipeline.data.keys import fleet_policy_key, fleet_state_key
from pipeline.data.records import RecordError, integer, number, read_record, text, typed
from pipeline.data.store import ObjectStore

# How a replica came to run its version: "hot" (new drafter weights sent to the running server), "restart"
# (restarted with the new --speculative-config), "none" (it served the version on the policy already, and only
# passed the gates), "rolled back" (a failed update, the previous version back on it; the deploy stopped there).
UpdateKind = Literal["hot", "restart", "none", "rolled back"]
UPDATE_KINDS: tuple[str, ...] = get_args(UpdateKind)


@dataclass(frozen=True)
class ReplicaDeploy:
    """One replica after a rollout: the version it runs, how it got it, and the live tau its gate measured."""

    replica: str
    version: str
    live_tau: float  # a rolled-back replica: the one recorded before, 0.0 when none was
    deploy_s: float
    restarted: bool  # its process was started anew by this deploy
    update: UpdateKind = "restart"
    note: str = ""  # why a hot update was not used or fell back, what rolled back
    paused_s: float = 0.0  # a hot update: how long its requests were held
    target: str = ""  # the policy checkpoint it serves

    def __post_init__(self) -> None:
        if self.update not in UPDATE_KINDS:
            raise ValueError(f"update {self.update!r} is not one of {UPDATE_KINDS}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> ReplicaDeploy:
        # Fields after `restarted` are absent from states written before hot updates: those restarted or gated.
        return cls(typed(doc["replica"], str, "replica"), typed(doc["version"], str, "version"),
                   number(doc["live_tau"], "live_tau"), number(doc["deploy_s"], "deploy_s"),
                   typed(doc["restarted"], bool, "restarted"),
                   doc.get("update", "restart" if doc["restarted"] else "none"),
                   typed(doc.get("note", ""), str, "note"), number(doc.get("paused_s", 0.0), "paused_s"),
                   typed(doc.get("target", ""), str, "target"))


@dataclass(frozen=True)
class DeployReport:
    """A rolling deploy that reached every replica."""

    version: str
    replicas: tuple[ReplicaDeploy, ...] = ()

    def to_json(self) -> dict:
        return {"version": self.version, "replicas": [r.to_json() for r in self.replicas]}

    @classmethod
    def from_json(cls, doc: dict) -> DeployReport:
        return cls(doc["version"], tuple(ReplicaDeploy.from_json(r) for r in doc["replicas"]))


@dataclass(frozen=True)
class Deployment:
    """A version the whole fleet ran from `live_at` (epoch seconds) on, and what rolling it out took."""

    version: str
    live_at: float
    deploy_s: float  # the replicas' deploy seconds added up

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> Deployment:
        return cls(typed(doc["version"], str, "version"), number(doc["live_at"], "live_at"),
                   number(doc["deploy_s"], "deploy_s"))


@dataclass(frozen=True)
class FleetState:
    """Which drafter version the fleet runs, on which policy step, since when (epoch seconds), and every
    version it ran before: the history the drafter's lag is read from. `replicas` says what each replica
    runs and how it got it; after a stopped deploy some may run a newer version than `version`."""

    version: str | None = None  # None: nothing deployed yet
    policy_step: int | None = None
    since: float | None = None
    replicas: tuple[ReplicaDeploy, ...] = field(default_factory=tuple)
    history: tuple[Deployment, ...] = ()  # oldest first, the current version last
    # replica -> its vLLM spec-decode counters when `version` went live (serving.metrics.SpecCounters as JSON):
    # the fleet's live tau of `version` counts from there (a hot update does not reset them)
    live_counters: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"version": self.version, "policy_step": self.policy_step, "since": self.since,
                "replicas": [r.to_json() for r in self.replicas], "history": [d.to_json() for d in self.history],
                "live_counters": self.live_counters}

    @classmethod
    def from_json(cls, doc: dict) -> FleetState:
        version, step, since = doc["version"], doc.get("policy_step"), doc.get("since")
        return cls(None if version is None else typed(version, str, "version"),
                   None if step is None else integer(step, "policy_step"),
                   None if since is None else number(since, "since"),
                   tuple(ReplicaDeploy.from_json(r) for r in typed(doc["replicas"], list, "replicas")),
                   tuple(Deployment.from_json(d) for d in typed(doc.get("history", []), list, "history")),
                   {text(name, "live_counters (a replica's name)"): _counters(c, f"live_counters.{name}")
                    for name, c in typed(doc.get("live_counters", {}), dict, "live_counters").items()})


def _counters(value: Any, field: str) -> dict:
    """A replica's spec-decode counters as the deploy stored them (serving.metrics.SpecCounters as JSON): numbers
    the live tau subtracts from the replica's counters now."""
    doc = typed(value, dict, field)
    where = f"{field}.accepted_per_position"
    per_position = {str(integer(int(j), f"{where} (its keys)")): number(v, f"{where}.{j}")
                    for j, v in typed(doc["accepted_per_position"], dict, where).items()}
    return {**{name: number(doc[name], f"{field}.{name}") for name in ("drafts", "draft_tokens", "accepted")},
            "accepted_per_position": per_position}


@dataclass(frozen=True)
class FleetPolicy:
    """The policy every replica was pushed to generate step `step`'s rollouts with (when the fleet is the rollout
    engine): a deploy after it serves this policy or a newer one, never an older one."""

    step: int
    target: str  # the checkpoint, as a replica loads it
    label: str  # the weight_version it was committed under
    at: float  # epoch seconds

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> FleetPolicy:
        return cls(integer(doc["step"], "step"), text(doc["target"], "target"), text(doc["label"], "label"),
                   number(doc["at"], "at"))


def read_fleet_state(store: ObjectStore, run: str) -> FleetState:
    """The fleet's recorded state; an empty one before the first deploy."""
    key = fleet_state_key(run)
    return read_record(store, key, FleetState) if store.exists(key) else FleetState()


def read_fleet_policy(store: ObjectStore, run: str) -> FleetPolicy | None:
    """The policy last pushed to the fleet for rollouts; None when the fleet generates none. Its target reaches a
    replica's /update_weights and `vllm serve` line, so it is checked as a trainer's checkpoint_uri is: a URI the
    store's policy allows, on a local store a path that stays inside it (symlinks followed); RecordError naming
    the file and the field otherwise."""
    key = fleet_policy_key(run)
    if not store.exists(key):
        return None
    policy = read_record(store, key, FleetPolicy)
    try:
        store.filesystem(policy.target, f"{store.uri(key)}: field target")
    except ValueError as exc:  # UriPolicyError, LocalPathError: the message names the file, the URI redacted
        raise RecordError(str(exc)) from None
    return replace(policy, target=store.resolve(policy.target))


def served_at(history: tuple[Deployment, ...], at: float) -> str | None:
    """The version the whole fleet ran at `at` (epoch seconds), by its deployment history (oldest first);
    None before its first deployment."""
    live = [d.version for d in history if d.live_at <= at]
    return live[-1] if live else None
