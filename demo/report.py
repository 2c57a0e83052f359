"""What the demo prints and writes when its steps are done: the tables, the plots and the JSON summary."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ops.console import out
from pipeline.config import PipelineConfig

if TYPE_CHECKING:
    from pipeline.accounting.report import StepRow
    from pipeline.data.fleet_state import ReplicaDeploy


def step_line(r: StepRow, wall_s: float) -> str:
    """A finished step as the demo prints it: its wall time from publication to its acceptance record."""
    promoted = "  (promoted)" if r.promoted else ""
    live = f"  fleet runs v{r.deployed_version}" if r.deployed_version else ""
    trained = "" if r.trained else f"  (not trained: {r.train_reason})"
    served = f"v{r.version_served}" if r.version_served else "no drafter"
    return (f"  step {r.step}: {wall_s:5.1f}s  tau co-trained {r.tau_cotrained:.2f}  served ({served}) "
            f"{r.tau_served:.2f}  baseline {r.tau_baseline:.2f}{trained}{promoted}{live}"
            + (f"  TRL mean reward {r.trl_mean_reward:.3f}" if r.trl_mean_reward is not None else ""))


def kind_figures(cfg: PipelineConfig, rows: list[StepRow]) -> tuple[list[dict], float | None]:
    """What compares drafter kinds: the last co-trained drafter's tau, forwards and estimated speedup at
    k = 4 and 8 on the last step (P-EAGLE: up to its depths), and the mean training tokens/s."""
    from pipeline.data.store import open_store
    from pipeline.data.training_record import read_training
    from pipeline.evaluation.acceptance import round_costs_at_step
    from pipeline.registry import open_registry

    store, last = open_store(cfg), rows[-1]
    trainings = [read_training(store, cfg.run, r.step) for r in rows]
    rates = [t.figures.tokens_per_s for t in trainings if t.figures and t.figures.tokens_per_s]
    version = last.version_cotrained
    ks = [k for k in (4, 8) if cfg.drafter.kind != "peagle" or k <= cfg.drafter.num_depths]
    costs = round_costs_at_step(store, cfg, last.step, open_registry(cfg), version, ks) if version else []
    return [c.to_json() for c in costs], (sum(rates) / len(rates) if rates else None)


def tail_summary(goals: dict | None, breakdowns: dict) -> dict | None:
    """The tail's goals with the mean refresh latency breakdown (RefreshBreakdown) over the deployed refreshes."""
    from pipeline.data.refresh_record import RefreshBreakdown

    mean = RefreshBreakdown.mean(list(breakdowns.values()))
    if goals is None:
        return None
    return {**goals, "latency_breakdown": mean.to_json() if mean else None}


def demo_report(cfg: PipelineConfig, rows: list[StepRow], wall: float, step_walls: list[float],
                fleet_state: tuple[ReplicaDeploy, ...], source: str, fleet_rollouts: list[dict] | None = None) -> Path:
    """The table, the plot and the JSON summary of a demo."""
    from pipeline.accounting import report
    from pipeline.accounting.ledger import read_ledger
    from pipeline.data.store import open_store

    out_dir, k = cfg.data_path / "demo", cfg.eval.num_speculative_tokens
    plot = report.plot(rows, k, out_dir / "acceptance.png", cfg.drafter.kind)
    ledger = read_ledger(open_store(cfg), cfg.run, [r.step for r in rows])
    ledger_plot = out_dir / "ledger.png"
    ledger_plot.write_bytes(report.ledger_png(ledger))
    replay_plot = out_dir / "rollouts.png"
    replay_plot.write_bytes(report.replay_png(rows))
    fleet = [{"replica": r.replica, "version": r.version, "live_tau": round(r.live_tau, 4)} for r in fleet_state]
    total = ledger.totals
    summary_costs, tokens_per_s = kind_figures(cfg, rows)
    breakdowns = report.refresh_breakdowns(open_store(cfg), cfg.run, [r.step for r in rows])
    summary = report.write_summary(rows, wall, step_walls, out_dir / "summary.json", fleet=fleet,
                                   num_speculative_tokens=k, drafter_kind=cfg.drafter.kind, device=cfg.device,
                                   source=source, step_period_s=cfg.simulation.step_period_s,
                                   round_costs=summary_costs, train_tokens_per_s=tokens_per_s,
                                   ledger={"steps": report.ledger_rows(ledger), "spent_s": total.spent_s,
                                           "saved_s": total.saved_s,
                                           "spent_by_stage_s": {s.name: v for s, v in total.by_stage.items()}},
                                   tail=tail_summary(report.tail_goals(rows), breakdowns),
                                   rollout_speedup=report.speedup_goals(rows),
                                   fleet_rollouts=fleet_rollouts)
    out()
    out(report.format_table(rows))
    out()
    out(report.format_ledger(ledger))
    out()
    if all(r.phases is not None for r in rows):
        out("the step by phase, seconds (the trainer's, then the pipeline's device-seconds, as in the ledger):")
        out(report.format_phases(rows, ledger))
        out()
    if any(r.rollout_s_none is not None for r in rows):
        _print_replay(rows)
    if any(r.tail_tau_start is not None for r in rows):
        _print_tail(rows, breakdowns)
    _print_closing(cfg, rows, fleet, fleet_rollouts, summary_costs, tokens_per_s)
    out(f"wall time {wall:.1f}s ({wall / len(rows):.1f}s per step)")
    out(f"plots:   {plot}, {ledger_plot}, {replay_plot}")
    out(f"summary: {summary}")
    out("Browse the runs, partitions and checks with `make ui`.")
    return summary


def _print_replay(rows: list[StepRow]) -> None:
    """The rollouts replayed after each step, and the speedups they measured."""
    from pipeline.accounting import report

    runs = max((r.replay_runs or 0 for r in rows), default=0)
    each = f"{runs} runs each, taking turns" if runs != 1 else "1 run each"
    out(f"rollouts replayed after each step, the same requests and seeds per arm, {each} "
        "(seconds and speedups: the fastest runs'; tail, runs: the served tail's speedup run by run, least "
        "to greatest; speedup in tokens/s over no speculation, whole step and tail; vs base: served over "
        "never-retrained):")
    out(report.format_replay(rows))
    goals = report.speedup_goals(rows)
    if goals:
        def spread(name: str) -> str:
            value = goals[name]
            if value is None:
                return "-"
            runs = f"; runs {value['runs'][0]:.2f}-{value['runs'][1]:.2f}x" if "runs" in value else ""
            return f"{value['min']:.2f}x (mean {value['mean']:.2f}x{runs})"

        out(f"served over no speculation, steps {goals['steps']}: tail at least {spread('served_tail')}, "
            f"whole step {spread('served_whole')}, at its worst batch size where it speculated "
            f"{spread('served_worst_batch')}; "
            f"over the never-retrained drafter {spread('served_over_baseline')}")
    out()


def _print_tail(rows: list[StepRow], breakdowns: dict) -> None:
    """The tail of each step after its refresh, its goals, and the refreshes' latency by part."""
    from pipeline.accounting import report

    goals = report.tail_goals(rows)
    out(report.format_tail(rows))
    out("(tail: the step's parts after the refresh's qualifying part; * refreshed but not deployed)")
    if goals:
        def ratio(value: float | None, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        out(f"tail tau over steps {goals['steps']}: refreshed / whole-step "
            f"{ratio(goals['refreshed_over_whole_step'], '.2f')}x, refreshed / start-of-step "
            f"{ratio(goals['refreshed_over_start'], '.2f')}x; "
            f"refresh latency {ratio(goals['latency_s'], '.1f')} s, "
            f"{ratio(goals['latency_share'], '.0%')} of the step's rollout period")
    if breakdowns:
        out()
        out("refresh latency, seconds from the qualifying part's publication to every replica updated:")
        out(report.format_breakdown(breakdowns))
    out()


def _print_closing(cfg: PipelineConfig, rows: list[StepRow], fleet: list[dict], fleet_rollouts: list[dict] | None,
                   round_costs: list[dict], tokens_per_s: float | None) -> None:
    """tau from the first step to the last, what the fleet runs, and the last drafter's costs and training rate."""
    first, last = rows[0], rows[-1]
    out(f"tau over {len(rows)} steps: co-trained {first.tau_cotrained:.2f} -> {last.tau_cotrained:.2f}, "
        f"never retrained {first.tau_baseline:.2f} -> {last.tau_baseline:.2f} "
        f"({(last.tau_baseline / first.tau_baseline - 1) * 100:+.0f}%)")
    kind = "a stand-in, not vLLM" if cfg.fleet.driver == "standin" else f"{cfg.fleet.driver} driver"
    for replica in fleet:
        out(f"fleet: {replica['replica']} ({kind}) runs drafter version {replica['version']}, "
            f"live tau {replica['live_tau']:.2f} over its deploy's canaries")
    for w in fleet_rollouts or []:
        out(_fleet_rollouts_line(w))
    for c in round_costs:
        out(f"k={c['k']}: tau {c['tau']:.2f}, {c['drafter_forwards_per_round']:.0f} drafter forwards per round "
            f"({c['drafter_forwards_per_token']:.2f} per token), estimated speedup {c['estimated_speedup']:.2f}x "
            f"(drafter forward = {c['drafter_cost_ratio']:.3f} target forwards)")
    if tokens_per_s:
        out(f"training: {tokens_per_s:.0f} tokens/s (mean over the trained steps)")


def _fleet_rollouts_line(w: dict) -> str:
    """A step's rollouts on the fleet, as the fleet counted them."""
    tau = "-" if w["live_tau"] is None else f"{w['live_tau']:.2f}"
    # Rounds by kind and the batch threshold are the stand-ins' own metrics; vLLM counts drafts only.
    rounds = (f", rounds {int(w['rounds'].get('speculative', 0))} speculative / "
              f"{int(w['rounds'].get('plain', 0))} plain, largest batch speculating "
              f"{max((t for t in w['speculative_batch_threshold'].values() if t is not None), default=0)}"
              if w["rounds"] else "")
    return (f"fleet rollouts, step {w['step']}: {w['rollouts']} rollouts, {w['tokens']} tokens in {w['seconds']:.1f}s "
            f"({w['tokens_per_s'] or 0:.0f} tokens/s), live tau {tau} (the fleet's own count){rounds}")
