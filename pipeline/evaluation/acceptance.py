"""Acceptance of the step's drafters against the step's policy, and the promotion decision.

Three drafters are measured on the same held-out prompts of the step:
    cotrained  the newest drafter (the `challenger`), trained on data up to this step
    served     the `champion` before this step's decision: what served this step's rollouts
    baseline   the first drafter ever trained, never retrained
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import PipelineConfig, PromotionConfig
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.keys import acceptance_key
from pipeline.data.store import ObjectStore
from pipeline.evaluation import cost, speculative, teacher_forced
from pipeline.models import target as target_lib
from pipeline.registry import DrafterRegistry
from pipeline.sources.extract import held_out_rollouts


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def promotion_decision(
    policy: PromotionConfig, new_tau: float | None, champion_tau: float | None
) -> Decision:
    if new_tau is None:
        return Decision(False, "no new drafter at this step")
    if policy.policy == "manual":
        return Decision(False, "promotion.policy is manual: a person moves `champion` in the MLflow UI")
    if champion_tau is None:
        return Decision(True, f"no champion yet; new tau {new_tau:.3f}")
    if new_tau > champion_tau + policy.margin:
        return Decision(True, f"new tau {new_tau:.3f} > champion tau {champion_tau:.3f} + margin {policy.margin}")
    return Decision(False, f"new tau {new_tau:.3f} <= champion tau {champion_tau:.3f} + margin {policy.margin}")


def held_out_prompts(
    store: ObjectStore, cfg: PipelineConfig, step: int, limits: rollouts_lib.TargetLimits | None = None
) -> list[torch.Tensor]:
    rollouts = held_out_rollouts(rollouts_lib.read_rollouts(store, cfg.run, step, limits),
                                 cfg.eval.held_out_fraction)
    if not rollouts:
        raise ValueError(f"step {step}: no held-out rollouts (eval.held_out_fraction={cfg.eval.held_out_fraction})")
    return [torch.tensor(r.input_ids[: max(1, r.prompt_len)]) for r in rollouts[: cfg.eval.num_prompts]]


def held_out_sequences(
    store: ObjectStore, cfg: PipelineConfig, step: int, limits: rollouts_lib.TargetLimits | None = None
) -> tuple[list[torch.Tensor], list[int]]:
    """Whole held-out rollouts (prompt + response) and their prompt lengths: what the acceptance estimate reads."""
    rollouts = held_out_rollouts(rollouts_lib.read_rollouts(store, cfg.run, step, limits),
                                 cfg.eval.held_out_fraction)
    rollouts = rollouts[: cfg.eval.num_prompts]
    return [torch.tensor(r.input_ids) for r in rollouts], [max(1, r.prompt_len) for r in rollouts]


@dataclass(frozen=True)
class StepMeasurement:
    """The step's drafters measured on the same held-out prompts of the step's policy."""

    step: int
    policy_version: int
    num_prompts: int
    roles: dict[str, str | None]  # role (cotrained, served, baseline) -> registered version, None: no such drafter
    measured: dict[str, dict]  # version -> exact tau and its parts, the teacher-forced estimate

    def tau(self, role: str) -> float | None:
        version = self.roles[role]
        return self.measured[version]["tau"] if version else None


def measure_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, new_version: str | None
) -> StepMeasurement:
    """Speculative decoding of each drafter against the step's target; reads, writes nothing."""
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, cfg.device, target_lib.load_settings(cfg))
    limits = rollouts_lib.TargetLimits.of(target.config)
    prompts = held_out_prompts(store, cfg, step, limits)
    sequences, prompt_lens = held_out_sequences(store, cfg, step, limits)
    k, max_new = cfg.eval.num_speculative_tokens, cfg.eval.max_new_tokens
    roles = {
        "cotrained": new_version or registry.alias_version("challenger"),
        "served": registry.alias_version("champion"),
        "baseline": registry.alias_version("baseline"),
    }
    measured: dict[str, dict] = {}
    for version in {v for v in roles.values() if v is not None}:
        drafter = registry.load(version)
        drafter.attach(target)
        exact = speculative.evaluate(target, speculative.follow_target(drafter, target), prompts, max_new, k)
        estimate = teacher_forced.estimate_acceptance(target, drafter, sequences, prompt_lens, k)
        # each tau says what it rests on: exact, prompts decoded and rounds; the estimate, rollouts and positions
        measured[version] = {**exact.as_dict(), "prompts": len(prompts),
                             "estimate": estimate.as_dict() if estimate else None}
    return StepMeasurement(step, pointer.policy_version, len(prompts), roles, measured)


def round_costs_at_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, version: str, ks: list[int]
) -> list[cost.RoundCost]:
    """A registered drafter's tau, drafter forwards per round and estimated speedup at each k, on the step's
    held-out prompts and policy (the cost model of `pipeline.evaluation.cost`)."""
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, cfg.device, target_lib.load_settings(cfg))
    prompts = held_out_prompts(store, cfg, step, rollouts_lib.TargetLimits.of(target.config))
    drafter = registry.load(version)
    drafter.attach(target)
    return cost.round_costs(target, drafter, speculative.follow_target(drafter, target), prompts,
                            cfg.eval.max_new_tokens, ks)


def apply_promotion(
    registry: DrafterRegistry, measurement: StepMeasurement, new_version: str | None, decision: Decision
) -> None:
    """Move `champion` on a promotion; tag the new version and log its acceptance on its training run."""
    if decision.promote:
        registry.set_alias("champion", new_version)
    if not new_version:
        return
    served_tau = measurement.tau("served")
    registry.set_version_tags(new_version, {
        "tau": f"{measurement.measured[new_version]['tau']:.4f}", "promoted": str(decision.promote).lower(),
        "champion_tau_at_decision": "none" if served_tau is None else f"{served_tau:.4f}",
    })
    run_id = registry.client.get_model_version(registry.model_name, new_version).run_id
    new = measurement.measured[new_version]
    registry.log_metrics(run_id, {
        "eval_tau": new["tau"], "eval_acceptance_rate": new["acceptance_rate"],
        **{f"eval_accept_pos{j}": p for j, p in enumerate(new["per_position"])},
        **({"eval_champion_tau": served_tau} if served_tau is not None else {}),
    })
    registry.set_run_tags(run_id, {"promotion": decision.reason})


def acceptance_record(
    cfg: PipelineConfig, measurement: StepMeasurement, decision: Decision, champion_after: str | None
) -> dict:
    """The step's acceptance record, as stored and as the reports read it."""
    return {
        "step": measurement.step,
        "policy_version": measurement.policy_version,
        "num_prompts": measurement.num_prompts,
        "num_speculative_tokens": cfg.eval.num_speculative_tokens,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "drafters": {role: ({"version": v, **measurement.measured[v]} if v else None)
                     for role, v in measurement.roles.items()},
        "promoted": decision.promote,
        "decision": decision.reason,
        "champion_after": champion_after,
    }


def evaluate_step(
    store: ObjectStore, cfg: PipelineConfig, step: int, registry: DrafterRegistry, new_version: str | None
) -> dict:
    """Measure the drafters, decide on promotion, move aliases, write the step's acceptance record."""
    measurement = measure_step(store, cfg, step, registry, new_version)
    new_tau = measurement.measured[new_version]["tau"] if new_version else None
    decision = promotion_decision(cfg.promotion, new_tau, measurement.tau("served"))
    apply_promotion(registry, measurement, new_version, decision)
    record = acceptance_record(cfg, measurement, decision, registry.alias_version("champion"))
    store.write_json(acceptance_key(cfg.run, step), record)
    return record
