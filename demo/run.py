"""`cli.py demo` and `cli.py compare-schedules`: a source of RL steps publishing at its own pace, and the pipeline
picking its steps up as the daemon would, each step a run of the persisted Dagster instance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from demo.daemon import PIPELINE_TICK_S, RefreshProcess, SensorTicks, pipeline_tick, prestart_workers
from demo.report import demo_report, step_line
from ops.console import out, quiet_libraries
from ops.instance import prepare_dagster_home, prepare_instance
from pipeline.config import PROJECT_ROOT, PipelineConfig, load_config
from pipeline.stages import EVALUATION, EXTRACTION, TRAINING

if TYPE_CHECKING:
    import dagster as dg
    from tqdm import tqdm

    from pipeline.accounting.report import StepRow
    from pipeline.data.store import ObjectStore
    from pipeline.registry import DrafterRegistry
    from pipeline.serving.rollouts import FleetRollouts
    from pipeline.sources.pacing import PacedSource, Published

GRPO_SOURCES = ("trl", "smollm2")  # sources that are TRL's GRPOTrainer, held one published step at a time


def _serve_first_drafter(cfg: PipelineConfig, store: ObjectStore, registry: DrafterRegistry,
                         fleet: FleetRollouts, rl: object, ticks: SensorTicks) -> str:
    """`drafter.warm_start` registered as the run's first version (`register_warm_start`) and deployed before step 1:
    the fleet starts on the step-0 policy, then the version goes out as any champion's deploy does (staged, checked,
    canaries on the source's held-out prompts: no step is committed yet to take them from)."""
    from jobs.sensors import champion_sensor
    from pipeline.data.keys import fleet_prefix
    from pipeline.models import target as target_lib
    from pipeline.registry import register_warm_start
    from pipeline.serving import deploy

    version = register_warm_start(registry, cfg)
    policy = target_lib.save_checkpoint(rl.pretrained(), store, f"{fleet_prefix(cfg.run)}/policies/step-000000",
                                        rl.trainer.processing_class)
    fleet.push_policy(0, policy)
    deploy.deploy(cfg, store, registry, version,
                  serving=lambda: deploy.ServedPolicy(0, store.resolve(policy), rl.canary_prompts()))
    ticks.cursors[champion_sensor.name] = version  # deployed: the champion sensor's next tick has nothing to do
    return version


def _smollm2_source(cfg: PipelineConfig, store: ObjectStore, steps: int, engine: object):  # noqa: ANN202
    """TRL's GRPO on SmolLM2-135M-Instruct, 2 prompts x 8 answers of at most 96 tokens a step (docs/real_model.md);
    the converted checkpoint and the first drafter (`drafter.warm_start`) must be there."""
    from pipeline.sources import smollm2
    from pipeline.sources.arithmetic_grpo import ArithmeticGRPODemo, GRPOSettings

    try:
        checkpoint = smollm2.prepare(cfg.data_path)
    except smollm2.WheelMissingError as exc:
        raise SystemExit(f"demo --source smollm2: {exc}") from None
    warm_start = PROJECT_ROOT / cfg.drafter.warm_start  # an absolute path stays itself
    if not cfg.drafter.warm_start:
        raise SystemExit("demo --source smollm2: drafter.warm_start names no first drafter")
    if not warm_start.is_dir():
        from recipes.first_drafter import FirstDrafterError, ensure_first_drafter

        out(f"no first drafter at {warm_start}: training one, once (recipes/first_drafter.py: answers sampled by "
            "vLLM, their features, 7 minutes of training; about 20 minutes on 2 cores)")
        try:
            ensure_first_drafter(cfg.data_path, warm_start)
        except FirstDrafterError as exc:
            raise SystemExit(f"demo --source smollm2: {exc}") from None
    settings = GRPOSettings(prompts_per_step=2, num_generations=8, max_completion_length=96, learning_rate=2e-5)
    return ArithmeticGRPODemo(checkpoint, store, cfg.run, steps, cfg.data_path / "demo" / "grpo", settings, engine)


def fresh_demo(config_path: str | None, overrides: dict | None) -> PipelineConfig:
    """The demo's config, its data directories emptied (the pre-trained target cache stays)."""
    cfg = load_config(config_path, overrides)
    if cfg.rollout_source != "simulated":
        raise SystemExit("demo needs rollout_source: simulated (an external trainer drives its own steps)")
    # stages: a warm worker left by an earlier demo holds its deleted MLflow database open; this demo starts its own
    for sub in ("store", "mlflow", "dagster", "demo", "stages"):
        shutil.rmtree(cfg.data_path / sub, ignore_errors=True)
    prepare_dagster_home(cfg)
    quiet_libraries()
    return cfg


@dataclass(frozen=True)
class _Source:
    """The demo's source of RL steps, and how the demo speaks of it."""

    rl: object  # SimulatedRL, GRPODemo or ArithmeticGRPODemo
    kind: str  # the header's "<steps> <kind> steps"
    what: str  # the progress bar's note while the steps run
    ready: str  # what the header says is ready once its pre-trained model has loaded


@dataclass(frozen=True)
class _Demo:
    """What the demo's phases share: the config, the pipeline's instance and stores, the rollout fleet."""

    cfg: PipelineConfig
    steps: int
    source: str  # --source: simulated, trl or smollm2
    instance: dg.DagsterInstance
    ticks: SensorTicks
    store: ObjectStore
    registry: DrafterRegistry
    rollout_fleet: FleetRollouts | None  # None: no fleet (fleet.driver none)

    @property
    def with_fleet(self) -> bool:
        return self.rollout_fleet is not None


@dataclass
class _Finished:
    """The steps the pipeline has finished, in order, and each one's wall time from publication to acceptance."""

    rows: list[StepRow] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)


def _one_torch_thread() -> None:
    """One torch thread per process, inherited by every process the demo starts: on a small machine the
    source, the stages' workers, the refresh and the stand-ins run side by side, and OpenMP's spinning
    threads, one per core in each, made a 2-core demo's steps 4-7x slower than its CPU work."""
    for threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(threads, "1")


def _open_pipeline(cfg: PipelineConfig, config_path: str | None, overrides: dict | None, steps: int,
                   source: str) -> _Demo:
    """The persisted Dagster instance and its sensors, the store, the registry and the rollout fleet; the stages'
    warm workers start now, while the source runs its first step, so that no step waits for their imports."""
    import dagster as dg

    from definitions import build_definitions
    from pipeline.data.store import open_store
    from pipeline.registry import open_registry
    from pipeline.serving import deploy

    instance = dg.DagsterInstance.get()
    ticks = SensorTicks(instance, build_definitions(config_path, overrides))
    store, registry = open_store(cfg), open_registry(cfg)
    prestart_workers(config_path, overrides, [EXTRACTION, TRAINING, EVALUATION])
    # With a fleet, the fleet generates the rollouts: each step's policy is pushed to every replica first.
    rollout_fleet = deploy.rollout_fleet(cfg, store) if cfg.fleet.driver != "none" else None
    return _Demo(cfg, steps, source, instance, ticks, store, registry, rollout_fleet)


def _rl_source(demo: _Demo) -> _Source:
    """The source `--source` names, its rollouts decoded by the fleet when there is one."""
    cfg, store, steps = demo.cfg, demo.store, demo.steps
    engine = demo.rollout_fleet.engine() if demo.rollout_fleet else None
    if demo.source == "trl":  # real GRPO with TRL publishing through the trainer client
        from pipeline.sources.trl import GRPODemo

        return _Source(GRPODemo(store, cfg.run, steps, cfg.data_path / "demo" / "trl", engine=engine),
                       "TRL GRPO", "a TRL GRPO step and its rollouts", "TRL trainer and policy")
    if demo.source == "smollm2":  # the real model: TRL's GRPO on SmolLM2-135M-Instruct, arithmetic rewards
        return _Source(_smollm2_source(cfg, store, steps, engine),
                       "SmolLM2 GRPO", "a GRPO step of SmolLM2 and its rollouts", "SmolLM2 trainer and policy")
    from pipeline.sources.simulation import SimulatedRL

    return _Source(SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache", engine),
                   "simulated RL", "simulating the RL update and rollouts", "pre-trained target")


def _announce(demo: _Demo, source: _Source) -> None:
    cfg = demo.cfg
    out(f"Co-training demo: {demo.steps} {source.kind} steps on {cfg.device}, drafter kind {cfg.drafter.kind}")
    out(f"  object store {cfg.storage_root}")
    out(f"  MLflow       {cfg.tracking_uri}")
    out(f"  Dagster home {demo.instance.root_directory}")


def _load_pretrained(source: _Source) -> None:
    tick = time.perf_counter()
    source.rl.pretrained()  # cached after the first demo
    out(f"  {source.ready} ready in {time.perf_counter() - tick:.1f}s")


def _stop_replicas(cfg: PipelineConfig) -> None:
    from pipeline.serving import deploy

    deploy.make_driver(cfg).stop_all(deploy.replicas(cfg))


def _prepare_fleet(demo: _Demo, rl: object) -> None:
    """The fleet's line of the header; with the SmolLM2 source, the first drafter (drafter.warm_start) served from
    step 1 on."""
    cfg = demo.cfg
    if not demo.with_fleet:
        return
    out(f"  fleet: {len(cfg.fleet.replicas)} {cfg.fleet.driver} replicas "
        f"({'local CPU stand-ins, not vLLM' if cfg.fleet.driver == 'standin' else cfg.fleet.driver})")
    if demo.source != "smollm2":
        return
    tick = time.perf_counter()
    try:
        version = _serve_first_drafter(cfg, demo.store, demo.registry, demo.rollout_fleet, rl, demo.ticks)
    except BaseException:
        _stop_replicas(cfg)  # the replicas it started end with it
        raise
    out(f"  first drafter ({cfg.drafter.warm_start}) registered as version {version} (baseline, champion), "
        f"served by the fleet in {time.perf_counter() - tick:.1f}s")


def _publish_steps(demo: _Demo, rl: object) -> PacedSource:
    """The source publishing at its own pace in a background thread, never waiting for the pipeline: the pipeline
    picks committed steps up through its sensor, as it would an external trainer's."""
    from pipeline.sources.pacing import PacedSource

    steps, period = demo.steps, demo.cfg.simulation.step_period_s
    # Parts over the period's rollout share; the simulated source computes the next step's update while they decode.
    run_step = (lambda step: rl.run_step(step, period)) if demo.source in GRPO_SOURCES else \
        (lambda step: rl.run_step(step, period, prepare_next=step < steps))
    return PacedSource(run_step, steps, period).start()


def _start_refreshes(demo: _Demo, config_path: str | None, overrides: dict | None) -> RefreshProcess | None:
    """The refresh sensor and its runs, as the daemon runs them beside steps; None without a refresh or a fleet."""
    if not (demo.cfg.refresh.enabled and demo.with_fleet):
        return None
    prepare_instance(demo.instance)  # the storage's tables and pools, from this process first
    return RefreshProcess(config_path, overrides, demo.cfg.data_path / "demo" / "refresh.log")


def _step_row(demo: _Demo, published: Published) -> StepRow:
    """A step's row once its acceptance record is written: the version the fleet runs, the trainer's mean reward."""
    from pipeline.accounting import report

    return replace(report.step_row(demo.store, demo.cfg.run, published.step),
                   deployed_version=demo.registry.alias_version("live") if demo.with_fleet else None,
                   trl_mean_reward=round(published.result.mean_reward, 4) if demo.source in GRPO_SOURCES else None)


def _follow_steps(demo: _Demo, paced: PacedSource, refreshes: RefreshProcess | None, bar: tqdm) -> _Finished:
    """The pipeline's sensors ticked until every step is accepted, each one a line under the progress bar."""
    from pipeline.data.keys import acceptance_key

    done = _Finished()
    while len(done.rows) < demo.steps:
        paced.raise_if_failed()
        if refreshes:
            refreshes.raise_if_failed()
        ran = pipeline_tick(demo.ticks, demo.with_fleet and refreshes is None, bar.set_postfix_str)
        for published in paced.published()[len(done.rows):]:
            if not demo.store.exists(acceptance_key(demo.cfg.run, published.step)):
                break
            done.walls.append(time.time() - published.at)
            done.rows.append(_step_row(demo, published))
            bar.update(1)
            bar.write(step_line(done.rows[-1], done.walls[-1]))
        if not ran:
            time.sleep(PIPELINE_TICK_S)  # nothing new committed: wait for the source
    return done


def _wind_down(demo: _Demo, paced: PacedSource, refreshes: RefreshProcess | None, rl: object) -> None:
    """Every step accepted: the source stopped, the last step's drafter on the fleet, the trainer's last step taken."""
    paced.stop()
    if refreshes:
        refreshes.wait_for_champion(demo.store, demo.cfg.run, demo.registry)
    if demo.source in GRPO_SOURCES:
        rl.finish()  # TRL's last optimizer step


def _final_rows(demo: _Demo, rows: list[StepRow], rl: object) -> list[StepRow]:
    """The rows with the SmolLM2 trainer's phases, and the refreshes that reached the fleet after their step's
    row was taken (the first step's, by a cold start)."""
    from pipeline.accounting import report

    if demo.source == "smollm2":
        rows = [replace(r, phases=p.to_json()) for r, p in zip(rows, rl.phases(), strict=True)]
    return [replace(r, **report.tail_fields(demo.store, demo.cfg.run, r.step)) for r in rows]


def _stop(demo: _Demo, paced: PacedSource, refreshes: RefreshProcess | None) -> None:
    """The source, the refresh and the demo's local replicas end with the demo, however it ends."""
    paced.stop(timeout=0)
    if refreshes:
        refreshes.stop()
    if demo.with_fleet and demo.cfg.fleet.driver in ("standin", "vllm"):
        _stop_replicas(demo.cfg)


def run_demo(steps: int, config_path: str | None, drafter: str | None = None, source: str = "simulated",
             overrides: dict | None = None) -> Path:
    from tqdm import tqdm

    from pipeline.data.fleet_state import read_fleet_state

    overrides = {**(overrides or {}), **({"drafter": {"kind": drafter}} if drafter else {})} or None
    _one_torch_thread()
    cfg = fresh_demo(config_path, overrides)
    demo = _open_pipeline(cfg, config_path, overrides, steps, source)
    rl_source = _rl_source(demo)
    rl = rl_source.rl
    _announce(demo, rl_source)
    start = time.perf_counter()
    _load_pretrained(rl_source)
    _prepare_fleet(demo, rl)
    paced = _publish_steps(demo, rl)
    refreshes = _start_refreshes(demo, config_path, overrides)
    bar = tqdm(total=steps, desc="RL steps", unit="step", file=sys.stdout, dynamic_ncols=True)
    bar.set_postfix_str(rl_source.what)
    try:
        done = _follow_steps(demo, paced, refreshes, bar)
        _wind_down(demo, paced, refreshes, rl)
        fleet_state = read_fleet_state(demo.store, cfg.run).replicas if demo.with_fleet else ()
        rows = _final_rows(demo, done.rows, rl)
    finally:
        _stop(demo, paced, refreshes)
    bar.close()
    return demo_report(cfg, rows, time.perf_counter() - start, done.walls, fleet_state, source,
                       [w.to_json() for w in demo.rollout_fleet.windows.values()] if demo.rollout_fleet else None)


def compare_schedules(steps: int, config_path: str | None, source: str, kinds: list[str],
                      draft_cost_ratio: float, fleet: bool = True) -> Path:
    """The demo's pipeline once per training schedule, one after the other on the same source, then side by side:
    per step whether it trained, the training's seconds, the served tau and the cumulative saved rollout time.
    Each run decides on its own timings; the savings side by side are at one price, the median of both runs'
    timings (`report.common_price`). Each run is a demo process of its own on a data directory of its own,
    .data/schedules/<kind>/ (the demo's output in its demo/, its store, MLflow, Dagster instance and warm stage
    workers beside it): a run never meets the state of the one before it, not an MLflow connection to a deleted
    database in a warm worker, not a champion of the other registry. Without `fleet` no replica (and no refresh)
    runs: the champion serves, as the fleet would a step later."""
    from pipeline.accounting import report
    from pipeline.data.store import open_store

    runs: dict[str, list[report.ScheduleStep]] = {}
    base = load_config(config_path)
    out_dir = base.data_path / "schedules"
    shutil.rmtree(out_dir, ignore_errors=True)
    walls: dict[str, float] = {}
    for kind in kinds:
        overrides = {"data_dir": str(out_dir / kind), "train": {"schedule": {"kind": kind}},
                     "eval": {"draft_cost_ratio": draft_cost_ratio}, **({} if fleet else {"fleet": {"driver": "none"}})}
        cfg = load_config(config_path, overrides)
        if (base.data_path / "cache").is_dir():  # the pre-trained target: built once, shared by the runs
            shutil.copytree(base.data_path / "cache", cfg.data_path / "cache")
        out(f"== train.schedule.kind = {kind} ==")
        started = time.perf_counter()
        subprocess.run([sys.executable, str(PROJECT_ROOT / "cli.py"),
                        *(["--config", config_path] if config_path else []), "demo", "--steps", str(steps),
                        "--source", source, "--overrides", json.dumps(overrides)], check=True)
        walls[kind] = round(time.perf_counter() - started, 1)
        runs[kind] = report.schedule_steps(open_store(cfg), cfg.run, list(range(1, steps + 1)))
        out()
    price = report.common_price(runs)
    if price is not None:
        runs = {kind: report.at_price(rows, price) for kind, rows in runs.items()}
    priced = ("no drafter served a step" if price is None else
              f"t {price.target_s_per_token * 1e3:.3f} ms per token, c {price.draft_cost_ratio:.3f} "
              f"({'eval.draft_cost_ratio' if draft_cost_ratio else 'as timed'}), a round {price.round_cost:.2f} "
              f"target forwards")
    out(f"Training schedules side by side ({source} source, {steps} steps; savings at one price, the median of "
        f"both runs' timings: {priced}):")
    out(report.format_schedules(runs))
    totals = {kind: report.schedule_totals(rows) for kind, rows in runs.items()}
    figures: dict = {"source": source, "steps": steps, "fleet": fleet, "draft_cost_ratio": draft_cost_ratio,
                     "common_price": price.to_json() if price else None, "wall_s": walls,
                     "runs": {kind: [{**asdict(r), "decoding": r.decoding.to_json() if r.decoding else None}
                                     for r in rows] for kind, rows in runs.items()},
                     "totals": {kind: asdict(t) for kind, t in totals.items()}}
    if "interval" in totals and "cost" in totals:
        base, cost = totals["interval"], totals["cost"]
        figures["training_s_ratio"] = round(cost.training_s / base.training_s, 3) if base.training_s else None
        figures["saved_s_ratio"] = round(cost.saved_s / base.saved_s, 3) if base.saved_s > 0 else None
        figures["goal"] = "cost: training_s_ratio <= 0.6 at saved_s_ratio >= 0.95"
        figures["goal_met"] = bool(figures["training_s_ratio"] is not None and figures["saved_s_ratio"] is not None
                                   and figures["training_s_ratio"] <= 0.6 and figures["saved_s_ratio"] >= 0.95)
        out(f"cost / interval: training seconds {figures['training_s_ratio']}, saved rollout time "
            f"{figures['saved_s_ratio'] if figures['saved_s_ratio'] is not None else '- (interval saved none)'}"
            f" (goal: <= 0.6 at >= 0.95: {'met' if figures['goal_met'] else 'not met'})")
    plot = out_dir / "schedules.png"
    plot.write_bytes(report.schedules_png(runs))
    summary = out_dir / "schedules.json"
    summary.write_text(json.dumps(figures, indent=2) + "\n")
    out(f"plot:    {plot}")
    out(f"summary: {summary}")
    return summary
