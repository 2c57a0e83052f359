"""Reports of a run from what its steps stored: per-step summary rows, text tables, JSON, and plots of the
acceptance, the replays, the ledger and the schedules (PNG, drawn by plots.py)."""

from __future__ import annotations

import json
import statistics
import textwrap
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipeline.accounting.cost import DecodingCost, read_cost
from pipeline.accounting.ledger import Ledger, cumulative
from pipeline.accounting.plots import figure_png, pyplot
from pipeline.data import buffer as buffer_lib
from pipeline.data import capture, shards
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.acceptance_record import NO_DRAFTER_TAU, DrafterTau, read_acceptance
from pipeline.data.keys import acceptance_key, drafter_key
from pipeline.data.refresh_record import RefreshBreakdown, read_refresh, read_tail
from pipeline.data.replay_record import read_replay
from pipeline.data.store import ObjectStore
from pipeline.data.training_record import read_training
from pipeline.stages import DEPLOYMENT, EVALUATION, EXTRACTION, TRAINING


@dataclass(frozen=True)
class StepRow:
    """One step of a run's summary, read from what the step's assets stored (`step_row`); `to_json` is its row in
    summary.json. Every field but the step is None where the step has no such figure (a row the demo builds up, a
    test's partial row)."""

    step: int
    samples: int | None = None
    buffer_samples: int | None = None
    captured: int | None = None  # rollouts whose hidden states the step stored
    bytes_stored: int | None = None
    trained: bool | None = None
    train_reason: str | None = None  # why the step trained or not: the schedule's words, or the newer step
    tau_cotrained: float | None = None
    tau_baseline: float | None = None
    tau_served: float | None = None
    promoted: bool | None = None
    version_cotrained: str | None = None
    version_served: str | None = None
    acceptance_rate_cotrained: float | None = None
    # what the co-trained tau rests on, and its teacher-forced estimate from one pass over held-out rollouts
    eval_prompts_cotrained: int | None = None
    eval_rounds_cotrained: int | None = None
    tau_estimate_cotrained: dict | None = None
    # the same drafters greedily, and the parameters every tau above is at
    tau_greedy_cotrained: float | None = None
    tau_greedy_served: float | None = None
    tau_greedy_baseline: float | None = None
    sampling: str | None = None
    draft_sample_method: str | None = None
    # the step's replay (replay_fields)
    replay_tokens: int | None = None
    rollout_s_none: float | None = None
    tail_s_none: float | None = None
    rollout_s_baseline: float | None = None
    tail_s_baseline: float | None = None
    rollout_s_served: float | None = None
    tail_s_served: float | None = None
    rollout_s_cotrained: float | None = None
    tail_s_cotrained: float | None = None
    speedup_served: float | None = None
    speedup_served_tail: float | None = None
    speedup_cotrained: float | None = None
    speedup_cotrained_tail: float | None = None
    speedup_baseline: float | None = None
    speedup_baseline_tail: float | None = None
    speedup_served_over_baseline: float | None = None
    # the served drafter's speedup run by run, least and greatest (the figures above are the fastest runs')
    replay_runs: int | None = None  # runs of each arm
    speedup_served_runs: list[float] | None = None
    speedup_served_tail_runs: list[float] | None = None
    speedup_served_by_batch: dict[str, float] | None = None  # every bucket both arms ran, all runs pooled
    speedup_served_min_batch: float | None = None  # the least over the buckets where the served arm speculated
    replay_threshold_served: int | None = None
    # the step's tail and its refresh (tail_fields)
    tail_tau_start: float | None = None
    tail_tau_refreshed: float | None = None
    tail_tau_whole_step: float | None = None
    refresh_version: str | None = None
    refresh_deployed: bool | None = None
    refresh_latency_s: float | None = None
    refresh_latency_share: float | None = None
    tail_prompts: int | None = None
    refresh_breakdown: dict | None = None
    # what the demo adds: the fleet's version after the step, a GRPO trainer's reward and its step by phase
    deployed_version: str | None = None
    trl_mean_reward: float | None = None
    phases: dict | None = None

    def to_json(self) -> dict:
        doc = asdict(self)
        return {k: v for k, v in doc.items() if v is not None or k not in DEMO_FIELDS}


DEMO_FIELDS = ("deployed_version", "trl_mean_reward", "phases")  # in a row's JSON only where the demo set them


def step_row(store: ObjectStore, run: str, step: int) -> StepRow:
    """One line of the summary, read from what the step's assets stored."""
    record = read_acceptance(store, run, step)
    cotrained, served = record.cotrained, record.served
    plan = capture.read_plan(store, run, step)
    training = read_training(store, run, step)
    return StepRow(
        step=step,
        samples=len(rollouts_lib.read_rollouts(store, run, step)),
        buffer_samples=buffer_lib.read_buffer(store, run, step).num_samples,
        captured=plan.captured if plan else None,
        bytes_stored=shards.read_manifest(store, run, step).total_bytes if shards.has_manifest(store, run, step)
        else None,
        trained=training.trained,
        train_reason=training.reason,
        tau_cotrained=_tau(cotrained),
        tau_baseline=_tau(record.baseline),
        tau_served=_tau(served),
        promoted=record.promoted,
        version_cotrained=cotrained.version if cotrained else None,
        version_served=served.version if served else None,
        acceptance_rate_cotrained=round(cotrained.acceptance_rate if cotrained else 0.0, 4),
        eval_prompts_cotrained=cotrained.prompts if cotrained else None,
        eval_rounds_cotrained=cotrained.rounds if cotrained else None,
        tau_estimate_cotrained=_estimate(cotrained),
        tau_greedy_cotrained=_greedy(cotrained), tau_greedy_served=_greedy(served),
        tau_greedy_baseline=_greedy(record.baseline),
        sampling=record.sampling.label, draft_sample_method=record.draft_sample_method,
        **replay_fields(store, run, step),
        **tail_fields(store, run, step),
    )


REPLAY_ARMS = ("none", "baseline", "served", "cotrained")


def replay_fields(store: ObjectStore, run: str, step: int) -> dict:
    """The step's replay: each arm's rollout seconds, and the speedups (whole step and tail) of the served,
    co-trained and never-retrained drafters over no speculation, and of the served over the never-retrained."""
    replay = read_replay(store, run, step)
    fields: dict = {"replay_tokens": replay.tokens if replay else None,
                    "replay_runs": len(replay.arms["none"].runs_s) if replay and "none" in replay.arms else None}
    for arm in REPLAY_ARMS:
        a = replay.arms.get(arm) if replay else None
        fields[f"rollout_s_{arm}"] = round(a.seconds, 3) if a else None
        fields[f"tail_s_{arm}"] = round(a.tail_seconds, 3) if a else None
    for arm in ("served", "cotrained", "baseline"):
        for tail in (False, True):
            value = replay.speedup(arm, tail=tail) if replay else None
            fields[f"speedup_{arm}{'_tail' if tail else ''}"] = None if value is None else round(value, 3)
    value = replay.speedup("served", over="baseline") if replay else None
    fields["speedup_served_over_baseline"] = None if value is None else round(value, 3)
    for tail in (False, True):
        spread = replay.speedup_range("served", tail=tail) if replay else None
        fields[f"speedup_served{'_tail' if tail else ''}_runs"] = None if spread is None else [round(v, 3)
                                                                                               for v in spread]
    by_batch = replay.batch_speedups("served") if replay else {}
    fields["speedup_served_by_batch"] = {str(b): round(v, 3) for b, v in by_batch.items()} or None
    speculated = replay.batch_speedups("served", speculated=True) if replay else {}
    fields["speedup_served_min_batch"] = round(min(speculated.values()), 3) if speculated else None
    fields["replay_threshold_served"] = replay.arms["served"].threshold if replay and "served" in replay.arms \
        else None
    return fields


def speedup_goals(rows: list[StepRow], first_step: int = 3) -> dict | None:
    """The served drafter's measured speedup over no speculation on the steps from `first_step` that replayed: in
    the tail and over the whole step (least and mean), at its worst batch size where it speculated, and over the
    never-retrained one."""
    steps = [r for r in rows if r.step >= first_step and r.speedup_served is not None]
    if not steps:
        return None

    def spread(key: str) -> dict | None:
        values = [getattr(r, key) for r in steps if getattr(r, key) is not None]
        if not values:
            return None
        out = {"min": round(min(values), 3), "mean": round(sum(values) / len(values), 3)}
        if runs := [getattr(r, f"{key}_runs", None) for r in steps if getattr(r, f"{key}_runs", None)]:
            out["runs"] = [round(min(lo for lo, _ in runs), 3), round(max(hi for _, hi in runs), 3)]
        return out

    return {"steps": [r.step for r in steps], "served_tail": spread("speedup_served_tail"),
            "served_whole": spread("speedup_served"), "served_worst_batch": spread("speedup_served_min_batch"),
            "served_over_baseline": spread("speedup_served_over_baseline")}


def _cell(value: object, spec: str) -> str:
    """A table cell: `value` formatted by `spec`, or a dash as wide when there is none."""
    width = int(spec.split(".")[0])
    return f"{'-':>{width}}" if value is None else format(value, spec)


def _runs(spread: list[float] | None) -> str:
    """A speedup's least and greatest over the replay's runs."""
    return "-" if not spread else f"{spread[0]:.2f}-{spread[1]:.2f}x"


def format_replay(rows: list[StepRow]) -> str:
    """Each step's rollouts replayed per arm: seconds without a drafter and with each, and the speedups measured."""
    head = (f"{'step':>4} {'none s':>7} {'baseline s':>10} {'served s':>8} {'co-tr s':>7} {'served':>7} "
            f"{'tail':>6} {'tail, runs':>11} {'vs base':>7} {'co-tr':>6} {'tail':>6}")
    lines = [head, "-" * len(head)]

    for r in rows:
        lines.append(
            f"{r.step:>4} {_cell(r.rollout_s_none, '7.2f')} {_cell(r.rollout_s_baseline, '10.2f')} "
            f"{_cell(r.rollout_s_served, '8.2f')} {_cell(r.rollout_s_cotrained, '7.2f')} "
            f"{_cell(r.speedup_served, '6.2f')}x {_cell(r.speedup_served_tail, '5.2f')}x "
            f"{_runs(r.speedup_served_tail_runs):>11} {_cell(r.speedup_served_over_baseline, '6.2f')}x "
            f"{_cell(r.speedup_cotrained, '5.2f')}x {_cell(r.speedup_cotrained_tail, '5.2f')}x")
    return "\n".join(lines)


def replay_png(rows: list[StepRow], dpi: int = 100) -> bytes:
    """Measured rollout seconds of each step's replay per arm: what no drafter, the never-retrained, the served and
    the co-trained drafter take over the same requests."""
    plt = pyplot()
    measured = [r for r in rows if r.rollout_s_none is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=dpi)
    labels = {"none": "no speculation", "baseline": "never retrained", "served": "served", "cotrained": "co-trained"}
    for arm, style in zip(REPLAY_ARMS, ("k-", "^:", "s--", "o-"), strict=True):
        seconds = [getattr(r, f"rollout_s_{arm}") for r in measured]
        ax.plot([r.step for r in measured], seconds, style, label=labels[arm])
    ax.set_xlabel("RL step")
    ax.set_ylabel("rollout seconds (replayed)")
    ax.set_title("Measured rollout time per drafter: the step's requests replayed")
    if measured:
        ax.set_xticks([r.step for r in measured])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return figure_png(fig)


TAIL_FIELDS = ("tail_tau_start", "tail_tau_refreshed", "tail_tau_whole_step", "refresh_version", "refresh_deployed",
               "refresh_latency_s", "refresh_latency_share", "tail_prompts", "refresh_breakdown")


def tail_fields(store: ObjectStore, run: str, step: int) -> dict:
    """The step's tail tau per drafter and its refresh (None where the step had no parts, or no refresh)."""
    tail, refresh = read_tail(store, run, step), read_refresh(store, run, step)
    fields = dict.fromkeys(TAIL_FIELDS)
    if refresh:
        fields.update({"refresh_version": refresh.version, "refresh_deployed": refresh.deployed,
                       "refresh_latency_s": refresh.latency_s,
                       "refresh_breakdown": refresh.breakdown.to_json() if refresh.breakdown else None})
    if tail:
        fields.update({f"tail_tau_{role}": None if tau is None else round(tau, 4) for role, tau in tail.taus.items()})
        fields.update({"refresh_latency_share": tail.latency_share, "tail_prompts": tail.prompts})
    return fields


def tail_goals(rows: list[StepRow], first_step: int = 2) -> dict | None:
    """Means over the steps from `first_step` with a measured tail: the refreshed drafter's tail tau against the
    whole-step drafter's and the start-of-step one's, and the refresh's latency as a share of the step's period."""
    steps = [r for r in rows if r.step >= first_step and r.tail_tau_refreshed and r.tail_tau_start]
    if not steps:
        return None
    whole = [r for r in steps if r.tail_tau_whole_step]
    shares = [r.refresh_latency_share for r in steps if r.refresh_latency_share is not None]

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 4) if values else None

    return {"steps": [r.step for r in steps],
            "refreshed_over_whole_step": mean([r.tail_tau_refreshed / r.tail_tau_whole_step for r in whole]),
            "refreshed_over_start": mean([r.tail_tau_refreshed / r.tail_tau_start for r in steps]),
            "latency_share": mean(shares), "latency_s": mean([r.refresh_latency_s for r in steps
                                                              if r.refresh_latency_s is not None])}


def refresh_breakdowns(store: ObjectStore, run: str, steps: list[int]) -> dict[int, RefreshBreakdown]:
    """Where each refreshed step's latency went, from its refresh record."""
    records = [read_refresh(store, run, s) for s in steps]
    return {r.step: r.breakdown for r in records if r is not None and r.breakdown is not None}


BREAKDOWN_COLUMNS = (("wait", "wait_s"), ("launch", "launch_s"), ("extract", "extract_s"), ("tune", "fine_tune_s"),
                     ("train io", "train_io_s"), ("check", "check_s"), ("handoff", "handoff_s"),
                     ("deploy", "deploy_s"), ("total", "total_s"))


def format_breakdown(breakdowns: dict[int, RefreshBreakdown]) -> str:
    """One line per refresh: seconds from its qualifying part's publication to the fleet running it, by segment
    (RefreshBreakdown says what each holds), and their mean over the deployed ones."""
    head = f"{'step':>4} " + " ".join(f"{name:>8}" for name, _ in BREAKDOWN_COLUMNS)
    lines = [head, "-" * len(head)]
    rows = [(str(step), b) for step, b in sorted(breakdowns.items())]
    mean = RefreshBreakdown.mean(list(breakdowns.values()))
    for label, b in rows + ([("mean", mean)] if mean else []):
        cells = [getattr(b, attr) for _, attr in BREAKDOWN_COLUMNS]
        lines.append(f"{label:>4} " + " ".join("       -" if v is None else f"{v:>8.1f}" for v in cells))
    return "\n".join(lines)


def format_tail(rows: list[StepRow]) -> str:
    """Tau on each step's tail (its parts after the refresh's qualifying one) and the refresh's latency."""
    head = (f"{'step':>4} {'tail start':>10} {'refreshed':>9} {'whole step':>10} {'refresh v':>9} "
            f"{'latency s':>9} {'of period':>9}")
    lines = [head, "-" * len(head)]

    for r in rows:
        version = r.refresh_version
        version = "-" if version is None else f"v{version}" + ("" if r.refresh_deployed else "*")
        lines.append(f"{r.step:>4} {_cell(r.tail_tau_start, '10.2f')} "
                     f"{_cell(r.tail_tau_refreshed, '9.2f')} {_cell(r.tail_tau_whole_step, '10.2f')} "
                     f"{version:>9} {_cell(r.refresh_latency_s, '9.1f')} "
                     f"{_cell(r.refresh_latency_share, '9.0%')}")
    return "\n".join(lines)


def _tau(measured: DrafterTau | None) -> float:
    return round(measured.tau, 4) if measured else NO_DRAFTER_TAU


def _greedy(measured: DrafterTau | None) -> float:
    if measured is None:
        return NO_DRAFTER_TAU
    return round(measured.greedy_tau if measured.greedy_tau is not None else measured.tau, 4)


def _estimate(measured: DrafterTau | None) -> dict | None:
    estimate = measured.estimate if measured else None
    if not estimate:
        return None
    return {"tau": round(estimate.tau, 4), "rollouts": estimate.sequences, "positions": estimate.positions}


def format_table(rows: list[StepRow]) -> str:
    reward = any(r.trl_mean_reward is not None for r in rows)  # the RL trainer's own mean reward, when it reports one
    head = f"{'step':>4} {'samples':>7} {'buffer':>6} {'trained':>7} {'tau co-trained':>14} " \
           f"{'tau served':>10} {'tau baseline':>12} {'greedy co-tr':>12} {'promoted':>8}" + \
           (f" {'TRL reward':>10}" if reward else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.step:>4} {r.samples:>7} {r.buffer_samples:>6} {'yes' if r.trained else 'no':>7} "
            f"{r.tau_cotrained:>14.2f} {r.tau_served:>10.2f} {r.tau_baseline:>12.2f} "
            f"{r.tau_greedy_cotrained or r.tau_cotrained:>12.2f} "
            f"{'yes' if r.promoted else 'no':>8}" + (f" {r.trl_mean_reward:>10.3f}" if reward else "")
        )
    if rows and rows[-1].sampling:
        lines.append(f"(tau at the rollouts' sampling, {rows[-1].sampling}, {rows[-1].draft_sample_method} "
                     "drafting, as vLLM verifies drafts; greedy co-tr: the co-trained drafter at temperature 0)")
    return "\n".join(lines)


def acceptance_png(rows: list[StepRow], k: int, drafter_kind: str = "", dpi: int = 120) -> bytes:
    """tau per RL step of the co-trained, served and never-retrained drafters (rows: `step_row`s or
    `acceptance_rows`)."""
    plt = pyplot()
    steps = [r.step for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=dpi)
    ax.plot(steps, [r.tau_cotrained for r in rows], "o-", label="co-trained (new drafter)")
    ax.plot(steps, [r.tau_served for r in rows], "s--", label="served (champion during the step)")
    ax.plot(steps, [r.tau_baseline for r in rows], "^:", label="never retrained (baseline)")
    ax.axhline(k + 1, color="grey", lw=0.8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.text(steps[0], k + 1 - 0.15, f"ceiling k+1 = {k + 1}", fontsize=8, color="grey", va="top")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean acceptance length tau")
    ax.set_title(f"{drafter_kind.upper() + ' d' if drafter_kind else 'D'}rafter acceptance against each step's policy")
    ax.set_xticks(steps)
    ax.set_ylim(0.8, k + 1.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return figure_png(fig)


def plot(rows: list[StepRow], k: int, path: Path, drafter_kind: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(acceptance_png(rows, k, drafter_kind))
    return path


def acceptance_rows(store: ObjectStore, run: str, steps: list[int]) -> list[StepRow]:
    """tau of the co-trained, served and never-retrained drafters for the `steps` that have an acceptance record (no
    other reads)."""
    rows = []
    for step in steps:
        if store.exists(acceptance_key(run, step)):
            record = read_acceptance(store, run, step)
            rows.append(StepRow(step, tau_cotrained=_tau(record.cotrained), tau_served=_tau(record.served),
                                tau_baseline=_tau(record.baseline)))
    return rows


def write_summary(rows: list[StepRow], wall_s: float, step_wall_s: list[float], path: Path, **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"wall_s": round(wall_s, 2), "step_wall_s": [round(s, 2) for s in step_wall_s],
           "steps": [r.to_json() for r in rows], **extra}
    path.write_text(json.dumps(doc, indent=2))
    return path


def ledger_png(ledger: Ledger, dpi: int = 100) -> bytes:
    """Two panels: how many RL steps old the drafter serving each step was, and the run's cumulative
    device-seconds spent on the drafter against the rollout seconds it saved."""
    plt = pyplot()
    fig, (lag_ax, cost_ax) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=dpi)
    lags = [lag for lag in ledger.lags if lag.lag_steps is not None]
    lag_ax.bar([lag.step for lag in lags], [lag.lag_steps for lag in lags], color="tab:orange")
    lag_ax.set_xlabel("RL step")
    lag_ax.set_ylabel("served drafter's lag (RL steps)")
    lag_ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
    lag_ax.set_title("How old the served drafter was")
    lag_ax.grid(alpha=0.3, axis="y")
    running = cumulative(ledger.costs)
    steps = [r.step for r in running]
    cost_ax.plot(steps, [r.spent_s for r in running], "o-", color="tab:red",
                 label="spent (extract, train, eval, deploy)")
    cost_ax.plot(steps, [r.saved_s for r in running], "s-", color="tab:green", label="rollout time saved")
    cost_ax.set_xlabel("RL step")
    cost_ax.set_ylabel("cumulative device-seconds")
    cost_ax.set_title("Co-training: spent against saved")
    cost_ax.legend(fontsize=8)
    cost_ax.grid(alpha=0.3)
    fig.tight_layout()
    return figure_png(fig)


def ledger_rows(ledger: Ledger) -> list[dict]:
    """Per step: lag, device-seconds by stage, saved, and the running totals (the summary JSON's `ledger`)."""
    rows = []
    for cost, lag, running in zip(ledger.costs, ledger.lags, cumulative(ledger.costs), strict=True):
        rows.append({"step": cost.step, "served_version": cost.served_version, "lag_steps": lag.lag_steps,
                     "lag_s": lag.lag_s, "seconds": cost.to_json()["seconds"], "rollout_tokens": cost.rollout_tokens,
                     "served_tau": round(cost.served_tau, 4), "saved_s": round(cost.saved_s, 3),
                     "saving": "measured" if cost.saving_measured else "modeled",
                     "cumulative_spent_s": running.spent_s, "cumulative_saved_s": running.saved_s})
    return rows


def format_ledger(ledger: Ledger) -> str:
    """The terminal's ledger table: one line per step, then the totals."""
    head = f"{'step':>4} {'served':>6} {'lag':>4} {'lag s':>7} {'extract s':>9} {'train s':>8} {'eval s':>7} " \
           f"{'deploy s':>8} {'saved s':>8}"
    lines = [head, "-" * len(head)]
    for cost, lag in zip(ledger.costs, ledger.lags, strict=True):
        s = cost.seconds
        lag_s = "-" if lag.lag_s is None else f"{lag.lag_s:.1f}"
        lines.append(
            f"{cost.step:>4} {'v' + cost.served_version if cost.served_version else '-':>6} "
            f"{'-' if lag.lag_steps is None else lag.lag_steps:>4} {lag_s:>7} "
            f"{s[EXTRACTION]:>9.1f} {s[TRAINING]:>8.1f} {s[EVALUATION]:>7.1f} {s[DEPLOYMENT]:>8.1f} "
            f"{cost.saved_s:>8.3f}" + ("" if cost.saving_measured else " (modeled)"))
    total = ledger.totals
    lines.append(f"spent {total.spent_s:.1f} device-s ({', '.join(f'{s} {v:.1f}' for s, v in total.by_stage.items())})"
                 f", saved {total.saved_s:.3f} s of rollout time")
    if all(c.saving_measured for c in ledger.costs):
        lines.append("(saved: measured, the step's rollouts replayed without a drafter and with the served one)")
    return "\n".join(lines)


def format_phases(rows: list[StepRow], ledger: Ledger) -> str:
    """A real trainer's step by phase, as RL papers report it: the trainer's side (the rows' `phases`: weight
    push, generation, publication, policy update) beside the pipeline's (the ledger's stages), in seconds."""
    head = f"{'step':>4} {'generation':>10} {'policy update':>13} {'weight push':>11} {'publish':>7} " \
           f"{'extraction':>10} {'training':>8} {'evaluation':>10} {'deploy':>6}"
    lines = [head, "-" * len(head)]
    costs = {c.step: c.seconds for c in ledger.costs}
    for r in rows:
        p, s = r.phases, costs.get(r.step, {})
        lines.append(f"{r.step:>4} {p['generation_s']:>10.1f} {p['update_s']:>13.1f} {p['weight_push_s']:>11.1f} "
                     f"{p['publish_s']:>7.1f} {s.get(EXTRACTION, 0.0):>10.1f} {s.get(TRAINING, 0.0):>8.1f} "
                     f"{s.get(EVALUATION, 0.0):>10.1f} {s.get(DEPLOYMENT, 0.0):>6.1f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class ScheduleStep:
    """One step of a run as a training schedule left it: whether and why it trained, at what cost, and what the
    drafter that served it saved."""

    step: int
    trained: bool
    reason: str
    training_s: float  # the step's own training (a refresh's is `refresh_s`)
    refresh_s: float
    served_tau: float
    saved_s: float
    cumulative_saved_s: float
    rollout_tokens: int = 0
    decoding: DecodingCost | None = None  # the served drafter's rounds as the step's evaluation timed them


def schedule_steps(store: ObjectStore, run: str, steps: list[int]) -> list[ScheduleStep]:
    """The run's steps from the records its stages stored (training decisions, step costs, refreshes)."""
    rows, saved = [], 0.0
    for step in steps:
        cost, refresh = read_cost(store, run, step), read_refresh(store, run, step)
        if cost is None or not store.exists(drafter_key(run, step)):
            continue
        training = read_training(store, run, step)
        saved += cost.saved_s
        rows.append(ScheduleStep(step, training.trained, training.reason, round(cost.spent(TRAINING), 3),
                                 round(refresh.train_s if refresh else 0.0, 3), round(cost.served_tau, 4),
                                 round(cost.saved_s, 3), round(saved, 3), cost.rollout_tokens, cost.decoding))
    return rows


def common_price(runs: dict[str, list[ScheduleStep]]) -> DecodingCost | None:
    """One price of decoding for every run: the median t and c of every step's timing in any of them (f of the
    newest). Each run decides on its own timings, as the pipeline does, but t timed on a shared machine varies
    twofold between runs, and savings compared at two prices would measure the machine's load, not the schedule."""
    timings = [r.decoding for rows in runs.values() for r in rows if r.decoding]
    if not timings:
        return None
    return DecodingCost(statistics.median(d.target_s_per_token for d in timings),
                        statistics.median(d.draft_cost_ratio for d in timings), timings[-1].drafter_forwards_per_round)


def at_price(rows: list[ScheduleStep], price: DecodingCost) -> list[ScheduleStep]:
    """The run's savings at `price`: a step a drafter served saves price.saved_seconds(its served tau, its tokens)."""
    priced, saved = [], 0.0
    for r in rows:
        step_saved = price.saved_seconds(r.served_tau, r.rollout_tokens) if r.decoding else 0.0
        saved += step_saved
        priced.append(replace(r, saved_s=round(step_saved, 3), cumulative_saved_s=round(saved, 3)))
    return priced


@dataclass(frozen=True)
class ScheduleTotals:
    training_s: float
    refresh_s: float
    saved_s: float
    trained_steps: tuple[int, ...]


def schedule_totals(rows: list[ScheduleStep]) -> ScheduleTotals:
    return ScheduleTotals(round(sum(r.training_s for r in rows), 3), round(sum(r.refresh_s for r in rows), 3),
                          round(sum(r.saved_s for r in rows), 3), tuple(r.step for r in rows if r.trained))


def format_schedules(runs: dict[str, list[ScheduleStep]]) -> str:
    """Schedules side by side, one line per step: trained, training seconds, served tau, cumulative saved."""
    kinds = list(runs)
    by_step = {kind: {r.step: r for r in rows} for kind, rows in runs.items()}
    steps = sorted({s for rows in by_step.values() for s in rows})
    cell = f"{'train':>5} {'train s':>7} {'tau':>5} {'saved cum':>9}"
    head = f"{'step':>4} " + " | ".join(f"{kind:^{len(cell)}}" for kind in kinds)
    lines = [head, f"{'':>4} " + " | ".join(cell for _ in kinds), "-" * len(head)]
    for step in steps:
        cells = []
        for kind in kinds:
            r = by_step[kind].get(step)
            cells.append(" " * len(cell) if r is None else
                         f"{'yes' if r.trained else 'no':>5} {r.training_s:>7.1f} {r.served_tau:>5.2f} "
                         f"{r.cumulative_saved_s:>9.2f}")
        lines.append(f"{step:>4} " + " | ".join(cells))
    for kind in kinds:
        t = schedule_totals(runs[kind])
        lines.append(f"{kind}: trained steps {list(t.trained_steps)}, training {t.training_s:.1f} s (refresh "
                     f"{t.refresh_s:.1f} s), saved {t.saved_s:.2f} s of rollout time")
    for kind in kinds:
        if kind == "interval":  # its reason is the step number
            continue
        lines.append(f"why {kind} trained or not:")
        for r in runs[kind]:
            lines.extend(textwrap.wrap(f"{r.step:>4} {'trained' if r.trained else 'skipped'}: {r.reason}", 118,
                                       subsequent_indent=" " * 5))
    return "\n".join(lines)


def schedules_png(runs: dict[str, list[ScheduleStep]], dpi: int = 100) -> bytes:
    """Three panels, one line per schedule: served tau per step, cumulative training seconds, cumulative saved."""
    plt = pyplot()
    fig, (tau_ax, train_ax, saved_ax) = plt.subplots(1, 3, figsize=(13, 3.6), dpi=dpi)
    for kind, rows in runs.items():
        steps = [r.step for r in rows]
        tau_ax.plot(steps, [r.served_tau for r in rows], "o-", label=kind)
        spent, running = 0.0, []
        for r in rows:
            spent += r.training_s
            running.append(spent)
        train_ax.plot(steps, running, "o-", label=kind)
        saved_ax.plot(steps, [r.cumulative_saved_s for r in rows], "o-", label=kind)
    for ax, title, label in ((tau_ax, "Served tau", "tau of the served drafter"),
                             (train_ax, "Training spent", "cumulative training seconds"),
                             (saved_ax, "Rollout time saved", "cumulative saved seconds")):
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return figure_png(fig)
