"""The tests' throwaway PostgreSQL server (ops/local_stack.py) in a new temporary directory, and the
Dagster home of the production instance settings on it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ops.local_stack import PostgresServer

PASSWORD = "sentinel-pg-password-5e8d21"  # a sentinel: tests check that it appears nowhere


def start_server() -> PostgresServer:
    """A started server in a new directory under the system's temporary directory: the `postgres` user it runs
    as (as root) cannot reach pytest's 0700 base directory."""
    parent = Path(tempfile.mkdtemp(prefix="drafter-pg-"))
    os.chmod(parent, 0o755)
    server = PostgresServer(parent / "pg", PASSWORD)
    server.init()
    server.start()
    return server
