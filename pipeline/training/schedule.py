"""When a step's drafter trains: on an interval, when the champion's acceptance has dropped, or
when retraining is expected to save more rollout time than it costs.

    interval    every `train.training_interval_steps` steps (FastRL's trigger)
    acceptance  the champion's tau fell by more than `train.schedule.tau_drop` since it was promoted,
                or its live tau is below `fleet.live_tau_floor`
    cost        keeping the champion one more chance loses more rollout time than a training costs
                per chance at its best retraining interval (below)

`cost` is the replacement problem of a part that wears: a drafter serves best right after its
training and loses acceptance with every RL step the policy moves on; a training costs C
device-seconds. A drafter's age is the RL steps since the newest step it trained on (the fleet's
lag); it serves from age 1 on. With

    S(tau)    = N * t * (1 - (1 + c*f) / tau)       the seconds a drafter at tau saves on a step's N
                                                    rollout tokens (pipeline/accounting/cost.py)
    fresh(a)  = 1 + (tau_0 - 1) * keep^a            tau of a drafter trained now, at age a
    champ(a)  = 1 + (tau_m - 1) * keep^(a - a_m)    the champion, from its latest tau tau_m at age a_m
                                                    (evaluated, or the fleet's live tau)
    keep      = solves sum(e_older) = sum(e_younger * keep^d) over the drafters measured on the same
                step's policy (neighbours in age, d ages apart, e = tau - 1), on the last few steps:
                the share of its excess acceptance a drafter keeps per RL step (1: no staleness)
    tau_0     = the newest step's youngest drafter's tau, brought back to age 0 by keep (its own tau
                where it trained on that step): what a training reaches, at the coming steps' level

and the chances every I = `train.training_interval_steps` steps, a retraining every n chances costs,
per chance, its training plus the staleness it lets in against retraining at every chance:

    g(n) = (C + sum_{j=1..n*I} [S(fresh(1 + (j-1) mod I)) - S(fresh(j))]) / n,   g* = min_n g(n)

and keeping the champion over the next chance loses

    gain = sum_{m=1..I} [S(fresh(m)) - S(champ(s + m - seen))]      (seen: its newest trained step)

The step trains when gain > g*: the drafter is replaced when one more chance of staleness costs more
than a training does on average at the best interval, which counts every later step a skipped
training leaves stale. A training whose fresh drafter saves nothing (fresh(1) <= 1 + c*f: its
rounds cost more than its tokens save) never pays, and `cost` stops training it: the fleet saves
more serving without a drafter. t and c are the median of the last few steps' timings of the
served drafter (one timing on a loaded machine does not move the decision); C is the mean
device-seconds of the last trainings; N is the step's response tokens.

`keep` compares drafters on one step, never one drafter across steps: a step whose policy is harder
to draft for lowers every drafter measured on it, and charging that to age would misjudge the
staleness a skipped training lets in, which is a difference between two drafters on the same step.

The decision reads only what earlier steps measured (the step's own acceptance is measured after
its training), and the fleet's live tau where the fleet runs the champion: the mean acceptance
length its vLLM replicas count on the rollouts they serve, read from their /metrics when the
step is decided (`serving.deploy.live_tau`). Live tau, when present, is the champion's
tau now; the evaluated tau of the newest measured step otherwise. Without a champion, before
anything was timed, or before some step measured two drafters of different ages, a drafter is
trained.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Literal

from pipeline.accounting.cost import DecodingCost, StepCost
from pipeline.data.acceptance_record import AcceptanceRecord
from pipeline.data.refresh_record import RefreshRecord
from pipeline.data.training_record import TrainingRecord
from pipeline.stages import TRAINING

MAX_CYCLE_CHANCES = 50  # the longest retraining interval `cost` weighs, in chances
RECENT_TRAININGS = 3  # the expected cost of a training: the mean of the last few
RECENT_TIMINGS = 3  # t and c: the median of the last few steps' timings of the served drafter
STALENESS_STEPS = 4  # `keep`: drafters measured on the last few steps' policies


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


@dataclass(frozen=True)
class AgedTau:
    """One drafter's tau on one step's policy, `age` RL steps after the newest step it trained on."""

    version: str
    step: int
    age: int
    tau: float


@dataclass(frozen=True)
class Staleness:
    """How fast drafters go stale, measured on earlier steps, and what a training reaches."""

    keep: float  # share of its excess tau (tau - 1) a drafter keeps per RL step of age
    tau_fresh: float  # tau_0: what a training reaches at age 0, at the newest measured step's level
    pairs: int  # pairs of drafters measured on the same step at different ages `keep` rests on

    def tau_at(self, age: int) -> float:
        """A drafter trained now, `age` steps later."""
        return 1.0 + max(0.0, self.tau_fresh - 1.0) * self.keep ** age


def measure_staleness(taus: list[AgedTau]) -> Staleness | None:
    """`keep` from drafters of different ages measured on the same step's policy, and tau_0 from the newest step;
    None until some step measured two drafters of different ages.

    Each step's drafters, youngest first, give pairs of neighbours in age (excess e_y at the younger age, e_o
    at the older, d ages apart); `keep` solves sum(e_o) = sum(e_y * keep^d), the older excess predicted from the
    younger on the same prompts of the same policy. Comparing one drafter across two steps instead would charge
    its age with how much harder the second step's policy is to draft for: every drafter falls together on such a
    step. What a schedule changes is which drafter serves a step, so the loss a skipped training causes is a
    difference between drafters on one step, the measurement `keep` rests on.

    tau_0 is the newest step's youngest drafter's tau, brought back to age 0 by `keep` (its own tau where it
    trained on that step): the drafter a training makes next serves the coming steps at their level, which the
    newest step measures best, not the level of whichever older step last measured a drafter on its own step."""
    by_step: dict[int, list[AgedTau]] = {}
    for t in taus:
        by_step.setdefault(t.step, []).append(t)
    pairs: list[tuple[float, float, int]] = []  # (younger excess, older excess, ages apart)
    for measured in by_step.values():
        ordered = sorted(measured, key=lambda t: t.age)
        pairs.extend((max(0.0, a.tau - 1.0), max(0.0, b.tau - 1.0), b.age - a.age)
                     for a, b in zip(ordered, ordered[1:], strict=False) if b.age > a.age)
    if not pairs or sum(e_y for e_y, _, _ in pairs) <= 0:
        return None
    keep = _solve_keep(pairs)
    newest = min(by_step[max(by_step)], key=lambda t: t.age)
    if newest.age and keep <= 0:
        return None  # nothing younger was measured there, and nothing ages back from 0
    return Staleness(keep, 1.0 + max(0.0, newest.tau - 1.0) / keep ** newest.age, len(pairs))


def _solve_keep(pairs: list[tuple[float, float, int]]) -> float:
    """keep in [0, 1] with sum(e_o) = sum(e_y * keep^d) (bisection: the right side rises with keep); 1 where the
    older drafters kept all of it."""
    older = sum(e_o for _, e_o, _ in pairs)
    if older >= sum(e_y for e_y, _, _ in pairs):
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(e_y * mid ** d for e_y, _, d in pairs) < older else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class LiveTau:
    """The fleet's live tau: the mean acceptance length its replicas counted serving `version`."""

    version: str
    tau: float


@dataclass(frozen=True)
class ScheduleInputs:
    """What the `acceptance` and `cost` schedules read from earlier steps and the fleet."""

    champion: ChampionTrack | None
    step_tokens: int  # N: the step's rollout (response) tokens, what each coming step is expected to generate
    training_cost_s: float | None  # C: expected device-seconds of a training; None: none measured yet
    decoding: DecodingCost | None  # t, c, f; None: no evaluation timed yet
    live_tau_floor: float = 0.0  # `acceptance`: live tau below it retrains (fleet.live_tau_floor; 0 = never)
    staleness: Staleness | None = None  # None: no step measured two drafters of different ages yet


@dataclass(frozen=True)
class StepHistory:
    """What an earlier step's stages recorded, as a decision reads it (None: the step has no such record)."""

    step: int
    training: TrainingRecord | None
    refresh: RefreshRecord | None
    acceptance: AcceptanceRecord | None
    cost: StepCost | None


def gather_inputs(
    history: list[StepHistory], step: int, step_tokens: int, champion: str | None, live: LiveTau | None,
    schedule: Schedule, live_tau_floor: float,
) -> ScheduleInputs:
    """The schedules' inputs from the earlier steps' records: the champion's acceptance since its promotion (its tau
    now: the fleet's live tau when the fleet runs it, else its evaluation on the newest measured step), how fast
    drafters went stale on the last steps (`cost` only), and the costs earlier steps measured."""
    costs = [h.cost for h in history if h.cost is not None]
    trainings = [c.spent(TRAINING) for c in costs if c.spent(TRAINING) > 0][-RECENT_TRAININGS:]
    decoding = median_decoding([c.decoding for c in costs if c.decoding][-RECENT_TIMINGS:])
    track = champion_track(history, champion)
    if track and live and live.version == track.version:  # the fleet serves the step's policy: measured now
        track = replace(track, tau_now=live.tau, measured_at_step=step, live=True)
    staleness = None
    if schedule == "cost":
        staleness = measure_staleness(aged_taus(history, [h.step for h in history[-STALENESS_STEPS:]]))
    return ScheduleInputs(track, step_tokens, sum(trainings) / len(trainings) if trainings else None, decoding,
                          live_tau_floor, staleness)


def median_decoding(timings: list[DecodingCost]) -> DecodingCost | None:
    """t and c, each the median of `timings` (f of the newest): a timing taken on a loaded machine moves neither."""
    if not timings:
        return None
    return DecodingCost(statistics.median(d.target_s_per_token for d in timings),
                        statistics.median(d.draft_cost_ratio for d in timings),
                        timings[-1].drafter_forwards_per_round)


def aged_taus(history: list[StepHistory], recent: list[int]) -> list[AgedTau]:
    """Every drafter measured on the `recent` steps' policies, with its age there: the step minus the newest step
    it trained on (its training record's, a refresh's own step, else the step it was first measured as the
    co-trained drafter). `history`: the steps whose records say when each drafter trained, `recent` among them."""
    seen: dict[str, int] = {}
    for h in history:
        if h.training is not None and h.training.version and h.training.trained:
            seen.setdefault(h.training.version, max(h.training.trained_on_steps, default=h.step))
        if h.refresh is not None and h.refresh.version:
            seen.setdefault(h.refresh.version, h.step)
        if h.acceptance is not None and h.acceptance.cotrained is not None:
            seen.setdefault(h.acceptance.cotrained.version, h.step)
    taus = []
    for h in history:
        if h.step not in recent or h.acceptance is None:
            continue
        s = h.step
        measured = {d.version: d.tau for d in h.acceptance.measured().values()}
        taus.extend(AgedTau(v, s, s - seen[v], tau) for v, tau in measured.items() if seen.get(v, s + 1) <= s)
    return taus


def champion_track(history: list[StepHistory], champion: str | None) -> ChampionTrack | None:
    """The champion's tau when it was promoted (as the step's co-trained drafter) and on the newest step that
    measured it since (as the served drafter); None without a champion or the record of its promotion."""
    track = None
    for h in history:
        if champion is None or h.acceptance is None:
            continue
        record = h.acceptance
        cotrained, served = record.cotrained, record.served
        if record.promoted and cotrained and cotrained.version == champion:
            track = ChampionTrack(champion, h.step, cotrained.tau, cotrained.tau, h.step)
        elif track and served and served.version == champion:
            track = replace(track, tau_now=served.tau, measured_at_step=h.step)
    return track


@dataclass(frozen=True)
class TrainingDecision:
    train: bool
    reason: str
    expected_gain_s: float | None = None  # `cost`: rollout seconds keeping the champion one more chance loses
    expected_cost_s: float | None = None  # `cost`: g*, device-seconds per chance at the best retraining interval
    best_interval_chances: int | None = None  # `cost`: the n of g*


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


def champion_tau_at(champion: ChampionTrack, staleness: Staleness, step: int) -> float:
    """The champion's tau on `step`'s policy, from its latest measurement aged by `keep`."""
    ahead = max(0, step - champion.measured_at_step)
    return 1.0 + max(0.0, champion.tau_now - 1.0) * staleness.keep ** ahead


def keeping_loss_s(
    champion: ChampionTrack, staleness: Staleness, step: int, interval: int, tokens: int, decoding: DecodingCost
) -> float:
    """gain: the rollout seconds serving the champion over the next chance loses against a drafter trained now."""
    return sum(decoding.saved_seconds(staleness.tau_at(m), tokens)
               - decoding.saved_seconds(champion_tau_at(champion, staleness, step + m), tokens)
               for m in range(1, interval + 1))


def cycle_costs_s(
    staleness: Staleness, interval: int, tokens: int, decoding: DecodingCost, training_s: float
) -> list[float]:
    """g(n) for n = 1..MAX_CYCLE_CHANCES: device-seconds per chance of retraining every n chances, the training
    plus the rollout seconds its staleness loses against retraining at every chance."""
    costs, lost = [], 0.0
    for n in range(1, MAX_CYCLE_CHANCES + 1):
        for j in range((n - 1) * interval + 1, n * interval + 1):
            lost += (decoding.saved_seconds(staleness.tau_at(1 + (j - 1) % interval), tokens)
                     - decoding.saved_seconds(staleness.tau_at(j), tokens))
        costs.append((training_s + lost) / n)
    return costs


def cost_decision(inputs: ScheduleInputs, step: int, interval: int = 1) -> TrainingDecision:
    champion, staleness, decoding = inputs.champion, inputs.staleness, inputs.decoding
    if champion is None:
        return TrainingDecision(True, "no champion yet")
    if inputs.training_cost_s is None or decoding is None:
        return TrainingDecision(True, "no training or decoding cost measured yet")
    if staleness is None:
        return TrainingDecision(True, "staleness not measured yet (no step measured two drafters of different ages)")
    tokens, round_cost = inputs.step_tokens, decoding.round_cost
    fresh = staleness.tau_at(1)
    if fresh <= round_cost:
        return TrainingDecision(False, (
            f"a drafter trained now would serve at tau {fresh:.3f} (age 1), at or below its round cost 1 + c*f = "
            f"{round_cost:.3f}: it loses rollout time at any staleness, so no training pays"), 0.0, None)
    gain = keeping_loss_s(champion, staleness, step, interval, tokens, decoding)
    cycles = cycle_costs_s(staleness, interval, tokens, decoding, inputs.training_cost_s)
    best = min(range(len(cycles)), key=cycles.__getitem__)
    cost = cycles[best]
    verdict = ">" if gain > cost else "<="
    nxt = step + 1
    reason = (f"keeping champion v{champion.version} ({champion.described}, expected "
              f"{champion_tau_at(champion, staleness, nxt):.3f} on step {nxt}) "
              f"loses {gain:.1f} s against a drafter trained now (tau {fresh:.3f} at age 1; drafters keep "
              f"{staleness.keep:.2f} of their excess tau per step, {staleness.pairs} same-step pairs) on "
              f"{tokens} tokens per step {verdict} {cost:.1f} s per chance, the training ({inputs.training_cost_s:.1f}"
              f" s) and its staleness at the best interval of {best + 1} chance(s)")
    return TrainingDecision(gain > cost, reason, round(gain, 3), round(cost, 3), best + 1)


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
    return cost_decision(inputs, step, interval)
