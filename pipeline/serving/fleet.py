"""The serving fleet: replica drivers, deploy gates and the rolling update.

A redeploy restarts each replica with the new `--speculative-config` (the one way that
works on every vLLM version), one replica at a time, so never more than one is down; a
replica the driver knows runs that very drafter and policy already (a rerun of a deploy
stopped midway, the same version again) is not restarted, only gated. A
replica passes when, in order: GET /health answers 200, GET /v1/models lists the served
model, a smoke completion returns tokens, and over a canary window of completions its
live mean acceptance length (from GET /metrics) reaches the configured minimum. A
replica that fails is restarted with the previous drafter and the deploy stops.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.data.records import DeployReport, ReplicaDeploy
from pipeline.serving import metrics as serving_metrics


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    host: str
    port: int
    served_model_name: str = "policy"
    api_key_env: str = ""  # the key itself only ever lives in the environment

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


def speculative_config(method: str, drafter_dir: str, k: int) -> str:
    return json.dumps({"method": method, "model": drafter_dir, "num_speculative_tokens": k})


def vllm_argv(replica: ReplicaSpec, target: str, method: str, drafter_dir: str, k: int) -> list[str]:
    """`vllm serve` for one replica. No API key here: argv ends up in process lists and logs, so
    the key goes to vLLM through its VLLM_API_KEY environment variable (`vllm_env`)."""
    return ["vllm", "serve", target, "--host", replica.host, "--port", str(replica.port),
            "--served-model-name", replica.served_model_name,
            "--speculative-config", speculative_config(method, drafter_dir, k)]


def vllm_env(replica: ReplicaSpec) -> dict[str, str]:
    """The launching environment: the replica's key, if any, as VLLM_API_KEY."""
    env = dict(os.environ)
    if replica.api_key:
        env["VLLM_API_KEY"] = replica.api_key
    return env


class ReplicaDriver(Protocol):
    def restart(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> None: ...

    def stop(self, replica: ReplicaSpec) -> None: ...

    def alive(self, replica: ReplicaSpec) -> bool:
        """False once the driver knows the replica's process has exited (fail fast, not at the timeout)."""
        ...

    def serving(self, replica: ReplicaSpec) -> tuple[str, str] | None:
        """(target, drafter_dir) the replica's running process was started with; None when not known."""
        ...


class StandInDriver:
    """Supervises local stand-in replica processes (`pipeline.serving.standin_replica`), not vLLM.

    Each replica's pid is kept in `<state_dir>/<name>.pid`, so a later driver (the next Dagster
    run, another process) can replace a replica an earlier one started."""

    def __init__(self, k: int, state_dir: Path) -> None:
        self.k, self.state_dir = k, state_dir
        self.processes: dict[str, subprocess.Popen] = {}

    def argv(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> list[str]:
        argv = [sys.executable, "-m", "pipeline.serving.standin_replica", "--host", replica.host,
                "--port", str(replica.port), "--target", target, "--drafter", drafter_dir,
                "--num-speculative-tokens", str(self.k), "--served-model-name", replica.served_model_name]
        return argv + (["--api-key-env", replica.api_key_env] if replica.api_key_env else [])

    def _pid_file(self, replica: ReplicaSpec) -> Path:
        return self.state_dir / f"{replica.name}.pid"

    def restart(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> None:
        self.stop(replica)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = (self.state_dir / f"{replica.name}.log").open("ab")
        process = subprocess.Popen(
            self.argv(replica, target, drafter_dir), stdout=log, stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent, start_new_session=True,
        )
        self.processes[replica.name] = process
        self._pid_file(replica).write_text(str(process.pid))

    def stop(self, replica: ReplicaSpec) -> None:
        process = self.processes.pop(replica.name, None)
        pid_file = self._pid_file(replica)
        recorded = int(pid_file.read_text()) if pid_file.exists() else None
        if process is not None and process.pid != recorded:
            # Another process (a later deploy run) replaced the replica we started: the pid file
            # names the one serving now. Ours goes too, if it is still there.
            self._terminate(process.pid, process)
            process = None
        self._terminate(process.pid if process else recorded, process)
        pid_file.unlink(missing_ok=True)

    @staticmethod
    def _terminate(pid: int | None, process: subprocess.Popen | None) -> None:
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while _running(pid) and time.monotonic() < deadline:
                if process is not None:
                    process.poll()  # reap our own child so it does not linger as a zombie
                time.sleep(0.1)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if process is not None:
            process.wait()

    def alive(self, replica: ReplicaSpec) -> bool:
        process = self.processes.get(replica.name)
        if process is not None:
            return process.poll() is None
        pid_file = self._pid_file(replica)
        return pid_file.exists() and _running(int(pid_file.read_text()))

    def serving(self, replica: ReplicaSpec) -> tuple[str, str] | None:
        """Read from the command line of the process the pid file names (whichever driver started it)."""
        pid_file = self._pid_file(replica)
        pid = int(pid_file.read_text()) if pid_file.exists() else None
        if pid is None or not _running(pid):
            return None
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            return argv[argv.index("--target") + 1], argv[argv.index("--drafter") + 1]
        except (OSError, ValueError, IndexError):
            return None

    def stop_all(self, replicas: list[ReplicaSpec]) -> None:
        for replica in replicas:
            self.stop(replica)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class CommandDriver:
    """Restarts a real vLLM replica with a configured command template, e.g. a supervisor or
    `kubectl rollout restart`; `{argv}` is the shell-quoted `vllm serve ...` line."""

    def __init__(self, template: str, method: str, k: int) -> None:
        self.template, self.method, self.k = template, method, k

    def command(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> str:
        argv = vllm_argv(replica, target, self.method, drafter_dir, self.k)
        return self.template.format(argv=shlex.join(argv), name=replica.name, drafter=drafter_dir)

    def restart(self, replica: ReplicaSpec, target: str, drafter_dir: str) -> None:
        subprocess.run(self.command(replica, target, drafter_dir), shell=True, check=True, env=vllm_env(replica))

    def stop(self, replica: ReplicaSpec) -> None:
        pass

    def alive(self, replica: ReplicaSpec) -> bool:
        return True  # not ours to watch: the health gate's timeout decides

    def serving(self, replica: ReplicaSpec) -> tuple[str, str] | None:
        return None  # what the command started is not observable here: every replica is restarted


class GateError(RuntimeError):
    """A replica failed a deploy gate; the message names the replica and the gate."""


@dataclass(frozen=True)
class GateConfig:
    """The deploy gates of a replica; the values come from `fleet.*` of the pipeline config (one default each)."""

    ready_timeout_s: float
    canary_requests: int
    canary_tokens: int
    min_live_tau: float


def _request(replica: ReplicaSpec, path: str, body: dict | None = None, timeout: float = 60.0) -> bytes:
    request = urllib.request.Request(replica.url + path, method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    if replica.api_key:
        request.add_header("Authorization", f"Bearer {replica.api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def scrape(replica: ReplicaSpec, timeout: float = 10.0) -> serving_metrics.SpecCounters:
    """The replica's speculative-decoding counters now."""
    return serving_metrics.parse(_request(replica, "/metrics", timeout=timeout).decode())


def wait_healthy(replica: ReplicaSpec, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _request(replica, "/health", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if not alive():
                raise GateError(f"replica {replica.name}: its process exited before /health answered") from None
            if time.monotonic() > deadline:
                raise GateError(f"replica {replica.name}: /health not ready after {timeout_s:.0f}s ({exc})") from None
            time.sleep(0.5)


def check_replica(
    replica: ReplicaSpec, gates: GateConfig, canary_prompts: list[list[int]], alive: Callable[[], bool] = lambda: True
) -> float:
    """All gates in order; returns the live mean acceptance length over the canary window."""
    wait_healthy(replica, gates.ready_timeout_s, alive)
    try:
        models = [m["id"] for m in json.loads(_request(replica, "/v1/models"))["data"]]
        if replica.served_model_name not in models:
            raise GateError(f"replica {replica.name}: /v1/models lists {models}, not {replica.served_model_name!r}")
        smoke = json.loads(_request(replica, "/v1/completions", {
            "model": replica.served_model_name, "prompt": canary_prompts[0], "max_tokens": 4}))
        if not smoke["choices"] or not smoke["choices"][0].get("text"):
            raise GateError(f"replica {replica.name}: the smoke completion returned no text")
        before = scrape(replica)
        for i in range(gates.canary_requests):
            _request(replica, "/v1/completions", {"model": replica.served_model_name,
                                                  "prompt": canary_prompts[i % len(canary_prompts)],
                                                  "max_tokens": gates.canary_tokens})
        window = scrape(replica) - before
    except (urllib.error.URLError, KeyError, json.JSONDecodeError) as exc:
        raise GateError(f"replica {replica.name}: {exc}") from None
    tau = window.mean_acceptance_length
    if tau is None or tau < gates.min_live_tau:
        raise GateError(f"replica {replica.name}: live tau {tau} below the gate {gates.min_live_tau}")
    return tau


@dataclass(frozen=True)
class StagedDrafter:
    """A drafter version's checkpoint directory, as replicas read it."""

    version: str
    directory: str


def rolling_deploy(
    replicas: list[ReplicaSpec],
    driver: ReplicaDriver,
    target: str,
    version: str,
    drafter_dir: str,
    previous: StagedDrafter | None,
    gates: GateConfig,
    canary_prompts: list[list[int]],
) -> DeployReport:
    """Update replicas one at a time; on a failed gate restore `previous` there and stop.
    A replica already running `drafter_dir` on `target` keeps running: it only passes the gates
    (and is restarted like the others if it fails them)."""
    done: list[ReplicaDeploy] = []
    for replica in replicas:
        start = time.monotonic()
        alive = functools.partial(driver.alive, replica)
        tau = None
        if driver.serving(replica) == (target, drafter_dir):
            with suppress(GateError):  # failing while already serving it: restarted like the others
                tau = check_replica(replica, gates, canary_prompts, alive)
        restarted = tau is None
        try:
            if restarted:
                driver.restart(replica, target, drafter_dir)
                tau = check_replica(replica, gates, canary_prompts, alive)
        except GateError as exc:
            if previous is not None:
                driver.restart(replica, target, previous.directory)
                wait_healthy(replica, gates.ready_timeout_s, alive)
            raise GateError(
                f"{exc}; rolled back to version {previous.version if previous else 'none'}; deploy of "
                f"version {version} stopped after {len(done)} of {len(replicas)} replicas"
            ) from None
        done.append(ReplicaDeploy(replica.name, version, tau, time.monotonic() - start, restarted))
    return DeployReport(version, tuple(done))
