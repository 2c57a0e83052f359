"""The production stack on one machine, for an operator's look (`make ui STACK=postgres`) and for the tests
marked postgres: a PostgreSQL server of its own and Dagster's production instance settings less Kubernetes.

The server is Debian's `postgresql` binaries (initdb, pg_ctl) on a data directory of its own, on a loopback
port, with password (SCRAM) authentication as in production. initdb refuses to run as root, so as root the
server's files belong to, and its processes run as, the `postgres` OS user the Debian package creates.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ops.database import PostgresTarget, query
from pipeline.config import PROJECT_ROOT

SERVER_USER = "postgres"  # the OS user the Debian package creates
# A local server: without fsync its writes cost no disk flushes, and only an OS crash (not a killed server) can
# lose them. Commits stay synchronous: with synchronous_commit off a server stopped like a crash loses the last
# commits a client was told had succeeded (a test stops it so).
FAST = {"fsync": "off", "full_page_writes": "off", "max_connections": "200"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin_dir() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian keeps initdb and pg_ctl off the PATH)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise RuntimeError("PostgreSQL is not installed (no initdb): `make postgresql` installs Debian's package")


@dataclass
class PostgresServer:
    """One PostgreSQL cluster under `directory` (data/, server.log); `start()` and `stop()` may be called
    again (a database that goes away and comes back)."""

    directory: Path
    password: str = field(repr=False)
    port: int = field(default_factory=free_port)
    user: str = "pipeline"
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.directory = self.directory.resolve()  # the server runs from its data directory: paths must be absolute

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
        if os.geteuid() == 0:
            argv = ["runuser", "-u", SERVER_USER, "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)

    def init(self) -> None:
        """initdb with `password` for `user` (given in a file that is removed right after)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        pwfile = self.directory / "pwfile"
        pwfile.write_text(self.password + "\n")
        if os.geteuid() == 0:
            shutil.chown(self.directory, SERVER_USER)
            shutil.chown(pwfile, SERVER_USER)
        done = self._run([str(pg_bin_dir() / "initdb"), "-D", str(self.data_dir), "-U", self.user,
                          "--pwfile", str(pwfile), "--auth-host=scram-sha-256", "--auth-local=scram-sha-256",
                          "-E", "UTF8", "--locale=C", "--no-sync"])
        pwfile.unlink()
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed in {self.data_dir}:\n{done.stdout}{done.stderr}")
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in {**FAST, "listen_addresses": f"'{self.host}'",
                                                          "unix_socket_directories": f"'{self.directory}'"}.items())

    def start(self) -> None:
        done = self._run([str(pg_bin_dir() / "pg_ctl"), "-D", str(self.data_dir), "-l",
                          str(self.directory / "server.log"), "-o", f"-p {self.port}", "-w", "-t", "60", "start"])
        if done.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not start on port {self.port}:\n{done.stdout}{done.stderr}")

    def stop(self, mode: str = "fast") -> None:
        """`immediate`: as a crash would (no checkpoint); `fast`: clients disconnected, then a clean stop."""
        self._run([str(pg_bin_dir() / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop"])

    def target(self, db: str = "postgres", purpose: str = "local", password: str | None = None) -> PostgresTarget:
        return PostgresTarget(purpose, self.host, self.port, self.user, db,
                              self.password if password is None else password)

    def query(self, db: str, sql: str) -> list[tuple]:
        return query(self.target(db), sql)

    def create_database(self, name: str, replace: bool = True) -> str:
        """Database `name`, empty when `replace` (an existing one is dropped first), else kept if it exists."""
        if not replace and self.query("postgres", f"SELECT 1 FROM pg_database WHERE datname = '{name}'"):
            return name
        conn = self.target().connect()
        try:
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return name

    def backend_store_uri(self, db: str) -> str:
        """MLflow's backend store URI: no password in it (psycopg2/libpq reads PGPASSWORD)."""
        return f"postgresql+psycopg2://{self.user}@{self.host}:{self.port}/{db}"

    def dagster_env(self, db: str, password: str | None = None) -> dict[str, str]:
        """The environment deploy/dagster.yaml reads its connection settings from (DAGSTER_PG_PORT: check-db's)."""
        return {"DAGSTER_PG_HOST": self.host, "DAGSTER_PG_PORT": str(self.port), "DAGSTER_PG_USER": self.user,
                "DAGSTER_PG_DB": db, "DAGSTER_PG_PASSWORD": self.password if password is None else password}


def production_instance_yaml(port: int) -> str:
    """deploy/dagster.yaml as a local instance: its storage (credentials still from the environment), run
    monitoring, retries and concurrency, with the default run launcher (a run is a local process) in place of
    Kubernetes', and `port` in place of 5432."""
    config = yaml.safe_load((PROJECT_ROOT / "deploy" / "dagster.yaml").read_text())
    del config["run_launcher"]
    config["storage"]["postgres"]["postgres_db"]["port"] = port
    return yaml.safe_dump(config, sort_keys=False)


def write_dagster_home(directory: Path, port: int) -> Path:
    """A DAGSTER_HOME whose dagster.yaml is production's (see `production_instance_yaml`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "dagster.yaml").write_text(production_instance_yaml(port))
    return directory


@dataclass
class LocalStack:
    """The running stack: where each part is, the pipeline config that points at them and the environment
    (connection settings, secrets) the Dagster and MLflow processes take."""

    postgres: PostgresServer
    s3_endpoint: str
    dagster_home: Path
    config_path: Path
    mlflow_command: list[str]
    env: dict[str, str]


DAGSTER_DB, MLFLOW_DB, BUCKET = "dagster", "mlflow", "drafter"
MLFLOW_PORT = 5000


@contextlib.contextmanager
def postgres_stack(directory: Path, config_path: str | None, mlflow_bin: Path) -> Iterator[LocalStack]:
    """PostgreSQL (databases `dagster` and `mlflow`) and an S3-compatible server (moto's, in this process,
    in memory) under `directory`, until the block ends. Each start is a fresh stack: S3 lives in memory,
    so the databases that point into it are created anew too."""
    from moto.server import ThreadedMotoServer

    server = PostgresServer(directory / "pg", _password(directory))
    if not server.data_dir.exists():
        server.init()
    server.start()
    s3_port = free_port()
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    try:
        for db in (DAGSTER_DB, MLFLOW_DB):
            server.create_database(db)
        s3.start()
        endpoint = f"http://127.0.0.1:{s3_port}"
        env = {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local", "AWS_DEFAULT_REGION": "us-east-1",
               **server.dagster_env(DAGSTER_DB)}
        _create_bucket(endpoint, env)
        overrides = {"storage": {"root": f"s3://{BUCKET}/store", "endpoint_url": endpoint},
                     "mlflow": {"tracking_uri": f"http://127.0.0.1:{MLFLOW_PORT}"}}
        mlflow = [str(mlflow_bin), "server", "--backend-store-uri", server.backend_store_uri(MLFLOW_DB),
                  "--artifacts-destination", f"s3://{BUCKET}/mlflow", "--host", "127.0.0.1",
                  "--port", str(MLFLOW_PORT), "--workers", "1"]
        yield LocalStack(server, endpoint, write_dagster_home(directory / "dagster", server.port),
                         _write_config(directory / "pipeline.yaml", config_path, overrides), mlflow,
                         {**env, "PGPASSWORD": server.password, "MLFLOW_S3_ENDPOINT_URL": endpoint})
    finally:
        s3.stop()
        server.stop()


def _password(directory: Path) -> str:
    """The local server's password: made once, kept in a file only its owner reads."""
    path = directory / "password"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(24))
    return path.read_text().strip()


def _create_bucket(endpoint: str, env: dict[str, str]) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.makedirs(BUCKET, exist_ok=True)


def _write_config(path: Path, config_path: str | None, overrides: dict) -> Path:
    """The user's pipeline config (if any) with `overrides` merged over it, as a file the processes read."""
    data = yaml.safe_load(Path(config_path).read_text()) or {} if config_path else {}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
