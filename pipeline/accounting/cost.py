"""A step's cost: the device-seconds its stages spent, and what speculative decoding saved of its rollout
time, by the cost model every saving figure comes from.

One speculative round of one sequence costs `f` drafter forwards and one target forward (the
target verifies the pending token and the k proposals in one pass), and yields `tau` tokens on
average:

    f        drafter forwards per round: k for an autoregressive drafter (EAGLE, EAGLE-3),
             1 for a parallel drafter (P-EAGLE proposes all k tokens in one forward)
    c        one drafter forward's time relative to one target decoding forward
    t        seconds of one target decoding forward, per generated token without a drafter

    seconds per generated token   plain: t            speculative: t * (1 + c * f) / tau
    speedup                       tau / (1 + c * f)
    saved seconds for N tokens    N * t * (1 - (1 + c * f) / tau)

A drafter whose tau is below 1 + c * f slows decoding down: its saving is negative, and the
ledger shows it as such rather than clipping it to zero. Verifying k + 1 positions costs about
one decoding forward while decoding is memory-bound, which is what rollout batches are; `t` and
`c` are measured on the same hardware and batch as the taus they are combined with (the
evaluation's own timings here, the fleet's vLLM counters in production).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.data.keys import cost_key
from pipeline.data.records import read_record
from pipeline.data.rollouts import finite_number
from pipeline.data.stage_placement import StagePlacement
from pipeline.data.store import ObjectStore
from pipeline.stages import Stage, stage_named

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class DecodingCost:
    """The timings the saving of a drafter rests on."""

    target_s_per_token: float  # t: one target decoding forward per generated token, without a drafter
    draft_cost_ratio: float  # c: one drafter forward / one target decoding forward
    drafter_forwards_per_round: int  # f: k (autoregressive) or 1 (parallel drafting)

    def __post_init__(self) -> None:
        if self.target_s_per_token <= 0 or self.draft_cost_ratio < 0 or self.drafter_forwards_per_round < 1:
            raise ValueError(f"a decoding cost needs t > 0, c >= 0 and f >= 1, got {self}")

    @property
    def round_cost(self) -> float:
        """One round in target forwards: 1 + c * f."""
        return 1.0 + self.draft_cost_ratio * self.drafter_forwards_per_round

    def speedup(self, tau: float) -> float:
        return tau / self.round_cost

    def seconds_per_token(self, tau: float) -> float:
        return self.target_s_per_token * self.round_cost / tau

    def saved_seconds(self, tau: float, tokens: int) -> float:
        """Rollout seconds `tokens` generated at `tau` save against plain decoding (negative: lost)."""
        return tokens * (self.target_s_per_token - self.seconds_per_token(tau))

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "target_s_per_token": self.target_s_per_token,
                "draft_cost_ratio": self.draft_cost_ratio,
                "drafter_forwards_per_round": self.drafter_forwards_per_round}

    @classmethod
    def from_json(cls, doc: dict) -> DecodingCost:
        if doc.get("schema_version", 1) != SCHEMA_VERSION:
            raise ValueError(f"decoding cost schema_version {doc.get('schema_version')} is not {SCHEMA_VERSION}")
        forwards = doc["drafter_forwards_per_round"]
        if isinstance(forwards, bool) or not isinstance(forwards, int) or not 1 <= forwards <= 2**31:
            raise ValueError("field drafter_forwards_per_round must be a positive integer")
        return cls(_seconds(doc["target_s_per_token"], "target_s_per_token"),
                   _seconds(doc["draft_cost_ratio"], "draft_cost_ratio"), forwards)


@dataclass(frozen=True)
class StepCost:
    """A step's entry in the cost ledger (pipeline/accounting/ledger.py), stored at `cost/<run>/step-N.json`:
    device-seconds its stages spent, and the rollout seconds the drafter that served its rollouts saved: measured
    by the step's replay where it ran, else by the cost model above."""

    step: int
    seconds: dict[Stage, float]  # device-seconds; deployment is added from the fleet's history (stored by name)
    rollout_tokens: int  # response tokens of the step's rollouts
    served_version: str | None  # the drafter the fleet ran while the rollouts were generated
    served_tau: float  # 1.0: no drafter served them
    decoding: DecodingCost | None  # timed by the step's evaluation of the served drafter; None: nothing served
    placements: tuple[StagePlacement, ...] = ()  # where its launched stages ran
    measured_saved_s: float | None = None  # the replay's: no speculation's seconds less the served drafter's

    @property
    def saved_s(self) -> float:
        if self.measured_saved_s is not None:
            return self.measured_saved_s
        return self.decoding.saved_seconds(self.served_tau, self.rollout_tokens) if self.decoding else 0.0

    @property
    def saving_measured(self) -> bool:
        return self.measured_saved_s is not None

    def spent(self, stage: Stage) -> float:
        return self.seconds.get(stage, 0.0)

    def to_json(self) -> dict:
        return {"step": self.step, "seconds": {stage.name: s for stage, s in self.seconds.items()},
                "rollout_tokens": self.rollout_tokens, "served_version": self.served_version,
                "served_tau": self.served_tau, "decoding": self.decoding.to_json() if self.decoding else None,
                "placements": [p.to_json() for p in self.placements], "measured_saved_s": self.measured_saved_s}

    @classmethod
    def from_json(cls, doc: dict) -> StepCost:
        decoding, measured = doc["decoding"], doc.get("measured_saved_s")
        served = doc["served_version"]
        if served is not None and not isinstance(served, str):
            raise TypeError("field served_version must be a string or null")
        return cls(_count(doc["step"], "step"), {stage_named(k, "step cost"): _seconds(v, f"seconds.{k}")
                                                 for k, v in doc["seconds"].items()},
                   _count(doc["rollout_tokens"], "rollout_tokens"), served, _seconds(doc["served_tau"], "served_tau"),
                   DecodingCost.from_json(decoding) if decoding else None,
                   tuple(StagePlacement.from_json(p) for p in doc.get("placements", ())),
                   None if measured is None else _seconds(measured, "measured_saved_s"))


def _seconds(value: object, field: str) -> float:
    """A stored figure as a float; ValueError naming the field for anything but a finite number (an integer of
    hundreds of digits included, which float() refuses with OverflowError)."""
    number = finite_number(value)
    if number is None:
        raise ValueError(f"field {field} must be a finite number")
    return number


def _count(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"field {field} must be an integer in [0, 2**63 - 1]")
    return value


def read_cost(store: ObjectStore, run: str, step: int) -> StepCost | None:
    key = cost_key(run, step)
    return read_record(store, key, StepCost) if store.exists(key) else None
