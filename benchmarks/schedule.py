"""When the drafter trains: the `interval` and `cost` schedules on the simulated source, in steady state.

Each run takes the simulated steps through the pipeline's own stages in one process, in order (no
Dagster, no fleet, no pacing, so the two runs see exactly the same steps and nothing coalesces):
the step's hidden states, its buffer, the training the schedule decides on (`plan_training`, from
the records earlier steps left), then `evaluate_step`, which writes the step's cost entry. The
served drafter of a step is the champion before it (the fleet's lag of one step).

Both runs share a warm-up: its first W steps (`--warmup`) train at every step, as `interval`
does and as every pipeline begins (no champion yet, nothing timed, no staleness measured), while
the drafter climbs its learning curve. The runs repeat it, one each, on the same seeds: on CPU it
is deterministic, and `warmup_identical` says whether both warm-ups served and co-trained the
same versions at the same taus. Then each run decides M steps (`--steps`) by its own schedule,
and one more step is served and measured, untrained: the M decisions' drafters serve steps
W+2..W+M+1. The goal's ratios (`measured`) pair those M decisions' training seconds with the
saving on the M steps their drafters serve; `whole_run` adds the warm-up beside them. A
production RL run lasts hundreds to thousands of steps, so its warm-up is a negligible share of
it; a run of ten steps is mostly warm-up, and there both schedules must train.

Figures per schedule: steps trained with each decision's reason, training seconds (this
process's CPU-seconds of each training, as the ledger counts them here: another process's time on
a shared machine does not count), the served tau, the rollout seconds the served drafters
saved, cumulative, at one price for both runs (`common_price`: the median of every step's timing
in either run; each run decides on its own timings, as the pipeline does), the net (saved less
training) and `keep`, the staleness each step's records give the next decision. `trainings_ratio`
is the decisions' share alone: identical trainings count different CPU-seconds when other work
contends for the machine's caches (up to a fifth apart, measured). `age_profile`: every drafter
`interval` trained from the warm-up's last step on, decoding the last trained step's held-out
prompts, tau by age on one policy (what a drafter trained a steps earlier serves), with `keep`
fitted to it with and without the age-0 drafter: the staleness a skipped training lets in,
measured directly, against the `keep` the rule reads from each step's few drafters.

The regime (`--rollout-to-training`, `--drift`) is argued from production, not searched for:

* A step's rollouts against a training (`--rollout-to-training`, 50). The reference step of
  docs/operating.md (Qwen3-8B, 8 H100s, an RL step of 600 s) spends 85% of its period
  generating rollouts (a reasoning step's share: `ROLLOUT_SHARE_OF_PERIOD` in the simulated
  source; ReSpec reports over 75%), 4,080 GPU-seconds, against a drafter training of 80
  GPU-seconds (docs/storage.md's projection, `train.max_tokens` 4M): 51. Their plain-decoding
  equivalent, the t * N the saving formula multiplies, is larger by the speedup the fleet
  already has (2.3 at tau 3), which makes training dearer to skip. The toy's own step
  generates about 5,000 tokens, under a CPU-second, against a training of 6-8 CPU-seconds, so
  its rollouts are priced at `rollout_scale` times the toy's: chosen after the `interval` run so
  that the median step's rollouts cost 50 times the mean of that run's trainings after the
  warm-up, and applied to both runs (to the `cost` run's records before each decision reads
  them). `--rollout-scale X` fixes the scale instead.
* What an RL step does to a drafter (`--drift`, 0.03: `simulation.drift`, the share of the
  task's contexts whose favourite continuation moves per step). An RL step of a production run
  moves the policy a little (a learning rate of about 1e-6, a clipped update): peers keep a
  drafter for several steps (verl-SpeCo retrains every 5), which a drafter losing most of its
  edge per step would not allow. At 0.03 half of the contexts have moved after 23 steps; at the
  demo's 0.15, chosen to make staleness visible in a six-step demo, after 4, and a drafter keeps
  about half of its excess acceptance per step. `--drift 0.15` is the demo's regime.

The price of decoding, which both the decisions and the savings rest on (`--price`):

* `h100` (default): c = 0.078 (`eval.draft_cost_ratio`), from docs/storage.md's H100 figures
  (batched speculative decoding at tau 1.0, 492 against 645 tokens/s: a round of k = 4 costs 1.31
  target forwards), t as timed here: the decisions and the savings are a fleet's on H100s.
* `measured`: t and c as the evaluation timed them. On the demo's 2-layer CPU target a drafter
  forward costs about 0.7 of a target forward (a round of k = 4: 3.8 target forwards), above any
  tau the toy reaches: no drafter saves time, and `cost` stops training once it has measured so.

t is in CPU-seconds, as the trainings are: the evaluation's wall-clock t times the share of its
wall-clock the process ran (one thread: at most 1). On a machine other processes load, the
wall-clock t of a step rises with their load while a training's CPU-seconds do not, and a decision
would weigh rollouts dearer against trainings the busier the machine.

The goal (#28): `cost` at most 0.6 of `interval`'s training seconds (`training_s_ratio`) at >= 0.95
of its saved time (`saved_s_ratio`), both measured in the same invocation, over the steps after
the warm-up. `regimes` replays the decision rule (the same functions, on the staleness model it
decides with) over 40 steps for a grid of staleness and rollout-to-training ratios, to show where
that goal can hold at all: a drafter that keeps little of its acceptance per step loses most of a
skipped step's saving, so no schedule trains less at the same saving, and where a training costs
a small share of a step's rollouts it pays unless drafters keep nearly all of their acceptance.
`model` replays it at this invocation's ratio and the median `keep` the `cost` run read,
`model_from_age_1` at the age profile's `keep` of drafters one step old or more.

`--tiny` (the smoke run's): one warm-up step and one decided, `benchmarks.tiny`'s source, trainings and evaluation.

    python -m benchmarks.schedule [--warmup 4] [--steps 8] [--rollout-to-training 50 | --rollout-scale X]
        [--drift 0.03] [--price h100|measured] [--seed N] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("interval", "cost")
H100_DRAFT_COST_RATIO = 0.078  # (645 / 492 - 1) / 4: docs/storage.md, On an H100, evaluation
# 8 H100s x 600 s x 0.85 of the step generating rollouts (4,080 GPU-s) over an 80 GPU-s drafter training
ROLLOUT_TO_TRAINING = 50.0
DRIFT = 0.03  # half of the task's contexts move within 23 steps (the demo's 0.15: within 4)
WARMUP = 4
STEPS = 8
RUN = "schedule"  # one run name in both data directories: the two warm-ups have one config


def _config(data_dir: Path, kind: str, draft_cost_ratio: float | None, drift: float | None, seed: int | None = None,
            tiny: bool = False):
    from benchmarks import tiny as smoke
    from pipeline.config import load_config

    small = {"simulation": smoke.SIMULATION, "train": smoke.TRAIN, "eval": smoke.EVAL} if tiny else {}
    overrides: dict = {"data_dir": str(data_dir), "run": RUN, "fleet": {"driver": "none"},
                       "train": {**small.get("train", {}), "schedule": {"kind": kind}},
                       "eval": {**small.get("eval", {}), "draft_cost_ratio": draft_cost_ratio or 0.0}}
    simulation = {**small.get("simulation", {}),
                  **{k: v for k, v in (("drift", drift), ("seed", seed)) if v is not None}}
    if simulation:
        overrides["simulation"] = simulation
    return load_config(overrides=overrides)


def _priced(decoding, factor: float):
    """The decoding cost with t `factor` times as dear (c and f as they are)."""
    from pipeline.accounting.cost import DecodingCost

    return DecodingCost(decoding.target_s_per_token * factor, decoding.draft_cost_ratio,
                        decoding.drafter_forwards_per_round)


def _cpu_decoding(store, run: str, step: int, cpu_share: float, rollout_scale: float):
    """The step's rollout tokens, and its timing with t in CPU-seconds (the wall-clock t the evaluation timed
    times the share of it the process ran, `cpu_share`) at the toy's own price; the step's cost record is
    rewritten with its rollouts priced `rollout_scale` times the toy's, before the next decision reads it:
    trainings count CPU-seconds here, and a loaded machine must not make the rollouts look dearer against them
    than they are."""
    from dataclasses import replace

    from pipeline.accounting.cost import read_cost
    from pipeline.data.keys import cost_key
    from pipeline.data.records import write_record

    cost = read_cost(store, run, step)
    if cost.decoding is None:  # no drafter served the step
        return cost.rollout_tokens, None
    own = _priced(cost.decoding, cpu_share)
    write_record(store, cost_key(run, step), replace(cost, decoding=_priced(own, rollout_scale)))
    return cost.rollout_tokens, own


def _run(kind: str, warmup: int, steps: int, data_dir: Path, draft_cost_ratio: float | None,
         rollout_scale: float | None, drift: float | None, seed: int | None = None,
         caches: tuple[Path, ...] = (), tiny: bool = False) -> dict:
    """W warm-up steps trained at every step, M steps by `kind`, one more served and measured, untrained.
    `rollout_scale` None: the records keep the toy's price (`interval` never reads them)."""
    from pipeline.data import buffer as buffer_lib
    from pipeline.data.store import open_store
    from pipeline.evaluation.acceptance import evaluate_step
    from pipeline.registry import open_registry
    from pipeline.sources import extract
    from pipeline.sources.simulation import SimulatedRL
    from pipeline.stages import EXTRACTION, TRAINING
    from pipeline.training.cotrain import train_step
    from pipeline.training.plan import read_history
    from pipeline.training.schedule import STALENESS_STEPS, aged_taus, measure_staleness

    began = time.perf_counter()
    warm, own = (_config(data_dir, k, draft_cost_ratio, drift, seed, tiny) for k in ("interval", kind))
    # the demo's pre-trained target, or the one the other run pre-trained: pre-training is not what is measured
    for cached in (*(() if tiny else (ROOT / ".data" / "cache",)), *caches):
        if cached.is_dir():
            shutil.copytree(cached, own.data_path / "cache", dirs_exist_ok=True)
    store, registry = open_store(own), open_registry(own)
    simulation = SimulatedRL(own.simulation, store, RUN, own.data_path / "cache")
    rows = []
    for step in range(1, warmup + steps + 2):
        phase = "warmup" if step <= warmup else "measured" if step <= warmup + steps else "last"
        cfg = warm if phase == "warmup" else own
        simulation.run_step(step)
        started = time.process_time()  # CPU-seconds, as the ledger counts a stage here: other processes' load
        extract.extract_hidden_states(store, cfg, step)  # on the shared machine does not count
        extraction_s = time.process_time() - started
        trained, reason, training_s, version = False, "the run's last step: a drafter trained on it serves no " \
                                                      "measured step", 0.0, None
        if phase != "last":
            buffer_lib.build_buffer(store, RUN, step, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)
            started = time.process_time()
            outcome = train_step(store, cfg, step, registry, {"benchmark": "schedule"})
            trained, reason, version = outcome.trained, outcome.reason, outcome.version
            training_s = time.process_time() - started if trained else 0.0
        started, wall = time.process_time(), time.perf_counter()
        record = evaluate_step(store, cfg, step, registry, version,
                               {EXTRACTION: extraction_s, TRAINING: training_s})
        cpu_share = min(1.0, (time.process_time() - started) / (time.perf_counter() - wall))
        tokens, decoding = _cpu_decoding(store, RUN, step, cpu_share, rollout_scale or 1.0)
        history = list(range(1, step + 1))
        staleness = measure_staleness(aged_taus(read_history(store, RUN, history), history[-STALENESS_STEPS:]))
        served, cotrained = record.served, record.cotrained
        rows.append({"step": step, "phase": phase, "trained": trained, "reason": reason,
                     "training_s": round(training_s, 2), "tau_served": round(served.tau, 3) if served else 1.0,
                     "version_served": served.version if served else None,
                     "version_trained": version if trained else None,
                     "tau_cotrained": round(cotrained.tau, 3) if cotrained else None,
                     "rollout_tokens": tokens,
                     "decoding": decoding.to_json() if decoding else None,  # the toy's price, CPU-seconds
                     "evaluation_cpu_share": round(cpu_share, 3),
                     "keep": round(staleness.keep, 3) if staleness else None,  # what the next decision reads
                     "tau_fresh": round(staleness.tau_fresh, 3) if staleness else None})
    result = {"steps": rows, "wall_s": round(time.perf_counter() - began, 1)}
    if kind == "interval":  # every step trained after the warm-up: one drafter of each age on the last trained step
        newest = warmup + steps
        result["age_profile"] = age_profile(store, own, registry, newest, {
            r["version_trained"]: newest - r["step"] for r in rows if r["version_trained"] and r["step"] >= warmup})
    return result


def age_profile(store, cfg, registry, step: int, ages: dict[str, int]) -> dict:
    """Each drafter of `ages` (version -> its age at `step`) decoding `step`'s held-out prompts: tau by age on one
    policy, what a drafter trained j steps earlier serves, and `keep` fitted to it with and without the drafter
    trained on the step itself. A served drafter is at least one step old: where the step after a drafter's own
    loses more than each later one, the staleness a skipped training lets in is the later steps' `keep`."""
    from pipeline.data import rollouts as rollouts_lib
    from pipeline.data.held_out import held_out_prompts
    from pipeline.evaluation import speculative
    from pipeline.models import target as target_lib
    from pipeline.ranks import SINGLE
    from pipeline.training.schedule import AgedTau, measure_staleness

    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    device = SINGLE.device(cfg.device, cfg.target.gpus_per_process)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, device, target_lib.load_settings(cfg))
    prompts = held_out_prompts(store, cfg, step, rollouts_lib.TargetLimits.of(target.config))
    taus = []
    for version, age in sorted(ages.items(), key=lambda item: item[1]):
        drafter = registry.load(version)
        drafter.attach(target)
        exact = speculative.evaluate(target, speculative.follow_target(drafter, target), prompts,
                                     cfg.eval.max_new_tokens, cfg.eval.num_speculative_tokens)
        taus.append(AgedTau(version, step, age, exact.tau))
    fitted = measure_staleness(taus)
    served = measure_staleness([t for t in taus if t.age >= 1])
    return {"step": step, "taus": [{"age": t.age, "version": t.version, "tau": round(t.tau, 3)} for t in taus],
            "keep": round(fitted.keep, 3) if fitted else None,
            "keep_from_age_1": round(served.keep, 3) if served else None}


def rollout_scale_for(rows: list[dict], rollout_to_training: float) -> float:
    """The factor on the toy's t that makes the median step's rollouts (tokens x t, CPU-seconds) cost
    `rollout_to_training` times the mean of the rows' trainings."""
    from pipeline.accounting.cost import DecodingCost

    trainings = [r["training_s"] for r in rows if r["trained"]]
    rollouts = [r["rollout_tokens"] * DecodingCost.from_json(r["decoding"]).target_s_per_token
                for r in rows if r["decoding"]]
    if not trainings or not rollouts:
        raise ValueError("a rollout scale needs a step that trained and a step that timed its served drafter")
    return rollout_to_training * statistics.mean(trainings) / statistics.median(rollouts)


def common_price(runs: list[list[dict]]):
    """One decoding price for both runs: the median t and c of every step's timing in either. Each run decides on
    its own timings, as the pipeline does, but t timed on a shared machine varies twofold between runs, and a
    saving compared at two prices would measure the machine's load rather than the schedule."""
    from pipeline.accounting.cost import DecodingCost

    timings = [DecodingCost.from_json(r["decoding"]) for rows in runs for r in rows if r["decoding"]]
    return DecodingCost(statistics.median(d.target_s_per_token for d in timings),
                        statistics.median(d.draft_cost_ratio for d in timings), timings[-1].drafter_forwards_per_round)


@dataclass(frozen=True)
class Window:
    """Which steps' trainings and which steps' savings a total counts: a drafter trained on step s serves s + 1."""

    first_training: int
    last_training: int

    def totals(self, rows: list[dict], price) -> dict:
        """Training seconds of the window's decisions, and the rollout seconds saved on the steps their drafters
        served (each a step later), at `price`; net: saved less training."""
        trainings = [r for r in rows if self.first_training <= r["step"] <= self.last_training]
        served = [r for r in rows if self.first_training < r["step"] <= self.last_training + 1]
        training_s = sum(r["training_s"] for r in trainings)
        saved_s = sum(price.saved_seconds(r["tau_served"], r["rollout_tokens"]) for r in served if r["decoding"])
        trained = [r["step"] for r in trainings if r["trained"]]
        return {"trained_steps": trained, "trainings": len(trained), "training_s": round(training_s, 2),
                "saved_s": round(saved_s, 2), "net_s": round(saved_s - training_s, 2)}


def ratios(interval: dict, cost: dict) -> dict:
    """cost over interval: trainings, training seconds, and saved seconds where interval's saving is positive.
    The trainings' ratio is the decisions' alone: identical trainings count different CPU-seconds on a machine
    whose other work contends for its caches and memory bandwidth."""
    return {"trainings_ratio": round(cost["trainings"] / interval["trainings"], 3) if interval["trainings"] else None,
            "training_s_ratio": round(cost["training_s"] / interval["training_s"], 3) if interval["training_s"]
            else None,
            "saved_s_ratio": round(cost["saved_s"] / interval["saved_s"], 3) if interval["saved_s"] > 0 else None,
            "net_s_vs_interval": round(cost["net_s"] - interval["net_s"], 2)}


def goal_met(figures: dict) -> bool:
    return bool(figures["training_s_ratio"] is not None and figures["saved_s_ratio"] is not None
                and figures["training_s_ratio"] <= 0.6 and figures["saved_s_ratio"] >= 0.95)


def warmups_identical(interval: list[dict], cost: list[dict]) -> bool:
    """Whether both runs' warm-ups trained, served and co-trained the same versions at the same taus."""
    def seen(rows: list[dict]) -> list[tuple]:
        return [(r["trained"], r["version_served"], r["tau_served"], r["tau_cotrained"])
                for r in rows if r["phase"] == "warmup"]
    return seen(interval) == seen(cost)


def replay(keep: float, tau_fresh: float, rollout_to_training: float, draft_cost_ratio: float, forwards: int,
           steps: int = 40) -> dict:
    """Both schedules on the staleness model `cost` decides with (the same functions): a drafter trained at step
    j serves step s at fresh(s - j); a step's rollouts take `rollout_to_training` trainings' seconds."""
    from pipeline.accounting.cost import DecodingCost
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


def run(warmup: int = WARMUP, steps: int = STEPS, price: str = "h100",
        rollout_to_training: float = ROLLOUT_TO_TRAINING, rollout_scale: float | None = None,
        drift: float | None = DRIFT, seed: int | None = None, tiny: bool = False) -> dict:
    if tiny:
        warmup, steps = 1, 1
    if warmup < 1 or steps < 1:
        raise ValueError(f"a comparison needs a warm-up and measured steps, got --warmup {warmup} --steps {steps}")
    draft_cost_ratio = H100_DRAFT_COST_RATIO if price == "h100" else None
    report: dict = {"warmup": warmup, "steps": steps, "price": price, "draft_cost_ratio": draft_cost_ratio,
                    "drift": drift, "seed": seed}
    began = time.perf_counter()
    measured, whole = Window(warmup + 1, warmup + steps), Window(1, warmup + steps)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            report[kind] = _run(kind, warmup, steps, Path(tmp) / kind, draft_cost_ratio, rollout_scale, drift, seed,
                                tuple(Path(tmp) / other / "cache" for other in KINDS if other != kind), tiny)
            if rollout_scale is None:  # from `interval`'s steady state, before `cost` decides on anything
                rollout_scale = rollout_scale_for(
                    [r for r in report[kind]["steps"] if r["phase"] == "measured"], rollout_to_training)
    report["rollout_scale"] = round(rollout_scale, 2)
    toy = common_price([report[kind]["steps"] for kind in KINDS])
    priced = _priced(toy, rollout_scale)
    report["common_price"] = priced.to_json()
    interval_rows = [r for r in report["interval"]["steps"] if r["phase"] == "measured"]
    report["rollout_s_per_training_s"] = round(
        statistics.median(r["rollout_tokens"] for r in interval_rows) * priced.target_s_per_token
        / statistics.mean(r["training_s"] for r in interval_rows if r["trained"]), 1)
    for kind in KINDS:
        rows = report[kind]["steps"]
        report[kind]["measured"], report[kind]["whole_run"] = measured.totals(rows, priced), whole.totals(rows, priced)
        saved, cumulative = 0.0, []
        for r in rows:
            saved += priced.saved_seconds(r["tau_served"], r["rollout_tokens"]) if r["decoding"] else 0.0
            cumulative.append(round(saved, 2))
        report[kind]["cumulative_saved_s"] = cumulative
        report[kind]["keep_measured"] = [r["keep"] for r in rows if r["phase"] != "warmup"]
    report["warmup_identical"] = warmups_identical(report["interval"]["steps"], report["cost"]["steps"])
    report["measured"] = ratios(report["interval"]["measured"], report["cost"]["measured"])
    report["whole_run"] = ratios(report["interval"]["whole_run"], report["cost"]["whole_run"])
    report["goal"] = "cost: training_s_ratio <= 0.6 at saved_s_ratio >= 0.95, over the steps after the warm-up"
    report["goal_met"] = goal_met(report["measured"])
    report["training_s_ratio"], report["saved_s_ratio"] = (report["measured"]["training_s_ratio"],
                                                           report["measured"]["saved_s_ratio"])
    cotrained = [r["tau_cotrained"] for r in report["interval"]["steps"] if r["trained"] and r["tau_cotrained"]]
    tau_fresh = sum(cotrained) / len(cotrained)
    keeps = [k for k in report["cost"]["keep_measured"] if k is not None]
    if keeps:
        report["model"] = replay(statistics.median(keeps), tau_fresh, report["rollout_s_per_training_s"],
                                 priced.draft_cost_ratio, priced.drafter_forwards_per_round)
    report["age_profile"] = profile = report["interval"].pop("age_profile")
    if profile["keep_from_age_1"] is not None:  # the rule's model at the staleness of drafters as they serve
        report["model_from_age_1"] = replay(profile["keep_from_age_1"], tau_fresh, report["rollout_s_per_training_s"],
                                            priced.draft_cost_ratio, priced.drafter_forwards_per_round)
    report["regimes"] = {"tau_fresh": round(tau_fresh, 3), "draft_cost_ratio": H100_DRAFT_COST_RATIO, "rows": [
        replay(keep, tau_fresh, ratio, H100_DRAFT_COST_RATIO, 4)
        for keep in (0.5, 0.7, 0.85, 0.95) for ratio in (1.0, 3.0, 10.0, 30.0, 50.0, 100.0)]}
    report["wall_s"] = round(time.perf_counter() - began, 1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=WARMUP, help="W: steps both runs train at every step first")
    parser.add_argument("--steps", type=int, default=STEPS, help="M: steps each run decides by its own schedule")
    parser.add_argument("--price", choices=["h100", "measured"], default="h100")
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--rollout-to-training", type=float, default=ROLLOUT_TO_TRAINING,
                       help="a step's rollout seconds over a training's, as `interval` measures them after the warm-up")
    scale.add_argument("--rollout-scale", type=float, help="price a step's rollouts at X times the toy's instead")
    parser.add_argument("--drift", type=float, default=DRIFT, help="simulation.drift")
    parser.add_argument("--seed", type=int, help="simulation.seed: another task, policy and rollouts")
    parser.add_argument("--tiny", action="store_true", help="the smoke run's sizes (seconds)")
    args = parser.parse_args()
    sys.stdout.write(json.dumps(run(args.warmup, args.steps, args.price, args.rollout_to_training, args.rollout_scale,
                                    args.drift, args.seed, args.tiny), indent=2) + "\n")


if __name__ == "__main__":
    main()
