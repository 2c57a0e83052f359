"""When a step's drafter trains: on an interval, when the champion's acceptance has dropped, or
when retraining is expected to save more rollout time than it costs.

    interval    every `train.training_interval_steps` steps (FastRL's trigger)
    acceptance  the champion's tau fell by more than `train.schedule.tau_drop` since it was promoted,
                or its live tau is below `fleet.live_tau_floor`
    cost        the rollout seconds a fresh drafter is expected to save before the next chance to
                retrain exceed what the training is expected to cost:

                    gain = tokens * t * (1 + c*f) * (1/tau_stale - 1/tau_fresh)
                    tau_stale = tau_now - rate      (one more step stale: the champion if not retrained)
                    tau_fresh = tau at promotion    (what a drafter trained on fresh data reached)
                    rate      = (tau at promotion - tau_now) / steps since promotion

                `tokens`: the rollout tokens expected before the next chance (the last step's, times
                the interval); `t`, `c`, `f`: the decoding cost (pipeline/cost.py); the training's cost:
                the mean device-seconds of the last trainings. Both sides are device-seconds.

The decision reads only what earlier steps measured (the step's own acceptance is measured after
its training), and the fleet's live tau where the fleet runs the champion: the mean acceptance
length its vLLM replicas count on the rollouts they serve, read from their /metrics when the
step is decided (`serving.deploy.champion_live_tau`). Live tau, when present, is the champion's
tau now; the evaluated tau of the newest measured step otherwise. Without a champion, or before
anything was measured, a drafter is trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.cost import DecodingCost


@dataclass(frozen=True)
class ChampionTrack:
    """The serving champion's acceptance: when it was promoted and at what tau, and its latest tau."""

    version: str
    promoted_at_step: int
    tau_at_promotion: float
    tau_now: float  # on the latest measured step's policy (evaluated, or the fleet's live tau)
    measured_at_step: int
    live: bool = False  # tau_now is the fleet's live tau, not an evaluation's

    @property
    def described(self) -> str:
        return f"{'live' if self.live else 'evaluated'} tau {self.tau_now:.3f} at step {self.measured_at_step}"

    @property
    def drop(self) -> float:
        return self.tau_at_promotion - self.tau_now

    @property
    def staleness_rate(self) -> float:
        """Tau lost per RL step since the promotion (0 before the champion was measured on a later step)."""
        steps = self.measured_at_step - self.promoted_at_step
        return max(0.0, self.drop) / steps if steps > 0 else 0.0


@dataclass(frozen=True)
class LiveTau:
    """The fleet's live tau: the mean acceptance length its replicas counted serving `version`."""

    version: str
    tau: float


@dataclass(frozen=True)
class ScheduleInputs:
    """What the `acceptance` and `cost` schedules read from earlier steps and the fleet."""

    champion: ChampionTrack | None
    expected_tokens: int  # rollout tokens expected before the next chance to retrain
    training_cost_s: float | None  # expected device-seconds of a training; None: none measured yet
    decoding: DecodingCost | None  # None: no evaluation timed yet
    live_tau_floor: float = 0.0  # `acceptance`: live tau below it retrains (fleet.live_tau_floor; 0 = never)


@dataclass(frozen=True)
class TrainingDecision:
    train: bool
    reason: str
    expected_gain_s: float | None = None  # `cost`: rollout seconds a retraining is expected to save
    expected_cost_s: float | None = None  # `cost`: device-seconds it is expected to take


def interval_decision(step: int, interval: int) -> TrainingDecision:
    if step % interval:
        return TrainingDecision(False, f"step {step} is not a multiple of train.training_interval_steps={interval}")
    return TrainingDecision(True, f"step {step} is a multiple of train.training_interval_steps={interval}")


def acceptance_decision(
    champion: ChampionTrack | None, tau_drop: float, live_tau_floor: float = 0.0
) -> TrainingDecision:
    if champion is None:
        return TrainingDecision(True, "no champion yet")
    fell = (f"champion v{champion.version} {champion.described} fell "
            f"{champion.drop:.3f} since its promotion ({champion.tau_at_promotion:.3f})")
    if champion.live and live_tau_floor and champion.tau_now < live_tau_floor:
        return TrainingDecision(True, f"{fell}, below fleet.live_tau_floor={live_tau_floor}")
    if champion.drop > tau_drop:
        return TrainingDecision(True, f"{fell}, more than train.schedule.tau_drop={tau_drop}")
    return TrainingDecision(False, f"{fell}, within train.schedule.tau_drop={tau_drop}")


def expected_gain_s(champion: ChampionTrack, tokens: int, decoding: DecodingCost) -> float:
    """Rollout seconds saved before the next chance by a fresh drafter over the champion one step staler."""
    tau_stale = max(1.0, champion.tau_now - champion.staleness_rate)
    tau_fresh = max(tau_stale, champion.tau_at_promotion)
    return decoding.saved_seconds(tau_fresh, tokens) - decoding.saved_seconds(tau_stale, tokens)


def cost_decision(inputs: ScheduleInputs) -> TrainingDecision:
    if inputs.champion is None:
        return TrainingDecision(True, "no champion yet")
    if inputs.training_cost_s is None or inputs.decoding is None:
        return TrainingDecision(True, "no training or decoding cost measured yet")
    gain = expected_gain_s(inputs.champion, inputs.expected_tokens, inputs.decoding)
    cost = inputs.training_cost_s
    verdict = ">" if gain > cost else "<="
    reason = (f"expected gain {gain:.1f} s (champion v{inputs.champion.version} losing "
              f"{inputs.champion.staleness_rate:.3f} tau/step, {inputs.champion.described}, "
              f"{inputs.expected_tokens} tokens before the next "
              f"chance) {verdict} expected training cost {cost:.1f} s")
    return TrainingDecision(gain > cost, reason, round(gain, 3), round(cost, 3))


Schedule = Literal["interval", "acceptance", "cost"]


def schedule_decision(
    schedule: Schedule, step: int, interval: int, tau_drop: float, inputs: ScheduleInputs
) -> TrainingDecision:
    """Whether the step trains, by the configured schedule; `acceptance` and `cost` are checked every
    `interval` steps too."""
    on_interval = interval_decision(step, interval)
    if schedule == "interval" or not on_interval.train:
        return on_interval
    if schedule == "acceptance":
        return acceptance_decision(inputs.champion, tau_drop, inputs.live_tau_floor)
    return cost_decision(inputs)
