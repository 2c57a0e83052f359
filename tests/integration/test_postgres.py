"""The production stack, run: Dagster on PostgreSQL (the instance settings of deploy/dagster.yaml, less the
Kubernetes run launcher), MLflow on PostgreSQL with its artifacts on S3 (moto's server on loopback), and
the object store on that S3 too. One throwaway PostgreSQL server (tests/support/postgres.py) holds both
the Dagster and the MLflow database; a real `dagster-daemon` ticks the sensors and executes the runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
import s3fs

from ops.local_stack import PostgresServer, write_dagster_home
from pipeline.config import PipelineConfig, load_config
from pipeline.data.keys import step_key
from pipeline.data.store import open_store
from pipeline.registry import DrafterRegistry
from pipeline.sources.simulation import SimulatedRL
from tests.integration.test_s3 import BUCKET, s3_endpoint  # noqa: F401  (the moto server fixture)
from tests.integration.test_ui import DEQUEUE_EVERY_SECOND, _processes_of, browser_page, check_mlflow_ui
from tests.support.config import write_config
from tests.support.mlflow_server import mlflow_server
from tests.support.registered import register_champion

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 900  # a loaded 2-core machine: a run takes 1-3 minutes there


@dataclass
class Stack:
    """The platform team's stack on loopback: where each part is and the pipeline config that uses it."""

    pg: PostgresServer
    home: Path  # DAGSTER_HOME: deploy/dagster.yaml less the k8s launcher
    config: Path
    cfg: PipelineConfig
    mlflow: str
    s3: str
    dagster_db: str
    mlflow_db: str

    def env(self) -> dict[str, str]:
        """A Dagster process's environment: the connection settings and secrets, nothing in a file."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "MLFLOW_UI"))}
        env.update(self.pg.dagster_env(self.dagster_db), DAGSTER_HOME=str(self.home),
                   DRAFTER_PIPELINE_CONFIG=str(self.config), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
                   MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false", DAGSTER_GRPC_TIMEOUT_SECONDS="180")
        return env

    @contextlib.contextmanager
    def instance(self) -> Iterator[dg.DagsterInstance]:
        with _environ(self.pg.dagster_env(self.dagster_db)), dg.DagsterInstance.from_config(str(self.home)) as inst:
            yield inst

    def registry(self) -> DrafterRegistry:
        return DrafterRegistry(self.mlflow, self.cfg.mlflow.experiment, self.cfg.mlflow.model_name)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def stack(postgres: PostgresServer, s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("pg-stack")
    tag = uuid.uuid4().hex[:6]
    dagster_db, mlflow_db = postgres.create_database(f"dagster_{tag}"), postgres.create_database(f"mlflow_{tag}")
    # As in production: the backend store URI carries no password; the driver reads PGPASSWORD.
    server_env = {"PGPASSWORD": postgres.password, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint}
    with mlflow_server(postgres.backend_store_uri(mlflow_db), f"s3://{BUCKET}/mlflow-{tag}", tmp / "mlflow.log",
                       server_env) as url:
        config = write_config(tmp, {
            "storage": {"root": f"s3://{BUCKET}/store-{tag}", "endpoint_url": s3_endpoint},
            "mlflow": {"tracking_uri": url, "experiment": "pg-stack", "model_name": "pg-drafter"},
            "fleet": {"driver": "none"},
            # Of the three steps the daemon test runs, step 3 trains (a drafter process is minutes of CPU here).
            "train": {"training_interval_steps": 3},
        })
        home = write_dagster_home(tmp / "dagster", postgres.port)
        with (home / "dagster.yaml").open("a") as f:  # the run queue looked at every second (Dagster's default: 5 s)
            f.write(DEQUEUE_EVERY_SECOND)
        yield Stack(postgres, home, config, load_config(config), url, s3_endpoint, dagster_db, mlflow_db)


@contextlib.contextmanager
def _daemon(stack: Stack, log: Path) -> Iterator[subprocess.Popen]:
    """`dagster-daemon run` on the project's workspace.yaml: sensors, backfills, the run queue, monitoring."""
    argv = [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=stack.env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _processes_of(stack.home):  # a code server or run worker outside its process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait_for_runs(instance: dg.DagsterInstance, filters: dg.RunsFilter, count: int, log: Path,
                   finished: bool = True) -> list[dg.DagsterRun]:
    """`count` runs of `filters`, once they are finished (or, with `finished` False, as soon as they exist)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        runs = instance.get_runs(filters)
        if len(runs) >= count and (not finished or all(r.is_finished for r in runs)):
            return sorted(runs, key=lambda r: r.tags.get("dagster/partition", ""))
        time.sleep(1)
    raise AssertionError(f"{count} runs not {'finished' if finished else 'requested'} in {RUN_TIMEOUT_S}s: "
                         f"{instance.get_runs(filters)}\n{log.read_text()[-3000:]}")


def _stop_sensor(instance: dg.DagsterInstance, name: str) -> None:
    """What an operator's "stop" on the sensor does: its stored state (kept by the daemon) set to STOPPED.

    The daemon reads a sensor's state, then writes it back as it starts a tick, so a stop written in between
    is overwritten and the sensor goes on. This writes the stop, waits for any tick under way to finish, and
    writes it again until it holds."""
    from dagster._core.scheduler.instigation import InstigatorStatus, InstigatorType, TickStatus

    def state():
        [found] = [s for s in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR) if s.name == name]
        return found

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        instance.update_instigator_state(state().with_status(InstigatorStatus.STOPPED))
        time.sleep(3)  # longer than the daemon's read-then-write of the state
        current = state()
        ticks = instance.get_ticks(current.instigator_origin_id, current.selector_id, limit=1)
        if current.status == InstigatorStatus.STOPPED and not (ticks and ticks[0].status == TickStatus.STARTED):
            return
    raise AssertionError(f"{name} not stopped, or a tick of it still under way, after 180 s")


def _submit_backfill(instance: dg.DagsterInstance, keys: list[str]) -> str:
    """A backfill of rl_step_job over `keys`, as `dagster job backfill` or the UI submits it."""
    from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
    from dagster._core.remote_origin import RemotePartitionSetOrigin
    from dagster._core.scheduler.instigation import InstigatorType
    from dagster._time import get_current_timestamp

    from jobs.sensors import SENSOR_NAME

    [sensor] = [s for s in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
                if s.name == SENSOR_NAME]
    backfill_id = f"pg{uuid.uuid4().hex[:6]}"
    instance.add_backfill(PartitionBackfill(
        backfill_id=backfill_id, status=BulkActionStatus.REQUESTED, from_failure=False, tags={},
        backfill_timestamp=get_current_timestamp(), partition_names=keys, reexecution_steps=None,
        partition_set_origin=RemotePartitionSetOrigin(repository_origin=sensor.origin.repository_origin,
                                                      partition_set_name="rl_step_job_partition_set"),
    ))
    return backfill_id


def _rows(stack: Stack, sql: str) -> list[tuple]:
    return stack.pg.query(stack.dagster_db, sql)


@pytest.mark.slow
@pytest.mark.reliability("security", "PostgreSQL password: in no log, Dagster event or run, MLflow param or tag")
def test_sensor_step_and_a_backfill_through_a_real_daemon(stack: Stack) -> None:
    from dagster._core.storage.tags import RUN_KEY_TAG

    from jobs.sensors import SENSOR_NAME

    cfg = stack.cfg
    simulator = SimulatedRL(cfg.simulation, open_store(cfg), cfg.run, cfg.data_path / "cache")
    simulator.run_step(1)
    log = stack.home / "daemon.log"
    backfill_keys = [step_key(s) for s in (2, 3)]
    with _daemon(stack, log), stack.instance() as instance:
        # The sensor's tick adds the partition and requests the run; the queue dequeues it; a run worker executes it.
        sensed_runs = dg.RunsFilter(tags={"dagster/sensor_name": SENSOR_NAME})
        _wait_for_runs(instance, sensed_runs, 1, log, finished=False)

        # While it runs, an operator pauses intake, the trainer commits two steps, and they are backfilled.
        _stop_sensor(instance, SENSOR_NAME)
        for step in (2, 3):
            simulator.run_step(step)
        instance.add_dynamic_partitions("rl_step", backfill_keys)
        backfill_id = _submit_backfill(instance, backfill_keys)
        [sensed] = _wait_for_runs(instance, sensed_runs, 1, log)
        assert sensed.status == dg.DagsterRunStatus.SUCCESS, log.read_text()[-3000:]
        assert sensed.tags[RUN_KEY_TAG] == "step-000001"
        runs = _wait_for_runs(instance, dg.RunsFilter(tags={"dagster/backfill": backfill_id}), 2, log)
        assert [r.status for r in runs] == [dg.DagsterRunStatus.SUCCESS] * 2, log.read_text()[-3000:]
        assert [r.tags["dagster/partition"] for r in runs] == backfill_keys
        # Production's run queue (one run with a dagster/partition tag at a time): the steps ran one after another,
        # the sensor's first.
        stats = [instance.get_run_stats(r.run_id) for r in (sensed, *runs)]
        for earlier, later in zip(stats, stats[1:], strict=False):
            assert earlier.end_time <= later.start_time
        every_run = instance.get_runs()
        assert len(every_run) == 3, [(r.tags.get("dagster/partition"), r.tags.get("dagster/sensor_name"),
                                      r.tags.get("dagster/backfill")) for r in every_run]  # nothing ran twice
        checks = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(dg.AssetKey("acceptance"), "tau_in_range"), limit=10)

    # Everything the instance knows is in PostgreSQL's tables.
    keys = ["step-000001", *backfill_keys]
    assert sorted(r[0] for r in _rows(stack, "SELECT partition FROM dynamic_partitions")) == keys
    assert _rows(stack, "SELECT status, count(*) FROM runs GROUP BY status") == [("SUCCESS", 3)]
    materialized = _rows(stack, "SELECT asset_key, count(DISTINCT partition) FROM event_logs "
                                "WHERE dagster_event_type = 'ASSET_MATERIALIZATION' GROUP BY asset_key ORDER BY 1")
    assert materialized == [(f'["{a}"]', 3) for a in sorted(["acceptance", "drafter", "drafter_buffer",
                                                             "hidden_states", "rollouts"])]
    executions = _rows(stack, "SELECT check_name, execution_status, count(*) FROM asset_check_executions "
                              "GROUP BY check_name, execution_status ORDER BY check_name")
    assert executions == [(name, "SUCCEEDED", 3) for name in ("buffer_within_limits", "shards_valid", "tau_in_range")]
    assert len(checks) == 3

    # MLflow (PostgreSQL backend): step 3's training run, its model version, the aliases the first drafter gets.
    registry = stack.registry()
    runs = registry.client.search_runs([registry.experiment_id])
    assert [r.info.run_name for r in runs] == ["drafter-step-000003"]
    versions = registry.client.search_model_versions(f"name = '{cfg.mlflow.model_name}'")
    assert [v.version for v in versions] == ["1"]
    assert registry.alias_version("champion") == registry.alias_version("baseline") == "1"
    # Its artifacts (the checkpoints) are objects in S3, not files of the server.
    s3 = s3fs.S3FileSystem(client_kwargs={"endpoint_url": stack.s3}, skip_instance_cache=True)
    artifact_root = runs[0].info.artifact_uri
    assert artifact_root.startswith("mlflow-artifacts:")
    stored = [p for p in s3.find(f"{BUCKET}/")
              if "/mlflow-" in p and runs[0].info.run_id in p and p.endswith("model.safetensors")]
    assert len(stored) == 1
    assert _places_holding_the_password(stack) == []


def _places_holding_the_password(stack: Stack) -> list[str]:
    """Logs and files of the stack (daemon, MLflow server, run logs), Dagster's events and runs, MLflow's params
    and tags: every place that holds the database password."""
    secret = stack.pg.password
    found = [str(p) for root in (stack.home.parent, stack.cfg.warm_path) for p in root.rglob("*")
             if p.is_file() and secret.encode() in p.read_bytes()]  # the stage workers' logs too
    pattern = f"'%{secret}%'"
    for db, table, column in [(stack.dagster_db, "event_logs", "event"), (stack.dagster_db, "runs", "run_body"),
                              (stack.mlflow_db, "params", "value"), (stack.mlflow_db, "tags", "value"),
                              (stack.mlflow_db, "model_version_tags", "value")]:
        if stack.pg.query(db, f"SELECT to_regclass('{table}')") == [(None,)]:
            continue  # no Dagster tables yet: the daemon test did not run before this one
        if stack.pg.query(db, f"SELECT count(*) FROM {table} WHERE {column} LIKE {pattern}") != [(0,)]:
            found.append(f"{db}.{table}")
    return found


@pytest.mark.ui
@pytest.mark.slow
def test_mlflow_ui_on_postgres_and_s3(stack: Stack) -> None:
    """The MLflow UI browser test on the PostgreSQL/S3 server, on a drafter it registers there itself (in an
    experiment and model of its own: the daemon test counts the stack's runs and versions)."""
    register_champion(stack.mlflow, "pg-ui", "pg-ui-drafter", 3)
    with browser_page() as page:
        check_mlflow_ui(page, stack.mlflow, "pg-ui", "pg-ui-drafter", [3], "postgres-")


@pytest.mark.reliability("fault", "PostgreSQL under the MLflow server stopped mid-run and back 3 s later")
def test_mlflow_database_goes_away_mid_run(stack: Stack) -> None:
    """The last test of the module: it stops the server the stack's other parts use."""
    registry = DrafterRegistry(stack.mlflow, "pg-outage", "pg-outage-drafter")
    run_id = registry.start_run("outage", {"rl_step": "step-000001"})
    stack.pg.stop("immediate")  # as a crash: connections cut, no checkpoint
    restart = threading.Timer(3.0, stack.pg.start)
    restart.start()
    try:
        # Sent while the database is gone: the server answers 500, the client backs off and sends it again.
        registry.client.log_metric(run_id, "loss", 0.5, step=1)
        registry.end_run(run_id)
    finally:
        restart.join()
    runs = registry.client.search_runs([registry.experiment_id], filter_string="tags.rl_step = 'step-000001'")
    assert [r.info.run_id for r in runs] == [run_id]  # one run, not a second one
    assert registry.client.get_run(run_id).info.status == "FINISHED"
    assert [(m.step, m.value) for m in registry.client.get_metric_history(run_id, "loss")] == [(1, 0.5)]
    assert _places_holding_the_password(stack) == []
