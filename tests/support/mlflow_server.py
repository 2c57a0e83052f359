"""A real `mlflow server` process on a loopback port, for as long as a `with` block lasts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.support.config import free_port


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, artifacts_destination: str, log: Path | None = None,
                  env: dict[str, str] | None = None) -> Iterator[str]:
    """`mlflow server` with proxied artifacts; yields its URL once /health answers."""
    port = free_port()
    environ = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **(env or {}))
    output = log.open("w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", backend_store_uri, "--artifacts-destination", artifacts_destination],
        env=environ, stdout=output, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mlflow server did not start") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if log:
            output.close()
