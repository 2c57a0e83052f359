"""PostgreSQL databases of the production stack (Dagster's storage, MLflow's backend store): where they
are, and a check that fails with an error naming the database, never its password.

Connection settings and the password come from the environment only (DAGSTER_PG_* as deploy/dagster.yaml
reads them; PGPASSWORD for a URL that carries none). Dagster and MLflow, left alone, answer a wrong
password or a server that is down with a generic retry error ("too many retries for DB connection"),
so the commands that start or upgrade the stack check each database first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import psycopg2

DEFAULT_PORT = 5432


class DatabaseError(RuntimeError):
    """A database that cannot be used: unreachable, refusing the credentials, missing, or an older schema."""


@dataclass(frozen=True)
class PostgresTarget:
    """One database and what it is for; the password is never part of its text."""

    purpose: str  # e.g. "Dagster storage"
    host: str
    port: int
    user: str
    dbname: str
    password: str = field(default="", repr=False)

    def describe(self) -> str:
        return f"{self.purpose} database {self.dbname!r} at {self.host}:{self.port} (user {self.user!r})"

    @classmethod
    def from_dagster_env(cls, environ: dict[str, str] | None = None, port: int = DEFAULT_PORT) -> PostgresTarget:
        """Dagster's storage as deploy/dagster.yaml names it: DAGSTER_PG_HOST, _USER, _PASSWORD, _DB."""
        env = os.environ if environ is None else environ
        missing = [f"DAGSTER_PG_{k}" for k in ("HOST", "USER", "PASSWORD", "DB") if not env.get(f"DAGSTER_PG_{k}")]
        if missing:
            raise DatabaseError(f"Dagster storage: {', '.join(missing)} not set (the connection settings and the "
                                "password come from the environment)")
        return cls("Dagster storage", env["DAGSTER_PG_HOST"], int(env.get("DAGSTER_PG_PORT") or port),
                   env["DAGSTER_PG_USER"], env["DAGSTER_PG_DB"], env["DAGSTER_PG_PASSWORD"])

    @classmethod
    def from_url(cls, purpose: str, url: str, environ: dict[str, str] | None = None) -> PostgresTarget:
        """A SQLAlchemy URL (postgresql[+driver]://user[:password]@host[:port]/db); without a password in it,
        PGPASSWORD's, as libpq itself reads it."""
        env = os.environ if environ is None else environ
        parts = urlsplit(url)
        if not parts.scheme.startswith("postgresql"):
            raise DatabaseError(f"{purpose}: not a PostgreSQL URL (scheme {parts.scheme!r})")
        return cls(purpose, parts.hostname or "localhost", parts.port or DEFAULT_PORT, unquote(parts.username or ""),
                   parts.path.lstrip("/"), unquote(parts.password or "") or env.get("PGPASSWORD", ""))

    def connect(self, timeout_s: float = 10) -> psycopg2.extensions.connection:
        """A connection, or a DatabaseError that says which database and why."""
        try:
            conn = psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password,
                                    dbname=self.dbname, connect_timeout=max(1, int(timeout_s)))
        except psycopg2.OperationalError as exc:
            raise DatabaseError(f"cannot connect to the {self.describe()}: {self.redact(_reason(exc))}") from None
        conn.autocommit = True
        return conn

    def redact(self, text: str) -> str:
        return text.replace(self.password, "***") if self.password else text


def _reason(exc: psycopg2.OperationalError) -> str:
    text = " ".join(str(exc).split())
    if "password authentication failed" in text:
        return f"{text} (wrong password?)"
    return text


def check_database(target: PostgresTarget, timeout_s: float = 10) -> None:
    """Raise DatabaseError unless `target` accepts a connection and answers a query."""
    query(target, "SELECT 1", timeout_s)


def schema_revision(target: PostgresTarget) -> str | None:
    """The Alembic revision the database's schema is at (None: no schema yet); Dagster and MLflow both keep it."""
    if query(target, "SELECT to_regclass('alembic_version')")[0][0] is None:
        return None
    rows = query(target, "SELECT version_num FROM alembic_version")
    return rows[0][0] if rows else None


def query(target: PostgresTarget, sql: str, timeout_s: float = 10) -> list[tuple]:
    """The rows `sql` returns, none for a statement without (one connection, closed after)."""
    conn = target.connect(timeout_s)
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def check_schema(target: PostgresTarget, expected: str, upgrade_command: str) -> None:
    """Raise DatabaseError if the schema is at a revision other than `expected` (an older version's schema)."""
    found = schema_revision(target)
    if found is not None and found != expected:
        raise DatabaseError(f"the {target.describe()} has schema revision {found}, this version needs {expected}: "
                            f"back it up, then run `{upgrade_command}`")


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
