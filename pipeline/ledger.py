"""How old the served drafter is, and what keeping it fresh costs against what it saves: per RL
step, joined from the records the stages stored (never from the source's own log).

Lag of step s:
    served version   the drafter the fleet ran when step s was published (its commit's time)
    seen step        the newest RL step that version trained on
    lag_steps        s - seen step (None: no drafter served the step's rollouts)
    lag_s            from step s's publication until the fleet first ran a version that had seen s
                     (None: not yet)

Cost of step s, in device-seconds (GPU-seconds in production; one process's seconds here):
    spent   extraction + training + evaluation of the step, plus the deployments of the versions
            the step's training produced
    saved   the rollout seconds the served drafter saved on the step's response tokens, by the cost
            model of pipeline/cost.py with the timings the step's evaluation measured
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from pipeline.cost import DecodingCost


@dataclass(frozen=True)
class Deployment:
    """A version the whole fleet ran from `live_at` (epoch seconds) on, and what rolling it out took."""

    version: str
    live_at: float
    deploy_s: float  # replicas' deploy seconds added up


@dataclass(frozen=True)
class StepLag:
    step: int
    published_at: float
    served_version: str | None
    seen_step: int | None
    lag_steps: int | None
    lag_s: float | None


def step_lags(
    published_at: dict[int, float], deployments: list[Deployment], seen_step: dict[str, int]
) -> list[StepLag]:
    """`published_at`: step -> commit time; `deployments`: the fleet's history; `seen_step`: version ->
    newest step it trained on."""
    history = sorted(deployments, key=lambda d: d.live_at)
    times = [d.live_at for d in history]
    lags = []
    for step, at in sorted(published_at.items()):
        live = bisect.bisect_right(times, at) - 1
        served = history[live].version if live >= 0 else None
        seen = seen_step.get(served) if served else None
        caught_up = next((d.live_at for d in history if seen_step.get(d.version, -1) >= step), None)
        lags.append(StepLag(step, at, served, seen, step - seen if seen is not None else None,
                            None if caught_up is None else max(0.0, caught_up - at)))
    return lags


STAGES = ("extraction", "training", "evaluation", "deployment")


@dataclass(frozen=True)
class StepCost:
    step: int
    seconds: dict[str, float]  # stage -> device-seconds, for STAGES
    rollout_tokens: int  # response tokens of the step's rollouts
    served_tau: float  # 1.0: no drafter served them
    saved_s: float

    @property
    def spent_s(self) -> float:
        return sum(self.seconds.values())


def step_cost(
    step: int, stage_seconds: dict[str, float], rollout_tokens: int, served_tau: float,
    decoding: DecodingCost | None,
) -> StepCost:
    """The step's ledger entry; without a timed evaluation of a served drafter nothing is counted as saved."""
    seconds = {stage: round(stage_seconds.get(stage, 0.0), 3) for stage in STAGES}
    saved = decoding.saved_seconds(served_tau, rollout_tokens) if decoding else 0.0
    return StepCost(step, seconds, rollout_tokens, served_tau, round(saved, 3))


@dataclass(frozen=True)
class LedgerTotals:
    spent_s: float
    saved_s: float
    by_stage: dict[str, float]


def totals(costs: list[StepCost]) -> LedgerTotals:
    by_stage = {stage: round(sum(c.seconds[stage] for c in costs), 3) for stage in STAGES}
    return LedgerTotals(round(sum(by_stage.values()), 3), round(sum(c.saved_s for c in costs), 3), by_stage)


@dataclass(frozen=True)
class Cumulative:
    step: int
    spent_s: float  # up to and including the step
    saved_s: float


def cumulative(costs: list[StepCost]) -> list[Cumulative]:
    spent = saved = 0.0
    out = []
    for cost in costs:
        spent, saved = spent + cost.spent_s, saved + cost.saved_s
        out.append(Cumulative(cost.step, round(spent, 3), round(saved, 3)))
    return out
