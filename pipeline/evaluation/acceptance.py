"""Acceptance of the step's drafters against the step's policy, the promotion decision, and the
step's entry in the cost ledger.

The step's drafters are measured on the same held-out prompts of the step, sampled as the step's
rollouts were (policy.json's `sampling`, else `eval.sampling`) and drafted as the fleet drafts
(`fleet.draft_sample_method`): the tau the rollouts get, which is what promotion, the schedule and
the ledger decide on. Each prompt draws from its own seed, the same for every drafter of the step,
so two drafters meet the same random numbers and their difference is not sampling noise. Each is
measured greedily too, beside it.

    cotrained  the newest drafter (the `challenger`), trained on data up to this step
    served     what the fleet ran when the step was published: what served its rollouts (the
               champion where the fleet keeps no history)
    baseline   the first drafter ever trained, never retrained
    incumbent  what the new drafter must beat: the drafter the fleet runs now (`live`: a same-step
               refresh may serve there, newer than the champion), else the `champion`
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pipeline.accounting.cost import DecodingCost, StepCost
from pipeline.config import PipelineConfig, PromotionConfig
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.acceptance_record import NO_DRAFTER_TAU, AcceptanceRecord, DrafterTau, TauEstimate
from pipeline.data.fleet_state import read_fleet_state, served_at
from pipeline.data.held_out import held_out_prompts, held_out_sequences
from pipeline.data.keys import acceptance_key, cost_key, placement_key, replay_key
from pipeline.data.records import write_record
from pipeline.data.replay_record import RolloutReplay
from pipeline.data.stage_placement import read_placements
from pipeline.data.store import ObjectStore
from pipeline.evaluation import replay, round_cost, speculative, teacher_forced
from pipeline.evaluation.scheduler import SpeculationThreshold
from pipeline.launch.placement import measure_placement
from pipeline.models import target as target_lib
from pipeline.ranks import SINGLE, Ranks
from pipeline.registry import DrafterRegistry
from pipeline.sampling import DraftSampleMethod, SamplingParams
from pipeline.stages import EVALUATION, Stage


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def promotion_decision(
    policy: PromotionConfig, new_tau: float | None, incumbent_tau: float | None
) -> Decision:
    """Promote the new drafter when it beats the incumbent (what the fleet runs, else the champion) by the margin."""
    if new_tau is None:
        return Decision(False, "no new drafter at this step")
    if policy.policy == "manual":
        return Decision(False, "promotion.policy is manual: a person moves `champion` in the MLflow UI")
    if incumbent_tau is None:
        return Decision(True, f"no drafter serves or is champion yet; new tau {new_tau:.3f}")
    if new_tau > incumbent_tau + policy.margin:
        return Decision(True, f"new tau {new_tau:.3f} > incumbent tau {incumbent_tau:.3f} + margin {policy.margin}")
    return Decision(False, f"new tau {new_tau:.3f} <= incumbent tau {incumbent_tau:.3f} + margin {policy.margin}")


@dataclass(frozen=True)
class StepMeasurement:
    """The step's drafters measured on the same held-out prompts of the step's policy."""

    step: int
    policy_version: int
    num_prompts: int
    roles: dict[str, str | None]  # role -> registered version, None: no such drafter
    measured: dict[str, DrafterTau]  # version -> exact tau and its parts, the teacher-forced estimate
    served_decoding: DecodingCost | None  # the served drafter's rounds, timed: the ledger's saving rests on them
    sampling: SamplingParams  # the rollouts' parameters, every tau's
    draft_sample_method: DraftSampleMethod

    def tau(self, role: str) -> float | None:
        return self.drafter(role).tau if self.roles[role] else None

    def drafter(self, role: str) -> DrafterTau | None:
        version = self.roles[role]
        return self.measured[version] if version else None


def eval_seed(step: int) -> int:
    """The first prompt's seed at `step`: the same for every drafter measured there, another at every step."""
    return step * 1_000_003


def measure_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, new_version: str | None,
    ranks: Ranks = SINGLE,
) -> StepMeasurement:
    """Speculative decoding of each drafter against the step's target; reads, writes nothing. On several
    `ranks` each decodes its share of the prompt batches and the counts are summed: the same measurement
    on every rank, equal to one process's."""
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    device = ranks.device(cfg.device, cfg.target.gpus_per_process)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, device, target_lib.load_settings(cfg))
    limits = rollouts_lib.TargetLimits.of(target.config)
    prompts = held_out_prompts(store, cfg, step, limits)
    sequences, prompt_lens = held_out_sequences(store, cfg, step, limits)
    k, max_new = cfg.eval.num_speculative_tokens, cfg.eval.max_new_tokens
    params, method = cfg.eval.rollout_sampling(pointer.sampling), cfg.fleet.draft_sample_method
    champion = registry.alias_version("champion")
    roles = {
        "cotrained": new_version or registry.alias_version("challenger"),
        "served": served_version(store, cfg.run, step, champion),
        "baseline": registry.alias_version("baseline"),
        "incumbent": registry.alias_version("live") or champion,
    }
    measured: dict[str, DrafterTau] = {}
    served_decoding = None
    for version in sorted({v for v in roles.values() if v is not None}, key=int):
        drafter = registry.load(version)
        drafter.attach(target)
        proposer = speculative.follow_target(drafter, target)
        times = speculative.RoundTimes()
        exact = speculative.evaluate(target, proposer, prompts, max_new, k, times=times, ranks=ranks, params=params,
                                     draft_method=method, seed=eval_seed(step))
        greedy = exact if params.greedy else speculative.evaluate(target, proposer, prompts, max_new, k, ranks=ranks)
        if version == roles["served"]:
            # a round's drafter cost counts its forwards (k, or 1 for P-EAGLE), not its tokens
            served_decoding = times.decoding_cost(round(exact.drafter_forwards_per_round or k))
        estimate = teacher_forced.estimate_acceptance(target, drafter, sequences, prompt_lens, k, ranks=ranks,
                                                      sampled=not params.greedy,
                                                      chunk_tokens=cfg.eval.estimate_chunk_tokens)
        # each tau says what it rests on: exact, prompts decoded and rounds; the estimate, rollouts and positions
        measured[version] = DrafterTau(
            version, exact.tau, exact.acceptance_rate, tuple(exact.per_position), exact.rounds, exact.drafted,
            exact.accepted, len(prompts),
            TauEstimate(estimate.tau, tuple(estimate.per_position), estimate.sequences, estimate.positions)
            if estimate else None, exact.drafter_forwards_per_round, greedy.tau, tuple(greedy.per_position))
    return StepMeasurement(step, pointer.policy_version, len(prompts), roles, measured, served_decoding, params,
                           method)


def served_version(store: ObjectStore, run: str, step: int, champion: str | None) -> str | None:
    """The drafter the fleet ran when the step was published; the champion where the fleet keeps no history
    (no fleet, or one that has never deployed)."""
    state = read_fleet_state(store, run)
    if not state.history:
        return champion
    return served_at(state.history, rollouts_lib.published_at(store, run, step))


def round_costs_at_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, version: str, ks: list[int]
) -> list[round_cost.RoundCost]:
    """A registered drafter's tau, drafter forwards per round and estimated speedup at each k, on the step's
    held-out prompts and policy (the cost model of `pipeline.evaluation.round_cost`)."""
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, cfg.device, target_lib.load_settings(cfg))
    prompts = held_out_prompts(store, cfg, step, rollouts_lib.TargetLimits.of(target.config))
    drafter = registry.load(version)
    drafter.attach(target)
    return round_cost.round_costs(target, drafter, speculative.follow_target(drafter, target), prompts,
                            cfg.eval.max_new_tokens, ks, cfg.eval.rollout_sampling(pointer.sampling),
                            cfg.fleet.draft_sample_method, eval_seed(step))


def apply_promotion(
    registry: DrafterRegistry, measurement: StepMeasurement, new_version: str | None, decision: Decision
) -> None:
    """Move `champion` on a promotion; tag the new version and log its acceptance on its training run."""
    if decision.promote:
        registry.set_alias("champion", new_version)
    if not new_version:
        return
    incumbent_tau = measurement.tau("incumbent")
    registry.set_version_tags(new_version, {
        "tau": f"{measurement.measured[new_version].tau:.4f}", "promoted": str(decision.promote).lower(),
        "champion_tau_at_decision": "none" if incumbent_tau is None else f"{incumbent_tau:.4f}",
    })
    run_id = registry.client.get_model_version(registry.model_name, new_version).run_id
    new = measurement.measured[new_version]
    registry.log_metrics(run_id, {
        "eval_tau": new.tau, "eval_acceptance_rate": new.acceptance_rate,
        **{f"eval_accept_pos{j}": p for j, p in enumerate(new.per_position)},
        **({"eval_greedy_tau": new.greedy_tau} if new.greedy_tau is not None else {}),
        **({"eval_champion_tau": incumbent_tau} if incumbent_tau is not None else {}),
    })
    registry.set_run_tags(run_id, {"eval_sampling": measurement.sampling.label,
                                   "eval_draft_sample_method": measurement.draft_sample_method})
    registry.set_run_tags(run_id, {"promotion": decision.reason})


def acceptance_record(
    cfg: PipelineConfig, measurement: StepMeasurement, decision: Decision, champion_after: str | None
) -> AcceptanceRecord:
    """The step's acceptance record, as stored and as the reports read it."""
    m = measurement
    return AcceptanceRecord(
        m.step, m.policy_version, m.num_prompts, cfg.eval.num_speculative_tokens, cfg.eval.max_new_tokens,
        m.drafter("cotrained"), m.drafter("served"), m.drafter("baseline"), m.drafter("incumbent"), decision.promote,
        decision.reason, champion_after, m.sampling, m.draft_sample_method)


def replay_batch(rollouts: int, replicas: int, max_requests: int) -> int:
    """The requests a replay decodes: one replica's share of the step (the batch each replica decoded; the whole step
    without a fleet), at most `max_requests`."""
    return min(max_requests, -(-rollouts // max(1, replicas)))


def replay_rollouts(
    store: ObjectStore, cfg: PipelineConfig, registry: DrafterRegistry, measurement: StepMeasurement
) -> RolloutReplay:
    """The step's rollouts replayed with no drafter and with each of its baseline, served and co-trained drafters,
    on the same requests and seeds, scheduled as the fleet schedules its rounds (replay.py)."""
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, measurement.step)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, cfg.device, target_lib.load_settings(cfg))
    rollouts = rollouts_lib.read_rollouts(store, cfg.run, measurement.step)
    rollouts = rollouts[: replay_batch(len(rollouts), len(cfg.fleet.replicas), cfg.eval.replay_max_requests)]
    requests = replay.step_requests(rollouts, measurement.sampling, eval_seed(measurement.step), cfg.device)
    arms: dict[str, tuple[str | None, object]] = {"none": (None, None)}
    for role in ("baseline", "served", "cotrained"):
        version = measurement.roles[role]
        if version is None:
            arms[role] = (None, None)  # no such drafter: what the role's rollouts got is plain decoding
            continue
        drafter = registry.load(version)
        drafter.attach(target)
        arms[role] = (version, speculative.follow_target(drafter, target))
    fixed = None if cfg.fleet.speculation_max_batch == "auto" else cfg.fleet.speculation_max_batch
    return replay.replay_step(target, arms, requests, cfg.eval.num_speculative_tokens, measurement.draft_sample_method,
                              lambda: SpeculationThreshold(fixed), measurement.step, measurement.sampling,
                              cfg.eval.replay_runs)


def log_replay(registry: DrafterRegistry, replayed: RolloutReplay, new_version: str | None) -> None:
    """The new drafter's measured rollout speedups over no speculation (whole step and tail) on its training run."""
    if not new_version:
        return
    speedups = {f"rollout_speedup{'_tail' if tail else ''}": replayed.speedup("cotrained", tail=tail)
                for tail in (False, True)}
    run_id = registry.client.get_model_version(registry.model_name, new_version).run_id
    registry.log_metrics(run_id, {name: value for name, value in speedups.items() if value is not None})


def step_cost(
    store: ObjectStore, cfg: PipelineConfig, measurement: StepMeasurement, seconds: dict[Stage, float],
    replayed: RolloutReplay | None = None,
) -> StepCost:
    """The step's ledger entry: `seconds` spent by stage, what the served drafter saved on its rollouts (measured
    by the replay where one ran), and where the step's launched stages ran (their placement records)."""
    rollouts = rollouts_lib.read_rollouts(store, cfg.run, measurement.step)
    served, decoding = measurement.tau("served"), measurement.served_decoding
    if decoding and cfg.eval.draft_cost_ratio:  # the fleet's price of a drafter forward, not this process's
        decoding = replace(decoding, draft_cost_ratio=cfg.eval.draft_cost_ratio)
    return StepCost(measurement.step, {stage: round(s, 3) for stage, s in seconds.items()},
                    sum(sum(r.loss_mask) for r in rollouts), measurement.roles["served"],
                    NO_DRAFTER_TAU if served is None else served, decoding,
                    read_placements(store, cfg.run, measurement.step), replayed.saved_s if replayed else None)


def evaluate_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, new_version: str | None,
    spent_s: dict[Stage, float] | None = None, ranks: Ranks = SINGLE, where: str = "process",
) -> AcceptanceRecord | None:
    """Measure the drafters (on every rank), then on rank 0: decide on promotion, move aliases, write the
    step's acceptance record, where the evaluation ran (`where`: process, pod or ray), the step's replay (`eval.replay`)
    and its ledger entry (`spent_s`: device-seconds of the stages before this one, by stage; the replay is
    measurement, not the drafter's cost, and is not counted). None on the other ranks."""
    started = time.perf_counter()
    measurement = measure_step(store, cfg, step, registry, new_version, ranks)
    device = ranks.device(cfg.device, cfg.target.gpus_per_process)
    placement = measure_placement(EVALUATION, where, ranks, device, started)
    if not ranks.is_main:
        return None
    new_tau = measurement.measured[new_version].tau if new_version else None
    decision = promotion_decision(cfg.promotion, new_tau, measurement.tau("incumbent"))
    apply_promotion(registry, measurement, new_version, decision)
    record = acceptance_record(cfg, measurement, decision, registry.alias_version("champion"))
    write_record(store, acceptance_key(cfg.run, step), record)
    write_record(store, placement_key(cfg.run, step, EVALUATION), placement)
    seconds = {**(spent_s or {}), EVALUATION: (time.perf_counter() - started) * ranks.world_size}
    replayed = replay_rollouts(store, cfg, registry, measurement) if cfg.eval.replay else None
    if replayed is not None:
        write_record(store, replay_key(cfg.run, step), replayed)
        log_replay(registry, replayed, new_version)
    write_record(store, cost_key(cfg.run, step), step_cost(store, cfg, measurement, seconds, replayed))
    return record
