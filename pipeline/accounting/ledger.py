"""How old the served drafter is, and what keeping it fresh costs against what it saves: per RL
step, joined from the records the stages stored (never from the source's own log).

Lag of step s:
    served version   the drafter the fleet ran when step s was published (its commit's time)
    seen step        the newest RL step that version trained on
    lag_steps        s - seen step (None: no drafter served the step's rollouts)
    lag_s            from step s's publication until the fleet first ran a version that had seen s
                     (None: not yet)

A step's refreshed drafter (refresh/plan.py) counts as a version that has seen the step: it trained on
the step's first parts.

Cost of step s, in device-seconds (GPU-seconds in production; one process's seconds here):
    spent   extraction + training + evaluation of the step (its StepCost record), plus the
            deployments of the versions the step's training or refresh produced (the fleet's
            history), plus the refresh's training
    saved   the rollout seconds the served drafter saved on the step's response tokens (StepCost.saved_s)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.accounting.cost import StepCost, read_cost
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.fleet_state import Deployment, read_fleet_state, served_at
from pipeline.data.keys import drafter_key
from pipeline.data.refresh_record import read_refresh
from pipeline.data.store import ObjectStore
from pipeline.data.training_record import read_training
from pipeline.registry import DrafterRegistry
from pipeline.stages import DEPLOYMENT, STEP_STAGES, TRAINING, Stage


@dataclass(frozen=True)
class StepLag:
    step: int
    published_at: float
    served_version: str | None
    seen_step: int | None
    lag_steps: int | None
    lag_s: float | None


def step_lags(
    published_at: dict[int, float], deployments: tuple[Deployment, ...], seen_step: dict[str, int]
) -> list[StepLag]:
    """`published_at`: step -> commit time; `deployments`: the fleet's history; `seen_step`: version ->
    newest step it trained on."""
    history = tuple(sorted(deployments, key=lambda d: d.live_at))
    lags = []
    for step, at in sorted(published_at.items()):
        served = served_at(history, at)
        seen = seen_step.get(served) if served else None
        caught_up = next((d.live_at for d in history if seen_step.get(d.version, -1) >= step), None)
        lags.append(StepLag(step, at, served, seen, step - seen if seen is not None else None,
                            None if caught_up is None else round(max(0.0, caught_up - at), 3)))
    return lags


def with_deployments(
    costs: list[StepCost], deployments: tuple[Deployment, ...], trained_at: dict[str, int]
) -> list[StepCost]:
    """Each step's cost with the deployments of the versions its training produced (`trained_at`: version ->
    step) added to its `deployment` seconds."""
    deploy_s: dict[int, float] = {}
    for d in deployments:
        if d.version in trained_at:
            deploy_s[trained_at[d.version]] = deploy_s.get(trained_at[d.version], 0.0) + d.deploy_s
    return [replace(c, seconds={**c.seconds, DEPLOYMENT: round(c.spent(DEPLOYMENT) + deploy_s.get(c.step, 0.0), 3)})
            for c in costs]


@dataclass(frozen=True)
class LedgerTotals:
    spent_s: float
    saved_s: float
    by_stage: dict[Stage, float]


def totals(costs: list[StepCost]) -> LedgerTotals:
    by_stage = {stage: round(sum(c.spent(stage) for c in costs), 3) for stage in STEP_STAGES}
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
        spent, saved = spent + sum(cost.seconds.values()), saved + cost.saved_s
        out.append(Cumulative(cost.step, round(spent, 3), round(saved, 3)))
    return out


@dataclass(frozen=True)
class Ledger:
    """The lag and the cost of every step of a run that has been evaluated, oldest first."""

    lags: list[StepLag]
    costs: list[StepCost]

    @property
    def totals(self) -> LedgerTotals:
        return totals(self.costs)


def read_ledger(store: ObjectStore, run: str, steps: list[int]) -> Ledger:
    """The ledger of `steps` from the records the stages stored: trainings, step costs, the fleet's history."""
    trainings = [read_training(store, run, s) for s in steps if store.exists(drafter_key(run, s))]
    refreshes = [r for r in (read_refresh(store, run, s) for s in steps) if r is not None and r.version]
    trained_at = {t.version: t.step for t in trainings if t.version and t.figures}
    seen = {t.version: max(t.trained_on_steps, default=t.step) for t in trainings if t.version}
    for r in refreshes:  # a refresh trained on the step's first parts
        trained_at[r.version] = seen[r.version] = r.step
    history = read_fleet_state(store, run).history
    refresh_s = {r.step: r.train_s for r in refreshes}
    costs = [c for c in (read_cost(store, run, s) for s in steps) if c is not None]
    costs = [replace(c, seconds={**c.seconds, TRAINING: round(c.spent(TRAINING) + refresh_s.get(c.step, 0.0), 3)})
             if c.step in refresh_s else c for c in costs]
    published = {c.step: rollouts_lib.published_at(store, run, c.step) for c in costs}
    return Ledger(step_lags(published, history, seen), with_deployments(costs, history, trained_at))


def log_served(registry: DrafterRegistry, ledger: Ledger) -> None:
    """The newest step's saving and lag as metrics of the served version's MLflow run, at that RL step: a
    drafter's run shows what it saved on every step it served."""
    cost, lag = ledger.costs[-1], ledger.lags[-1]
    if cost.served_version is None:
        return
    run_id = registry.client.get_model_version(registry.model_name, cost.served_version).run_id
    registry.log_metrics(run_id, {"served_tau": cost.served_tau, "served_saved_s": cost.saved_s,
                                  "served_lag_steps": float(lag.lag_steps or 0)}, step=cost.step)
