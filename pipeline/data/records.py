"""What one stage stores for the next: a frozen record per stored JSON document.

    buffer/<run>/step-000123/_manifest.json   BufferRecord       the drafter_buffer asset -> training
    drafter/<run>/step-000123.json            TrainingRecord     the drafter asset -> acceptance, reports
    acceptance/<run>/step-000123.json         AcceptanceRecord   the acceptance asset -> reports, plots
    cost/<run>/step-000123.json               StepCost           (pipeline/accounting/cost.py) the acceptance asset
                                                                 -> schedules, the ledger
    replay/<run>/step-000123.json             RolloutReplay      the acceptance asset -> the ledger, reports, plots
    placement/<run>/step-000123/<stage>.json  StagePlacement     a launched stage's worker -> its asset, the ledger
    fleet/<run>/state.json                    FleetState         the fleet asset -> status, the demo, the ledger
    refresh/<run>/step-000123.json            RefreshRecord      the refresh job -> tail tau, reports
    tail/<run>/step-000123.json               TailTau            the acceptance asset -> reports, MLflow
    (not stored)                              DeployReport       a rolling deploy -> the fleet asset

Each record writes `schema_version` into its JSON; a document without one is version 1 (what
was stored before records carried it). A document this code cannot read raises RecordError
naming its key.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol, TypeVar, get_args

from pipeline.data.keys import (
    acceptance_key,
    drafter_key,
    fleet_policy_key,
    fleet_state_key,
    placement_key,
    refresh_key,
    replay_key,
    tail_key,
)
from pipeline.data.rollouts import INT64_MAX, finite_number
from pipeline.data.store import ObjectStore
from pipeline.sampling import DRAFT_SAMPLE_METHODS, GREEDY, DraftSampleMethod, SamplingParams
from pipeline.stages import STEP_STAGES, Stage, stage_named

SCHEMA_VERSION = 1


class RecordError(ValueError):
    """A stored record that this code cannot read (another schema version, a missing or mistyped field)."""


class _Record(Protocol):
    def to_json(self) -> dict: ...

    @classmethod
    def from_json(cls, doc: dict) -> Any: ...


R = TypeVar("R", bound=_Record)
T = TypeVar("T")


def _typed(value: Any, kind: type, field: str) -> Any:
    """`value` if it is a `kind` (a bool is no int here); TypeError naming the field otherwise: a stored record is
    read as untrusted input (parse_record names the key)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"field {field} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def _number(value: Any, field: str) -> float:
    """A finite number as a float; ValueError naming the field for NaN, an infinity or an integer too large for a
    float (a stored number of hundreds of digits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"field {field} must be a number, not {type(value).__name__}")
    number = finite_number(value)
    if number is None:
        raise ValueError(f"field {field} must be a finite number")
    return number


def _int(value: Any, field: str, low: int = 0) -> int:
    """An integer in [low, 2**63 - 1] (what the pipeline stores as int64: steps, counts, sizes)."""
    _typed(value, int, field)
    if not low <= value <= INT64_MAX:
        raise ValueError(f"field {field} must be an integer in [{low}, 2**63 - 1]")
    return value


def _optional(value: Any, read: Callable[[Any, str], T], field: str) -> T | None:
    return None if value is None else read(value, field)


def _text(value: Any, field: str) -> str:
    return _typed(value, str, field)


def _flag(value: Any, field: str) -> bool:
    return _typed(value, bool, field)


def _numbers(value: Any, field: str) -> tuple[float, ...]:
    return tuple(_number(v, f"{field}[{i}]") for i, v in enumerate(_typed(value, list, field)))


def _ints(value: Any, field: str) -> tuple[int, ...]:
    return tuple(_int(v, f"{field}[{i}]") for i, v in enumerate(_typed(value, list, field)))


def write_record(store: ObjectStore, key: str, record: _Record) -> None:
    store.write_json(key, {"schema_version": SCHEMA_VERSION, **record.to_json()})


def read_record(store: ObjectStore, key: str, kind: type[R]) -> R:
    """`kind` read from `key`; RecordError naming the key when the document is not one this code reads."""
    return parse_record(store.read_json(key), kind, key)


def parse_record(doc: object, kind: type[R], where: str) -> R:
    if not isinstance(doc, dict):
        raise RecordError(f"{where}: not a JSON object, cannot read it as a {kind.__name__}")
    version = doc.get("schema_version", 1)
    if version != SCHEMA_VERSION:
        raise RecordError(f"{where}: {kind.__name__} schema_version {version!r}; this code reads version "
                          f"{SCHEMA_VERSION}")
    try:
        return kind.from_json(doc)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"{where}: not a {kind.__name__} of schema_version {SCHEMA_VERSION} "
                          f"({type(exc).__name__}: {exc})") from None


# --- the cross-step buffer -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BufferEntry:
    """One sample in the buffer, addressed by (step, sample_id) and found at (shard, row)."""

    step: int
    sample_id: str
    shard: str
    row: int
    tokens: int

    @classmethod
    def from_json(cls, doc: Any, field: str) -> BufferEntry:
        doc = _typed(doc, dict, field)
        return cls(_int(doc["step"], f"{field}.step"), _text(doc["sample_id"], f"{field}.sample_id"),
                   _text(doc["shard"], f"{field}.shard"), _int(doc["row"], f"{field}.row"),
                   _int(doc["tokens"], f"{field}.tokens"))


def composition(entries: tuple[BufferEntry, ...] | list[BufferEntry]) -> dict[int, int]:
    """Samples per RL step, oldest step first."""
    return dict(sorted(Counter(e.step for e in entries).items()))


@dataclass(frozen=True)
class BufferRecord:
    """The samples a step's drafter trains on: pointers into the steps' shards, never a copy."""

    step: int
    entries: tuple[BufferEntry, ...]

    @property
    def num_samples(self) -> int:
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(e.tokens for e in self.entries)

    @property
    def composition(self) -> dict[int, int]:
        return composition(self.entries)

    def to_json(self) -> dict:
        return {"step": self.step, "num_samples": self.num_samples, "num_tokens": self.num_tokens,
                "composition": {str(k): v for k, v in self.composition.items()},
                "entries": [asdict(e) for e in self.entries]}

    @classmethod
    def from_json(cls, doc: dict) -> BufferRecord:
        return cls(_int(doc["step"], "step"), tuple(BufferEntry.from_json(e, f"entries[{i}]")
                                                   for i, e in enumerate(_typed(doc["entries"], list, "entries"))))


# --- a step's training outcome -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingFigures:
    """What a training that ran ended with."""

    iterations: int
    resumed_from_iteration: int
    loss: float
    vloss: float
    ploss: float
    accuracy: float
    wall_s: float
    tokens_per_s: float
    loss_history: tuple[float, ...]

    def to_json(self) -> dict:
        return {**asdict(self), "loss_history": list(self.loss_history)}

    @classmethod
    def from_json(cls, doc: dict) -> TrainingFigures:
        return cls(_int(doc["iterations"], "iterations"), _int(doc["resumed_from_iteration"], "resumed_from_iteration"),
                   *(_number(doc[f], f) for f in ("loss", "vloss", "ploss", "accuracy", "wall_s", "tokens_per_s")),
                   _numbers(doc["loss_history"], "loss_history"))


@dataclass(frozen=True)
class TrainingRecord:
    """A step's training stage: trained (and what), reused, or skipped, and why."""

    step: int
    trained: bool
    reason: str
    buffer_samples: int
    run_id: str | None = None
    version: str | None = None  # the registered drafter version this step's training produced or reused
    warm_start_version: str | None = None
    trained_on_steps: tuple[int, ...] = ()
    requested_by: str | None = None  # why a retraining was requested off the schedule (e.g. live tau too low)
    figures: TrainingFigures | None = None  # None: nothing ran at this step

    def to_json(self) -> dict:
        # the figures stand flat beside the outcome, as every stored record has them
        return {"step": self.step, "trained": self.trained, "reason": self.reason,
                "buffer_samples": self.buffer_samples, "run_id": self.run_id, "version": self.version,
                "warm_start_version": self.warm_start_version, "trained_on_steps": list(self.trained_on_steps),
                "requested_by": self.requested_by, **(self.figures.to_json() if self.figures else {})}

    @classmethod
    def from_json(cls, doc: dict) -> TrainingRecord:
        return cls(_int(doc["step"], "step"), _flag(doc["trained"], "trained"), _text(doc["reason"], "reason"),
                   _int(doc["buffer_samples"], "buffer_samples"), _optional(doc.get("run_id"), _text, "run_id"),
                   _optional(doc.get("version"), _text, "version"),
                   _optional(doc.get("warm_start_version"), _text, "warm_start_version"),
                   _ints(doc.get("trained_on_steps", []), "trained_on_steps"),
                   _optional(doc.get("requested_by"), _text, "requested_by"),
                   TrainingFigures.from_json(doc) if "iterations" in doc else None)


# --- a step's acceptance ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TauEstimate:
    """The teacher-forced acceptance estimate: one pass over held-out rollouts."""

    tau: float
    per_position: tuple[float, ...]
    sequences: int  # rollouts read
    positions: int  # start positions whose first step counts

    def to_json(self) -> dict:
        return {**asdict(self), "per_position": list(self.per_position)}

    @classmethod
    def from_json(cls, doc: dict) -> TauEstimate:
        return cls(_number(doc["tau"], "tau"), _numbers(doc["per_position"], "per_position"),
                   _int(doc["sequences"], "sequences"), _int(doc["positions"], "positions"))


@dataclass(frozen=True)
class DrafterTau:
    """One drafter version measured by speculative decoding on the step's held-out prompts, at the record's sampling
    parameters (`tau`, its parts) and greedily (`greedy_tau`)."""

    version: str
    tau: float
    acceptance_rate: float
    per_position: tuple[float, ...]
    rounds: int
    drafted: int
    accepted: int
    prompts: int
    estimate: TauEstimate | None = None  # None: no held-out response was long enough to estimate on
    drafter_forwards_per_round: float | None = None  # k (EAGLE-1/2, EAGLE-3) or 1 (P-EAGLE); None: not counted
    greedy_tau: float | None = None  # at temperature 0; None: not measured
    greedy_per_position: tuple[float, ...] | None = None

    def to_json(self) -> dict:
        return {**asdict(self), "per_position": list(self.per_position),
                "estimate": self.estimate.to_json() if self.estimate else None,
                "greedy_per_position": list(self.greedy_per_position) if self.greedy_per_position else None}

    @classmethod
    def from_json(cls, doc: dict) -> DrafterTau:
        estimate, greedy_per_position = doc.get("estimate"), doc.get("greedy_per_position")
        return cls(_text(doc["version"], "version"), _number(doc["tau"], "tau"),
                   _number(doc["acceptance_rate"], "acceptance_rate"), _numbers(doc["per_position"], "per_position"),
                   *(_int(doc[f], f) for f in ("rounds", "drafted", "accepted", "prompts")),
                   TauEstimate.from_json(_typed(estimate, dict, "estimate")) if estimate else None,
                   _optional(doc.get("drafter_forwards_per_round"), _number, "drafter_forwards_per_round"),
                   _optional(doc.get("greedy_tau"), _number, "greedy_tau"),
                   _numbers(greedy_per_position, "greedy_per_position") if greedy_per_position else None)


NO_DRAFTER_TAU = 1.0  # without a drafter every target forward yields one token


@dataclass(frozen=True)
class AcceptanceRecord:
    """The step's drafters measured against the step's policy, and the promotion decision.

    Each role's measurement; None when there was no such drafter at this step:
        cotrained  the newest drafter (the `challenger`), trained on data up to this step
        served     what the fleet ran when the step was published: what served this step's rollouts
        baseline   the first drafter ever trained, never retrained
        incumbent  what a new drafter must beat: the drafter the fleet runs at the decision (the `live` alias:
                   a same-step refresh may run there), else the `champion` (stored under the key "champion")

    Every tau is at `sampling`, the rollouts' own parameters, with the fleet's `draft_sample_method`; records
    written before sampling was measured were greedy, and read as such.
    """

    step: int
    policy_version: int
    num_prompts: int
    num_speculative_tokens: int
    max_new_tokens: int
    cotrained: DrafterTau | None
    served: DrafterTau | None
    baseline: DrafterTau | None
    incumbent: DrafterTau | None
    promoted: bool
    decision: str
    champion_after: str | None
    sampling: SamplingParams = GREEDY
    draft_sample_method: DraftSampleMethod = "greedy"

    def measured(self) -> dict[str, DrafterTau]:
        """The roles that had a drafter, by their stored names."""
        return {role: d for role, d in self.roles().items() if d is not None}

    def roles(self) -> dict[str, DrafterTau | None]:
        """Every role, by its stored name (the incumbent's is "champion"); None where the step had no such drafter."""
        return {"cotrained": self.cotrained, "served": self.served, "baseline": self.baseline,
                "champion": self.incumbent}

    def to_json(self) -> dict:
        return {"step": self.step, "policy_version": self.policy_version, "num_prompts": self.num_prompts,
                "num_speculative_tokens": self.num_speculative_tokens, "max_new_tokens": self.max_new_tokens,
                "drafters": {role: d.to_json() if d else None for role, d in self.roles().items()},
                "promoted": self.promoted, "decision": self.decision, "champion_after": self.champion_after,
                "sampling": self.sampling.to_json(), "draft_sample_method": self.draft_sample_method}

    @classmethod
    def from_json(cls, doc: dict) -> AcceptanceRecord:
        roles = {role: DrafterTau.from_json(_typed(d, dict, f"drafters.{role}")) if d else None
                 for role, d in _typed(doc["drafters"], dict, "drafters").items()}
        if "sampling" in doc:
            sampling = SamplingParams.from_json(doc["sampling"], "field sampling")
        else:  # written before sampling was measured: greedily, so the greedy tau is the tau
            sampling = GREEDY
            roles = {role: replace(d, greedy_tau=d.tau, greedy_per_position=d.per_position) if d else None
                     for role, d in roles.items()}
        method = doc.get("draft_sample_method", "greedy")
        if method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method {method!r} is not one of {', '.join(DRAFT_SAMPLE_METHODS)}")
        return cls(*(_int(doc[f], f) for f in ("step", "policy_version", "num_prompts", "num_speculative_tokens",
                                                "max_new_tokens")),
                   roles.get("cotrained"), roles.get("served"), roles.get("baseline"), roles.get("champion"),
                   _flag(doc["promoted"], "promoted"), _text(doc["decision"], "decision"),
                   _optional(doc["champion_after"], _text, "champion_after"), sampling, method)


# --- the fleet -------------------------------------------------------------------------------------------------


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
        return cls(_typed(doc["replica"], str, "replica"), _typed(doc["version"], str, "version"),
                   _number(doc["live_tau"], "live_tau"), _number(doc["deploy_s"], "deploy_s"),
                   _typed(doc["restarted"], bool, "restarted"),
                   doc.get("update", "restart" if doc["restarted"] else "none"),
                   _typed(doc.get("note", ""), str, "note"), _number(doc.get("paused_s", 0.0), "paused_s"),
                   _typed(doc.get("target", ""), str, "target"))


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
        return cls(_typed(doc["version"], str, "version"), _number(doc["live_at"], "live_at"),
                   _number(doc["deploy_s"], "deploy_s"))


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
        return cls(None if version is None else _typed(version, str, "version"),
                   None if step is None else _int(step, "policy_step"),
                   None if since is None else _number(since, "since"),
                   tuple(ReplicaDeploy.from_json(r) for r in _typed(doc["replicas"], list, "replicas")),
                   tuple(Deployment.from_json(d) for d in _typed(doc.get("history", []), list, "history")),
                   {_text(name, "live_counters (a replica's name)"): _counters(c, f"live_counters.{name}")
                    for name, c in _typed(doc.get("live_counters", {}), dict, "live_counters").items()})


def _counters(value: Any, field: str) -> dict:
    """A replica's spec-decode counters as the deploy stored them (serving.metrics.SpecCounters as JSON): numbers
    the live tau subtracts from the replica's counters now."""
    doc = _typed(value, dict, field)
    where = f"{field}.accepted_per_position"
    per_position = {str(_int(int(j), f"{where} (its keys)")): _number(v, f"{where}.{j}")
                    for j, v in _typed(doc["accepted_per_position"], dict, where).items()}
    return {**{name: _number(doc[name], f"{field}.{name}") for name in ("drafts", "draft_tokens", "accepted")},
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
        return cls(_int(doc["step"], "step"), _text(doc["target"], "target"), _text(doc["label"], "label"),
                   _number(doc["at"], "at"))


# --- the measured rollout speedup ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmReplay:
    """One arm of a step's replay (evaluation/replay.py): the step's requests decoded with one drafter, or none."""

    version: str | None  # the registered drafter; None: no speculation
    seconds: float  # wall time, from the first request's prefill to the last completion
    tokens: int  # tokens generated, all requests together
    speculative_rows: int  # rows of speculative rounds (a request in a round counts once)
    plain_rows: int  # rows of plain rounds
    tau: float  # tokens a row got from a speculative round (1.0: none ran)
    tail_seconds: float  # the record's tail_batch longest requests decoded on their own
    tail_tokens: int
    threshold: int  # the batch threshold the arm's scheduler ended with
    by_batch: dict[int, tuple[float, int, int]] = field(default_factory=dict)  # batch bucket -> seconds, tokens, rounds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tail_tokens_per_s(self) -> float:
        return self.tail_tokens / self.tail_seconds if self.tail_seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "by_batch": {str(b): list(v) for b, v in self.by_batch.items()}}

    @classmethod
    def from_json(cls, doc: dict) -> ArmReplay:
        by_batch = {}
        for bucket, figures in _typed(doc.get("by_batch", {}), dict, "by_batch").items():
            where = f"by_batch.{bucket}"
            seconds, tokens, rounds = _typed(figures, list, where)
            by_batch[_int(int(bucket), f"{where} (its key)")] = (_number(seconds, f"{where}[0]"),
                                                                 _int(tokens, f"{where}[1]"),
                                                                 _int(rounds, f"{where}[2]"))
        return cls(_optional(doc["version"], _text, "version"), _number(doc["seconds"], "seconds"),
                   _int(doc["tokens"], "tokens"), _int(doc["speculative_rows"], "speculative_rows"),
                   _int(doc["plain_rows"], "plain_rows"), _number(doc["tau"], "tau"),
                   _number(doc["tail_seconds"], "tail_seconds"), _int(doc["tail_tokens"], "tail_tokens"),
                   _int(doc["threshold"], "threshold"), by_batch)


@dataclass(frozen=True)
class RolloutReplay:
    """A step's rollouts replayed after the step on an idle decoder, one arm per drafter role, on the same requests
    and seeds: the rollout speedup measured. Arms: none (no drafter), baseline, served, cotrained."""

    step: int
    requests: int
    tokens: int  # tokens each arm generates
    tail_batch: int
    sampling: SamplingParams
    draft_sample_method: DraftSampleMethod
    arms: dict[str, ArmReplay]

    def batch_speedups(self, arm: str, over: str = "none") -> dict[int, float]:
        """Per batch bucket both arms ran rounds at (batch-size buckets, scheduler.bucket): tokens/s of `arm` over
        `over`'s there."""
        a, b = self.arms.get(arm), self.arms.get(over)
        if a is None or b is None:
            return {}
        def rates(replay: ArmReplay) -> dict[int, float]:
            return {batch: tokens / seconds for batch, (seconds, tokens, _) in replay.by_batch.items() if seconds > 0}

        mine, theirs = rates(a), rates(b)
        return {batch: mine[batch] / theirs[batch] for batch in sorted(mine.keys() & theirs.keys()) if theirs[batch]}

    def speedup(self, arm: str, over: str = "none", tail: bool = False) -> float | None:
        """Tokens per second of `arm` over `over`'s, over the whole step or its tail; None when either did not run
        (no such drafter, or no round in the tail)."""
        a, b = self.arms.get(arm), self.arms.get(over)
        if a is None or b is None:
            return None
        mine, theirs = (a.tail_tokens_per_s, b.tail_tokens_per_s) if tail else (a.tokens_per_s, b.tokens_per_s)
        return mine / theirs if mine > 0 and theirs > 0 else None

    @property
    def saved_s(self) -> float | None:
        """Rollout seconds the served drafter saved on the step: no speculation's wall time less the served arm's."""
        served, none = self.arms.get("served"), self.arms.get("none")
        return None if served is None or none is None else round(none.seconds - served.seconds, 4)

    def to_json(self) -> dict:
        return {"step": self.step, "requests": self.requests, "tokens": self.tokens, "tail_batch": self.tail_batch,
                "sampling": self.sampling.to_json(), "draft_sample_method": self.draft_sample_method,
                "arms": {arm: a.to_json() for arm, a in self.arms.items()}}

    @classmethod
    def from_json(cls, doc: dict) -> RolloutReplay:
        method = doc["draft_sample_method"]
        if method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method {method!r} is not one of {', '.join(DRAFT_SAMPLE_METHODS)}")
        return cls(_int(doc["step"], "step"), _int(doc["requests"], "requests"), _int(doc["tokens"], "tokens"),
                   _int(doc["tail_batch"], "tail_batch"), SamplingParams.from_json(doc["sampling"], "field sampling"),
                   method, {str(arm): ArmReplay.from_json(_typed(a, dict, f"arms.{arm}"))
                            for arm, a in _typed(doc["arms"], dict, "arms").items()})


# --- where a launched stage ran -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlacement:
    """Where a launched stage of a step ran, as its worker measured it."""

    stage: Stage  # stored by its name
    where: str  # process (a subprocess of the Dagster run) | pod (a Kubernetes pod) | ray (a Ray job on a cluster)
    ranks: int
    device: str  # the torch device of rank 0, with the GPU's name on CUDA
    peak_memory_bytes: int  # the largest rank's peak: resident host memory, or allocated GPU memory on CUDA
    seconds: float  # wall time of the stage's work in its worker, from start-up to its result
    waited_s: float = 0.0  # a Ray job: submitted -> its process started (waiting for its resources, then its start)

    def metadata(self) -> dict[str, str | int | float]:
        """The figures as a materialization shows them."""
        return {"ran_in": self.where, "ranks": self.ranks, "device": self.device,
                "peak_memory_gb": round(self.peak_memory_bytes / 1e9, 3), "stage_seconds": round(self.seconds, 2),
                "waited_seconds": round(self.waited_s, 2)}

    def to_json(self) -> dict:
        return {"stage": self.stage.name, "where": self.where, "ranks": self.ranks, "device": self.device,
                "peak_memory_bytes": self.peak_memory_bytes, "seconds": self.seconds, "waited_s": self.waited_s}

    @classmethod
    def from_json(cls, doc: dict) -> StagePlacement:
        return cls(stage_named(doc["stage"], "stage placement"), _typed(doc["where"], str, "where"),
                   _int(doc["ranks"], "ranks"), _typed(doc["device"], str, "device"),
                   _int(doc["peak_memory_bytes"], "peak_memory_bytes"), _number(doc["seconds"], "seconds"),
                   _number(doc.get("waited_s", 0.0), "waited_s"))  # a record without it: its stage never queued


def read_placements(store: ObjectStore, run: str, step: int) -> tuple[StagePlacement, ...]:
    """The placements the step's launched stages recorded, in stage order."""
    keys = [placement_key(run, step, stage) for stage in STEP_STAGES if stage.launched]
    return tuple(read_record(store, key, StagePlacement) for key in keys if store.exists(key))


# --- the same-step refresh ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RefreshBreakdown:
    """Where a refresh's latency went, in seconds, in order (they add up to `total_s`):

        wait_s        qualifying part published -> the refresh run's asset began: the sensor's poll, the run's start
        launch_s      -> the refresh process began its work: process start and imports (what a warm worker saves)
        extract_s     -> the parts' hidden states stored
        fine_tune_s   the training loop itself
        train_io_s    around it: loading the policy and the champion, the MLflow run, registering the version
        check_s       -> tau of the refreshed drafter and the champion measured on the parts' held-out rollouts
        handoff_s     -> the deploy began: the record and MLflow tags, the process's exit, back in the run
        deploy_s      -> every replica runs it: the fleet's lease, staging, the update and its gates"""

    wait_s: float
    launch_s: float
    extract_s: float
    fine_tune_s: float
    train_io_s: float
    check_s: float
    handoff_s: float
    deploy_s: float | None  # None: not deployed

    @property
    def total_s(self) -> float:
        return round(sum(v for v in asdict(self).values() if v is not None), 3)

    def to_json(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}

    def metadata(self) -> dict[str, float]:
        """As Dagster metadata (numbers it plots; -1: not deployed)."""
        return {f"latency_{k}": (-1.0 if v is None else v) for k, v in self.to_json().items()}

    @classmethod
    def mean(cls, breakdowns: list[RefreshBreakdown]) -> RefreshBreakdown | None:
        """The mean of each segment over deployed refreshes; None without one."""
        deployed = [b for b in breakdowns if b.deploy_s is not None]
        if not deployed:
            return None
        return cls(*(round(sum(getattr(b, f) for b in deployed) / len(deployed), 3)
                     for f in cls.__dataclass_fields__))


@dataclass(frozen=True)
class RefreshTimes:
    """Epoch seconds of a refresh's milestones (one clock: the run and its process share the machine, or their
    clocks are synchronized), from which its latency breakdown follows."""

    run_started_at: float  # the refresh run's asset began
    worker_started_at: float  # the refresh process began its work
    extracted_at: float
    trained_at: float  # the fine-tuned drafter registered
    fine_tune_s: float  # the training loop's own seconds within extracted_at..trained_at
    checked_at: float
    deploy_started_at: float | None = None
    live_at: float | None = None

    def breakdown(self, qualified_at: float) -> RefreshBreakdown:
        r = functools.partial(round, ndigits=3)
        train_s = self.trained_at - self.extracted_at
        return RefreshBreakdown(
            r(self.run_started_at - qualified_at), r(self.worker_started_at - self.run_started_at),
            r(self.extracted_at - self.worker_started_at), r(self.fine_tune_s), r(max(0.0, train_s - self.fine_tune_s)),
            r(self.checked_at - self.trained_at),
            r((self.deploy_started_at or self.checked_at) - self.checked_at),
            None if self.live_at is None or self.deploy_started_at is None
            else r(self.live_at - self.deploy_started_at))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> RefreshTimes:
        return cls(*(_number(doc[f], f) for f in ("run_started_at", "worker_started_at", "extracted_at", "trained_at",
                                                   "fine_tune_s", "checked_at")),
                   _optional(doc.get("deploy_started_at"), _number, "deploy_started_at"),
                   _optional(doc.get("live_at"), _number, "live_at"))


@dataclass(frozen=True)
class RefreshRecord:
    """A step's refresh: the champion fine-tuned on the step's first parts, and whether it went to the fleet.

    Times are epoch seconds: `qualified_at` is the publication of the part that brought the step to
    `refresh.min_share` (the latency's start), `live_at` when the whole fleet ran the refreshed drafter."""

    step: int
    part: int  # the qualifying part: the refresh trained on the parts up to it
    parts: tuple[int, ...]  # the parts it read
    rollouts: int  # rows of those parts
    qualified_at: float
    version: str | None  # the registered refreshed drafter; None: the training did not run
    warm_start_version: str | None  # the champion it was fine-tuned from
    tau_refreshed: float | None  # on the held-out rollouts of its parts, against the step's policy
    tau_champion: float | None
    deployed: bool
    decision: str  # why it was (not) deployed
    live_at: float | None = None
    train_s: float = 0.0  # the refresh's device-seconds of training
    beats_champion: bool = False  # by refresh.margin on the parts' held-out rollouts: it goes to the fleet
    times: RefreshTimes | None = None  # its milestones; None in records written before they were kept

    @property
    def latency_s(self) -> float | None:
        """From the qualifying part's publication to the whole fleet serving the refreshed drafter."""
        return None if self.live_at is None else round(self.live_at - self.qualified_at, 3)

    @property
    def breakdown(self) -> RefreshBreakdown | None:
        return None if self.times is None else self.times.breakdown(self.qualified_at)

    def to_json(self) -> dict:
        return {**asdict(self), "parts": list(self.parts), "times": self.times.to_json() if self.times else None}

    @classmethod
    def from_json(cls, doc: dict) -> RefreshRecord:
        times = doc.get("times")
        return cls(_int(doc["step"], "step"), _int(doc["part"], "part"), _ints(doc["parts"], "parts"),
                   _int(doc["rollouts"], "rollouts"), _number(doc["qualified_at"], "qualified_at"),
                   _optional(doc["version"], _text, "version"),
                   _optional(doc["warm_start_version"], _text, "warm_start_version"),
                   _optional(doc["tau_refreshed"], _number, "tau_refreshed"),
                   _optional(doc["tau_champion"], _number, "tau_champion"), _flag(doc["deployed"], "deployed"),
                   _text(doc["decision"], "decision"), _optional(doc.get("live_at"), _number, "live_at"),
                   _number(doc.get("train_s", 0.0), "train_s"),
                   _flag(doc.get("beats_champion", False), "beats_champion"),
                   RefreshTimes.from_json(_typed(times, dict, "times")) if times else None)


TAIL_ROLES = ("start", "refreshed", "whole_step")


@dataclass(frozen=True)
class TailTau:
    """Tau on the held-out prompts of a step's tail (its parts after the refresh's qualifying part), per drafter:

        start       the drafter the fleet served when the step's first part was published
        refreshed   the step's refreshed drafter (None: no refresh, or it did not reach the fleet)
        whole_step  the drafter trained on the whole step (the step's co-trained drafter)

    and the refresh's latency against the step's rollout period (first part to commit)."""

    step: int
    tail_parts: tuple[int, ...]
    prompts: int
    versions: dict[str, str | None]  # role -> registered version
    taus: dict[str, float | None]  # role -> tau; 1.0 for `start` when no drafter served
    refresh_latency_s: float | None
    rollout_period_s: float

    @property
    def latency_share(self) -> float | None:
        if self.refresh_latency_s is None or self.rollout_period_s <= 0:
            return None
        return round(self.refresh_latency_s / self.rollout_period_s, 4)

    def metadata(self) -> dict:
        """Tau per drafter and the refresh's latency as Dagster metadata (numbers it plots; -1: none)."""
        metadata: dict = {f"tail_tau_{role}": round(tau, 3) if tau is not None else -1.0
                          for role, tau in self.taus.items()}
        metadata.update({"tail_parts": str(list(self.tail_parts)), "tail_prompts": self.prompts,
                         "refresh_latency_s": self.refresh_latency_s if self.refresh_latency_s is not None else -1.0,
                         "refresh_latency_share": self.latency_share if self.latency_share is not None else -1.0})
        return metadata

    def to_json(self) -> dict:
        return {**asdict(self), "tail_parts": list(self.tail_parts), "latency_share": self.latency_share}

    @classmethod
    def from_json(cls, doc: dict) -> TailTau:
        versions = {role: _optional(v, _text, f"versions.{role}")
                    for role, v in _typed(doc["versions"], dict, "versions").items()}
        taus = {role: _optional(v, _number, f"taus.{role}") for role, v in _typed(doc["taus"], dict, "taus").items()}
        return cls(_int(doc["step"], "step"), _ints(doc["tail_parts"], "tail_parts"), _int(doc["prompts"], "prompts"),
                   versions, taus, _optional(doc["refresh_latency_s"], _number, "refresh_latency_s"),
                   _number(doc["rollout_period_s"], "rollout_period_s"))


def read_refresh(store: ObjectStore, run: str, step: int) -> RefreshRecord | None:
    key = refresh_key(run, step)
    return read_record(store, key, RefreshRecord) if store.exists(key) else None


def read_tail(store: ObjectStore, run: str, step: int) -> TailTau | None:
    key = tail_key(run, step)
    return read_record(store, key, TailTau) if store.exists(key) else None


def read_training(store: ObjectStore, run: str, step: int) -> TrainingRecord:
    return read_record(store, drafter_key(run, step), TrainingRecord)


def read_acceptance(store: ObjectStore, run: str, step: int) -> AcceptanceRecord:
    return read_record(store, acceptance_key(run, step), AcceptanceRecord)


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


def read_replay(store: ObjectStore, run: str, step: int) -> RolloutReplay | None:
    key = replay_key(run, step)
    return read_record(store, key, RolloutReplay) if store.exists(key) else None

