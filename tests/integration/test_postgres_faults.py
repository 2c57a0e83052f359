"""PostgreSQL under Dagster where it differs from SQLite, and its failures: concurrent writers (two RL runs'
steps at once, two sensor daemons racing on one step), a daemon killed mid-tick, a wrong password, a server
that is down, a schema from an older version. Errors name the database and never carry the password.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

import dagster as dg
import pytest
import yaml

import cli
from ops.database import DatabaseError, check_databases, schema_scripts
from ops.instance import prepare_instance
from ops.local_stack import PostgresServer, free_port, write_dagster_home
from pipeline.config import load_config
from pipeline.data.store import open_store
from pipeline.sources.simulation import SimulatedRL
from tests.integration.test_dagster import _fake_step
from tests.integration.test_production import gpu_step
from tests.integration.test_reliability import _daemon
from tests.support.config import write_config

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
WRONG = "sentinel-wrong-password-0c77"


@pytest.fixture
def home(postgres: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A DAGSTER_HOME of production's instance settings on a new database; its connection settings in the
    environment (this process's and the processes it starts)."""
    db = postgres.create_database(f"dagster_{uuid.uuid4().hex[:8]}")
    for key, value in postgres.dagster_env(db).items():
        monkeypatch.setenv(key, value)
    return write_dagster_home(tmp_path / "dagster_home", postgres.port)


def _instance(home: Path) -> dg.DagsterInstance:
    return dg.DagsterInstance.from_config(str(home))


# -- what PostgreSQL allows that SQLite does not ---------------------------------------------------------------


@pytest.mark.slow
def test_steps_of_two_rl_runs_materialize_at_once(home: Path, tmp_path: Path) -> None:
    """Two processes, each a step of its own RL run (run name), write one instance at the same time. The test
    holds the one `gpu` slot until both runs wait for it: both are in progress at once, whatever their start-up
    takes."""
    with _instance(home) as instance:
        prepare_instance(instance)  # production's init container: `cli.py init-instance`
        assert instance.event_log_storage.claim_concurrency_slot("gpu", "holder", "gpu-step").is_claimed
    procs = {}
    for run in ("alpha", "beta"):
        (tmp_path / run).mkdir()
        config = write_config(tmp_path / run, {"run": run, "fleet": {"driver": "none"}})
        cfg = load_config(config)
        SimulatedRL(cfg.simulation, open_store(cfg), cfg.run, cfg.data_path / "cache").run_step(1)
        env = dict(os.environ, DAGSTER_HOME=str(home), DRAFTER_PIPELINE_CONFIG=str(config), PYTHONPATH=str(ROOT))
        with _instance(home) as instance:
            instance.add_dynamic_partitions("rl_step", ["step-000001"])
        argv = [str(Path(sys.executable).parent / "dagster"), "asset", "materialize", "-f", "definitions.py",
                "--select", "rollouts,hidden_states", "--partition", "step-000001"]
        procs[run] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
    with _instance(home) as instance:
        storage, deadline = instance.event_log_storage, time.monotonic() + 300
        while storage.get_concurrency_info("gpu").pending_step_count < 2:  # both hidden_states steps wait
            assert all(proc.poll() is None for proc in procs.values()), "a run ended before asking for the slot"
            assert time.monotonic() < deadline, "the two runs never waited for the slot together"
            time.sleep(0.5)
        storage.free_concurrency_slot_for_step("holder", "gpu-step")
    outputs = {run: proc.communicate(timeout=600)[0] for run, proc in procs.items()}
    failed = {run: outputs[run][-4000:] for run, proc in procs.items() if proc.returncode != 0}
    assert not failed, "\n\n".join(f"{run} failed:\n{tail}" for run, tail in failed.items())

    with _instance(home) as instance:
        assert [r.status for r in instance.get_runs()] == [dg.DagsterRunStatus.SUCCESS] * 2
        events = instance.fetch_materializations(dg.AssetKey("rollouts"), limit=10).records
        uris = [e.asset_materialization.metadata["uri"].value for e in events]  # .../rollouts/<run>/step-000001
        assert sorted(uri.rstrip("/").split("/")[-2] for uri in uris) == ["alpha", "beta"]
        # hidden_states takes the one `gpu` slot (production's pool limit): held by one run at a time, all freed.
        assert len(instance.fetch_materializations(dg.AssetKey("hidden_states"), limit=10).records) == 2
        gpu = instance.event_log_storage.get_concurrency_info("gpu")
        assert (gpu.slot_count, gpu.active_slot_count) == (1, 0)


def _init_instance(home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    cli.main(["init-instance"])
    return capsys.readouterr().out


def _set_default_pool_limit(home: Path, limit: int) -> None:
    path = home / "dagster.yaml"
    settings = yaml.safe_load(path.read_text())
    settings["concurrency"]["pools"]["default_limit"] = limit
    path.write_text(yaml.safe_dump(settings))


@pytest.mark.reliability("fault", "GPU pool's default limit changed on a PostgreSQL instance")
def test_init_instance_sets_the_gpu_pool_to_a_changed_default(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`cli.py init-instance` (production's init container) gives the `gpu` pool dagster.yaml's default limit
    before any run asks it for a slot, and the new limit once the default changes: Dagster's own update of that
    row fails on PostgreSQL, in every run. A limit a person set in the UI stays."""
    assert "ok: pool gpu: 1 slot(s), dagster.yaml's default" in _init_instance(home, monkeypatch, capsys)
    _set_default_pool_limit(home, 2)
    assert "ok: pool gpu: 2 slot(s), dagster.yaml's default" in _init_instance(home, monkeypatch, capsys)
    with _instance(home) as instance:
        assert dg.materialize([gpu_step], instance=instance).success  # a step of the pool at its new limit
        storage = instance.event_log_storage
        assert (storage.get_concurrency_info("gpu").slot_count, len(storage.get_concurrency_run_ids())) == (2, 0)
        storage.set_concurrency_slots("gpu", 3)  # a person's choice in the UI
    _set_default_pool_limit(home, 1)
    assert "ok: pool gpu: 3 slot(s), set by hand" in _init_instance(home, monkeypatch, capsys)


@pytest.mark.reliability("fault", "Dagster daemon killed mid-tick and restarted, instance on PostgreSQL")
def test_sensor_daemon_killed_restarted_and_raced_on_postgres(home: Path, tmp_path: Path) -> None:
    """Killed after creating a run, restarted: each step requested once. Then two daemons evaluate the same new
    step at the same moment: it is requested, no earlier step again, and neither daemon fails. Dagster supports
    one daemon per instance: its run-key check is a read, then an insert, so two racing daemons can both request
    the step. The run queue runs one run of a partition at a time (dagster/partition, limit 1), so a second
    request repeats the step after the first, never beside it."""
    from dagster._core.storage.tags import RUN_KEY_TAG

    config = write_config(tmp_path, {"fleet": {"driver": "none"}})
    cfg = load_config(config)
    store = open_store(cfg)
    for step in (1, 2):
        _fake_step(store, cfg.run, step)
    start = 2_000_000_000.0
    assert _daemon(home, config, [start], "RUN_CREATED") == -signal.SIGKILL
    with _instance(home) as instance:
        assert [r.tags[RUN_KEY_TAG] for r in instance.get_runs()] == ["step-000001"]
    _fake_step(store, cfg.run, 3)
    assert _daemon(home, config, [start + 60, start + 120]) == 0
    with _instance(home) as instance:
        keys = sorted(r.tags[RUN_KEY_TAG] for r in instance.get_runs())
        assert keys == ["step-000001", "step-000002", "step-000003"]
        assert sorted(instance.get_dynamic_partitions("rl_step")) == keys
        # The production run queue holds them (no run launcher ran in these daemon lifetimes).
        assert {r.status for r in instance.get_runs()} == {dg.DagsterRunStatus.QUEUED}

    # The sensor's state is stored by now: two daemons that each found none would both insert it, and the second
    # insert fails on its unique key (Dagster's own rule: one daemon per instance).
    _fake_step(store, cfg.run, 4)
    env = dict(os.environ, DAGSTER_HOME=str(home), DRAFTER_PIPELINE_CONFIG=str(config), PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "tests.support.daemon_child", str(start + 180)]
    racers = [subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [proc.communicate(timeout=300)[1] for proc in racers]
    assert [proc.returncode for proc in racers] == [0, 0], errors
    with _instance(home) as instance:
        keys = [r.tags[RUN_KEY_TAG] for r in instance.get_runs()]
        assert sorted(k for k in keys if k != "step-000004") == ["step-000001", "step-000002", "step-000003"]
        assert 1 <= keys.count("step-000004") <= 2, keys


# -- bad credentials, a database that is down or missing, an older schema ------------------------------------


def _texts(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.mark.reliability("bad_input", "wrong PostgreSQL password (Dagster storage, MLflow backend store)")
def test_wrong_password_names_the_database_and_never_the_password(
    postgres: PostgresServer, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = os.environ["DAGSTER_PG_DB"]
    with _instance(home) as instance:
        instance.get_runs()  # the schema exists; only the password is wrong below
    monkeypatch.setenv("DAGSTER_PG_PASSWORD", WRONG)
    argv = [sys.executable, "cli.py", "check-db"]
    done = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    assert (f"check-db: cannot connect to the Dagster storage database '{db}' at 127.0.0.1:{postgres.port} "
            "(user 'pipeline')") in done.stderr
    assert "password authentication failed" in done.stderr
    assert WRONG not in done.stdout + done.stderr

    # MLflow's backend store, its password from PGPASSWORD (never in the URI).
    monkeypatch.delenv("DAGSTER_PG_HOST")
    monkeypatch.setenv("MLFLOW_BACKEND_STORE_URI", postgres.backend_store_uri("postgres"))
    monkeypatch.setenv("PGPASSWORD", WRONG)
    with pytest.raises(DatabaseError, match="MLflow backend store database 'postgres'.*password authentication") as e:
        check_databases()
    assert WRONG not in _texts(e.value)

    # Dagster left alone (a daemon, a webserver, a run worker): its own, vaguer error, without the password too.
    monkeypatch.setenv("DAGSTER_PG_HOST", postgres.host)
    with pytest.raises(Exception, match="too many retries for DB connection") as e:
        _instance(home).get_runs()
    assert WRONG not in _texts(e.value)


@pytest.mark.parametrize(("problem", "expected"), [
    pytest.param("down", "Connection refused", id="down"),
    pytest.param("missing", 'database "no_such_db" does not exist', id="missing"),
])
@pytest.mark.reliability("fault", "PostgreSQL down at start, or the database missing: check-db names it")
def test_database_down_or_missing_at_start(postgres: PostgresServer, home: Path, monkeypatch: pytest.MonkeyPatch,
                                           problem: str, expected: str) -> None:
    port = free_port() if problem == "down" else postgres.port
    db = "no_such_db" if problem == "missing" else os.environ["DAGSTER_PG_DB"]
    monkeypatch.setenv("DAGSTER_PG_PORT", str(port))
    monkeypatch.setenv("DAGSTER_PG_DB", db)
    with pytest.raises(DatabaseError) as failure:
        check_databases()
    message = str(failure.value)
    assert f"Dagster storage database '{db}' at 127.0.0.1:{port}" in message
    assert expected in message
    assert postgres.password not in _texts(failure.value)


@pytest.mark.reliability("bad_input", "database schema of an older Dagster or MLflow version")
def test_schema_of_an_older_version_names_the_upgrade_command(postgres: PostgresServer, home: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    db = os.environ["DAGSTER_PG_DB"]
    with _instance(home) as instance:
        instance.get_runs()
    assert check_databases() == [f"Dagster storage database '{db}' at 127.0.0.1:{postgres.port} (user 'pipeline')"]
    head, older = _head_and_previous("dagster")
    assert postgres.query(db, "SELECT version_num FROM alembic_version") == [(head,)]
    postgres.query(db, f"UPDATE alembic_version SET version_num = '{older}'")  # as an older Dagster left it
    with pytest.raises(DatabaseError, match=f"'{db}' .* has schema revision {older}, this version needs {head}: "
                                            r"back it up, then run `dagster instance migrate`"):
        check_databases()

    mlflow_db = postgres.create_database(f"mlflow_{uuid.uuid4().hex[:8]}")
    head, older = _head_and_previous("mlflow")
    postgres.query(mlflow_db, "CREATE TABLE alembic_version (version_num varchar(32)); "
                              f"INSERT INTO alembic_version VALUES ('{older}')")
    monkeypatch.delenv("DAGSTER_PG_HOST")
    monkeypatch.setenv("MLFLOW_BACKEND_STORE_URI", postgres.backend_store_uri(mlflow_db))
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    with pytest.raises(DatabaseError, match=f"MLflow backend store .* schema revision {older}, this version needs "
                                            rf"{head}: .*`mlflow db upgrade \$MLFLOW_BACKEND_STORE_URI`"):
        check_databases()


def _head_and_previous(kind: str) -> tuple[str, str]:
    scripts = schema_scripts(kind)
    head = scripts.get_current_head()
    return head, scripts.get_revision(head).down_revision
