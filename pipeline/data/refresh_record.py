"""The same-step refresh's records: the refresh as its job stores it (its decision, its latency's milestones and
breakdown), and tau on the step's tail per drafter as the acceptance asset stores it."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from pipeline.data.keys import refresh_key, tail_key
from pipeline.data.records import flag, integer, integers, number, optional, read_record, text, typed
from pipeline.data.store import ObjectStore


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
        return cls(*(number(doc[f], f) for f in ("run_started_at", "worker_started_at", "extracted_at", "trained_at",
                                                   "fine_tune_s", "checked_at")),
                   optional(doc.get("deploy_started_at"), number, "deploy_started_at"),
                   optional(doc.get("live_at"), number, "live_at"))


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
        return cls(integer(doc["step"], "step"), integer(doc["part"], "part"), integers(doc["parts"], "parts"),
                   integer(doc["rollouts"], "rollouts"), number(doc["qualified_at"], "qualified_at"),
                   optional(doc["version"], text, "version"),
                   optional(doc["warm_start_version"], text, "warm_start_version"),
                   optional(doc["tau_refreshed"], number, "tau_refreshed"),
                   optional(doc["tau_champion"], number, "tau_champion"), flag(doc["deployed"], "deployed"),
                   text(doc["decision"], "decision"), optional(doc.get("live_at"), number, "live_at"),
                   number(doc.get("train_s", 0.0), "train_s"),
                   flag(doc.get("beats_champion", False), "beats_champion"),
                   RefreshTimes.from_json(typed(times, dict, "times")) if times else None)


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
        versions = {role: optional(v, text, f"versions.{role}")
                    for role, v in typed(doc["versions"], dict, "versions").items()}
        taus = {role: optional(v, number, f"taus.{role}") for role, v in typed(doc["taus"], dict, "taus").items()}
        return cls(integer(doc["step"], "step"), integers(doc["tail_parts"], "tail_parts"),
                   integer(doc["prompts"], "prompts"), versions, taus,
                   optional(doc["refresh_latency_s"], number, "refresh_latency_s"),
                   number(doc["rollout_period_s"], "rollout_period_s"))


def read_refresh(store: ObjectStore, run: str, step: int) -> RefreshRecord | None:
    key = refresh_key(run, step)
    return read_record(store, key, RefreshRecord) if store.exists(key) else None


def read_tail(store: ObjectStore, run: str, step: int) -> TailTau | None:
    key = tail_key(run, step)
    return read_record(store, key, TailTau) if store.exists(key) else None
