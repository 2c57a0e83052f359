"""A step's acceptance as the acceptance asset stores it: each drafter role's tau against the step's policy, and the
promotion decision."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from pipeline.data.keys import acceptance_key
from pipeline.data.records import flag, integer, number, numbers, optional, read_record, text, typed
from pipeline.data.store import ObjectStore
from pipeline.sampling import DRAFT_SAMPLE_METHODS, GREEDY, DraftSampleMethod, SamplingParams


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
        return cls(number(doc["tau"], "tau"), numbers(doc["per_position"], "per_position"),
                   integer(doc["sequences"], "sequences"), integer(doc["positions"], "positions"))


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
        return cls(text(doc["version"], "version"), number(doc["tau"], "tau"),
                   number(doc["acceptance_rate"], "acceptance_rate"), numbers(doc["per_position"], "per_position"),
                   *(integer(doc[f], f) for f in ("rounds", "drafted", "accepted", "prompts")),
                   TauEstimate.from_json(typed(estimate, dict, "estimate")) if estimate else None,
                   optional(doc.get("drafter_forwards_per_round"), number, "drafter_forwards_per_round"),
                   optional(doc.get("greedy_tau"), number, "greedy_tau"),
                   numbers(greedy_per_position, "greedy_per_position") if greedy_per_position else None)


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
        roles = {role: DrafterTau.from_json(typed(d, dict, f"drafters.{role}")) if d else None
                 for role, d in typed(doc["drafters"], dict, "drafters").items()}
        if "sampling" in doc:
            sampling = SamplingParams.from_json(doc["sampling"], "field sampling")
        else:  # written before sampling was measured: greedily, so the greedy tau is the tau
            sampling = GREEDY
            roles = {role: replace(d, greedy_tau=d.tau, greedy_per_position=d.per_position) if d else None
                     for role, d in roles.items()}
        method = doc.get("draft_sample_method", "greedy")
        if method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method {method!r} is not one of {', '.join(DRAFT_SAMPLE_METHODS)}")
        return cls(*(integer(doc[f], f) for f in ("step", "policy_version", "num_prompts", "num_speculative_tokens",
                                                "max_new_tokens")),
                   roles.get("cotrained"), roles.get("served"), roles.get("baseline"), roles.get("champion"),
                   flag(doc["promoted"], "promoted"), text(doc["decision"], "decision"),
                   optional(doc["champion_after"], text, "champion_after"), sampling, method)


def read_acceptance(store: ObjectStore, run: str, step: int) -> AcceptanceRecord:
    return read_record(store, acceptance_key(run, step), AcceptanceRecord)
