"""When the drafter trains: the `interval` and `cost` schedules on the simulated source, one run each.

Each run takes the demo's steps through the pipeline's own stages in one process, in order (no
Dagster, no fleet, no pacing, so the two runs see exactly the same steps and nothing coalesces):
the step's hidden states, its buffer, the training the schedule decides on (`plan_training`, from
the records earlier steps left), then `evaluate_step`, which writes the step's cost entry. The
served drafter of a step is the champion before it (the fleet's lag of one step). Figures per
schedule: steps trained with each decision's reason, training seconds (this process's CPU-seconds
of each training, as the ledger counts them here: the load other processes put on a shared
machine does not count), the served tau and the rollout seconds the served drafters saved,
cumulative, at one price for both runs (`common_price`: the median of every step's timing in
either run; each run decides on its own timings, as the pipeline does).

The price of decoding, which both the decisions and the savings rest on (`--price`):

* `measured`: t and c as the evaluation timed them. On the demo's 2-layer CPU target a drafter
  forward costs about 0.7 of a target forward (a round of k = 4: 3.8 target forwards), above any
  tau the toy reaches: no drafter saves time, and `cost` stops training once it has measured so.
* `h100` (default): c = 0.078 (`eval.draft_cost_ratio`), from docs/storage.md's H100 figures
  (batched speculative decoding at tau 1.0, 492 against 645 tokens/s: a round of k = 4 costs 1.31
  target forwards), t as timed here: the decisions and the savings are a fleet's on H100s.

t is in CPU-seconds, as the trainings are: the evaluation's wall-clock t times the share of its
wall-clock the process ran (one thread: at most 1). On a machine other processes load, the
wall-clock t of a step rises with their load while a training's CPU-seconds do not, and a decision
would weigh rollouts dearer against trainings the busier the machine.

`--rollout-scale X` prices each step's rollouts as X times the toy's (t times X, in the step's cost
record before the next decision reads it): the toy's step
generates about 5,000 tokens, a few CPU-seconds, against a training of 15-40 s, while a production
RL step generates 10^6-10^8 tokens against a drafter training of minutes. `--drift` sets
`simulation.drift` (the share of contexts whose favourite moves per step; 0.15 by default), `--seed`
`simulation.seed` (another task, policy and rollouts: a different staleness series).

The goal (#28): `cost` at most 0.6 of `interval`'s training seconds (`training_s_ratio`) at >= 0.95
of its saved time (`saved_s_ratio`), both measured in the same invocation. `regimes` replays the
decision rule (the same functions, on the staleness model it decides with) over 40 steps for a grid
of staleness and rollout-to-training ratios, to show where that goal can hold at all: a drafter that
keeps little of its acceptance per step (the toy at drift 0.15 keeps about half) loses most of a
skipped step's saving, so no schedule trains less at the same saving; a drafter that keeps 0.85 or
more, with a training that costs a few percent of a step's rollout seconds, is where skipping pays.

    python -m benchmarks.schedule [--steps 6] [--price h100|measured] [--rollout-scale 1] [--drift 0.15] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("interval", "cost")
H100_DRAFT_COST_RATIO = 0.078  # (645 / 492 - 1) / 4: docs/storage.md, On an H100, evaluation


def _config(data_dir: Path, kind: str, draft_cost_ratio: float | None, drift: float | None, seed: int | None = None):
    from pipeline.config import load_config

    overrides: dict = {"data_dir": str(data_dir), "run": f"schedule-{kind}", "fleet": {"driver": "none"},
                       "train": {"schedule": {"kind": kind}}, "eval": {"draft_cost_ratio": draft_cost_ratio or 0.0}}
    simulation = {k: v for k, v in (("drift", drift), ("seed", seed)) if v is not None}
    if simulation:
        overrides["simulation"] = simulation
    return load_config(overrides=overrides)


def _rescale(store, run: str, step: int, rollout_scale: float, cpu_share: float = 1.0) -> None:
    """The step's cost record with its rollouts priced `rollout_scale` times the toy's, and t in CPU-seconds (the
    wall-clock t the evaluation timed times the share of it the process ran, `cpu_share`), before the next
    decision reads it: trainings count CPU-seconds here, and a loaded machine must not make the rollouts look
    dearer against them than they are."""
    from dataclasses import replace

    from pipeline.cost import DecodingCost
    from pipeline.data.keys import cost_key
    from pipeline.data.records import read_cost, write_record

    cost = read_cost(store, run, step)
    if cost is None or cost.decoding is None or (rollout_scale == 1.0 and cpu_share == 1.0):
        return
    d = cost.decoding
    priced = DecodingCost(d.target_s_per_token * rollout_scale * cpu_share, d.draft_cost_ratio,
                          d.drafter_forwards_per_round)
    write_record(store, cost_key(run, step), replace(cost, decoding=priced))


def _run(kind: str, steps: int, data_dir: Path, draft_cost_ratio: float | None, rollout_scale: float,
         drift: float | None, seed: int | None = None, caches: tuple[Path, ...] = ()) -> dict:
    from pipeline.data import buffer as buffer_lib
    from pipeline.data.records import read_cost
    from pipeline.data.store import open_store
    from pipeline.evaluation.acceptance import evaluate_step
    from pipeline.registry import open_registry
    from pipeline.sources import extract
    from pipeline.sources.simulation import SimulatedRL
    from pipeline.training.cotrain import train_step

    cfg = _config(data_dir, kind, draft_cost_ratio, drift, seed)
    # the demo's pre-trained target, or the one the other run pre-trained: pre-training is not what is measured
    for cached in (ROOT / ".data" / "cache", *caches):
        if cached.is_dir():
            shutil.copytree(cached, cfg.data_path / "cache", dirs_exist_ok=True)
    store, registry = open_store(cfg), open_registry(cfg)
    simulation = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    rows = []
    for step in range(1, steps + 1):
        simulation.run_step(step)
        started = time.process_time()  # CPU-seconds, as the ledger counts a stage here: other processes' load
        extract.extract_hidden_states(store, cfg, step)  # on the shared machine does not count
        extraction_s = time.process_time() - started
        buffer_lib.build_buffer(store, cfg.run, step, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)
        started = time.process_time()
        outcome = train_step(store, cfg, step, registry, {"benchmark": "schedule"})
        training_s = time.process_time() - started if outcome.trained else 0.0
        started, wall = time.process_time(), time.perf_counter()
        record = evaluate_step(store, cfg, step, registry, outcome.version,
                               {"extraction": extraction_s, "training": training_s})
        cpu_share = min(1.0, (time.process_time() - started) / (time.perf_counter() - wall))
        _rescale(store, cfg.run, step, rollout_scale, cpu_share)
        cost = read_cost(store, cfg.run, step)
        served, cotrained = record.drafters.get("served"), record.drafters.get("cotrained")
        rows.append({"step": step, "trained": outcome.trained, "reason": outcome.reason,
                     "training_s": round(training_s, 2), "tau_served": round(served.tau, 3) if served else 1.0,
                     "version_served": served.version if served else None,
                     "tau_cotrained": round(cotrained.tau, 3) if cotrained else None,
                     "rollout_tokens": cost.rollout_tokens, "decoding": cost.decoding.to_json() if cost.decoding
                     else None, "evaluation_cpu_share": round(cpu_share, 3), "saved_s": round(cost.saved_s, 4)})
    return {"steps": rows}


def common_price(runs: list[list[dict]]):
    """One decoding price for both runs: the median t and c of every step's timing in either. Each run decides on
    its own timings, as the pipeline does, but t timed on a shared machine varies twofold between runs, and a
    saving compared at two prices would measure the machine's load rather than the schedule."""
    import statistics

    from pipeline.cost import DecodingCost

    timings = [DecodingCost.from_json(r["decoding"]) for rows in runs for r in rows if r["decoding"]]
    return DecodingCost(statistics.median(d.target_s_per_token for d in timings),
                        statistics.median(d.draft_cost_ratio for d in timings), timings[-1].drafter_forwards_per_round)


def _summary(rows: list[dict], price) -> dict:
    saved, per_step = 0.0, []
    for r in rows:
        if r["decoding"]:  # a drafter served the step
            saved += price.saved_seconds(r["tau_served"], r["rollout_tokens"])
        per_step.append(round(saved, 3))
    return {"trained_steps": [r["step"] for r in rows if r["trained"]],
            "training_s": round(sum(r["training_s"] for r in rows), 2),
            "saved_s_own_timings": round(sum(r["saved_s"] for r in rows), 3),
            "saved_s": round(saved, 3), "cumulative_saved_s": per_step,
            "tau_served": [r["tau_served"] for r in rows]}


def replay(keep: float, tau_fresh: float, rollout_to_training: float, draft_cost_ratio: float, forwards: int,
           steps: int = 40) -> dict:
    """Both schedules on the staleness model `cost` decides with (the same functions): a drafter trained at step
    j serves step s at fresh(s - j); a step's rollouts take `rollout_to_training` trainings' seconds."""
    from pipeline.cost import DecodingCost
    from pipeline.training.schedule import ChampionTrack, ScheduleInputs, Staleness, cost_decision

    tokens, training_s = 1000, 10.0
    decoding = DecodingCost(rollout_to_training * training_s / tokens, draft_cost_ratio, forwards)
    staleness = Staleness(keep, tau_fresh, 1)
    interval_saved = (steps - 1) * decoding.saved_seconds(staleness.tau_at(1), tokens)
    seen, trainings, saved = 1, 1, 0.0
    for s in range(2, steps + 1):
        saved += decoding.saved_seconds(staleness.tau_at(s - seen), tokens)  # served, trained at `seen`
        champion = ChampionTrack("c", seen, tau_fresh, staleness.tau_at(s - seen), s)
        if cost_decision(ScheduleInputs(champion, tokens, training_s, decoding, staleness=staleness), s).train:
            seen, trainings = s, trainings + 1
    return {"keep": keep, "rollout_to_training": rollout_to_training,
            "training_s_ratio": round(trainings / steps, 3),
            "saved_s_ratio": round(saved / interval_saved, 3) if interval_saved > 0 else None}


def run(steps: int = 6, price: str = "h100", rollout_scale: float = 1.0, drift: float | None = None,
        seed: int | None = None) -> dict:
    draft_cost_ratio = H100_DRAFT_COST_RATIO if price == "h100" else None
    report: dict = {"steps": steps, "price": price, "draft_cost_ratio": draft_cost_ratio,
                    "rollout_scale": rollout_scale, "drift": drift, "seed": seed}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            report[kind] = _run(kind, steps, Path(tmp) / kind, draft_cost_ratio, rollout_scale, drift, seed,
                                tuple(Path(tmp) / other / "cache" for other in KINDS if other != kind))
    price = common_price([report[kind]["steps"] for kind in KINDS])
    report["common_price"] = price.to_json()
    for kind in KINDS:
        report[kind].update(_summary(report[kind]["steps"], price))
    interval, cost = report["interval"], report["cost"]
    report["training_s_ratio"] = round(cost["training_s"] / interval["training_s"], 3)
    # a ratio of savings means something only where interval's saving is positive
    report["saved_s_ratio"] = round(cost["saved_s"] / interval["saved_s"], 3) if interval["saved_s"] > 0 else None
    report["goal"] = "cost: training_s_ratio <= 0.6 at saved_s_ratio >= 0.95"
    report["goal_met"] = bool(report["saved_s_ratio"] is not None and report["training_s_ratio"] <= 0.6
                              and report["saved_s_ratio"] >= 0.95)
    cotrained = [r["tau_cotrained"] for r in interval["steps"] if r["trained"] and r["tau_cotrained"]]
    tau_fresh = sum(cotrained) / len(cotrained)
    report["regimes"] = {"tau_fresh": round(tau_fresh, 3), "draft_cost_ratio": H100_DRAFT_COST_RATIO, "rows": [
        replay(keep, tau_fresh, ratio, H100_DRAFT_COST_RATIO, 4)
        for keep in (0.5, 0.7, 0.85, 0.95) for ratio in (1.0, 3.0, 10.0, 30.0, 100.0)]}
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--price", choices=["h100", "measured"], default="h100")
    parser.add_argument("--rollout-scale", type=float, default=1.0)
    parser.add_argument("--drift", type=float)
    parser.add_argument("--seed", type=int, help="simulation.seed: another task, policy and rollouts")
    args = parser.parse_args()
    sys.stdout.write(json.dumps(run(args.steps, args.price, args.rollout_scale, args.drift, args.seed), indent=2)
                     + "\n")


if __name__ == "__main__":
    main()
