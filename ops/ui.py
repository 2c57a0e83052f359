"""`cli.py ui`: the Dagster webserver and daemon and the MLflow UI, on the demo's data or on the production stack
run locally."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ops.console import out
from ops.instance import prepare_dagster_home, prepare_instance
from pipeline.config import CONFIG_ENV, PROJECT_ROOT, load_config


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

    from ops.database import DatabaseError, PostgresTarget, check_database
    from ops.local_stack import postgres_stack

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
    procs = [subprocess.Popen(c, cwd=PROJECT_ROOT, env=env) for c in commands]
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
