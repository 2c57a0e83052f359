"""The launcher's side of a warm stage worker (`launch.launcher: warm`, `pipeline.launch.warm`): a Pipes
client that hands a one-rank stage's job to its stage's long-lived worker over a Unix socket, starting
the worker when none is listening.

    <data_dir>/stages/                     mode 0700, this user's (`pipeline.rendezvous`): no other local user
                                          can listen, plant a file or read a log there
    <data_dir>/stages/<stage>-<key>.sock   the worker's socket (reached through the folder's descriptor when its
                                          path is too long for a Unix socket: it never moves elsewhere)
    <data_dir>/stages/<stage>-<key>.lock   taken to connect or start, so two steps never start two workers
    <data_dir>/stages/<stage>-<key>.log    the worker's output (mode 0600): its tail is in every error this
                                          client raises

The job goes only to a worker of this user: the process at the socket's other end is checked by its
credentials (SO_PEERCRED) before the job's Pipes parameters are sent.

`prestart` starts a stage's worker ahead of its first job (the demo does, at its start, so that no step
pays for a worker's imports): it connects as a job would and closes before sending a request, which the
worker takes for a probe.

The key digests what a worker inherits at its start and a fresh process would too: the Python
executable, the working directory and the environment. A step with another environment (a test's
fault injection, another PYTHONPATH) gets a worker of its own. The Pipes channel is a launched
process's: the context in a temp file, the messages read from a temp file by whole lines
(`resources.pipes_messages`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
from dagster._core.errors import DagsterPipesExecutionError  # what PipesSubprocessClient raises

from pipeline.rendezvous import Peer, private_dir, private_file, unix_address
from pipeline.stages import Stage
from resources.pipes_messages import PipesWholeLineTempFileMessageReader

START_TIMEOUT_S = 600  # a cold worker's imports on a loaded machine
# Change within one process (a test's name; MLflow's telemetry session, set at its first use), read by no stage.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST", "_MLFLOW_TELEMETRY_SESSION_ID")
LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class ServerFiles:
    """Where one stage's warm worker listens, locks and logs."""

    socket: Path
    lock: Path
    log: Path

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:])


def server_files(data_dir: Path, stage: Stage, working_dir: Path, environ: dict[str, str] | None = None) -> ServerFiles:
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in VOLATILE_ENV}
    identity = json.dumps([sys.executable, str(working_dir), sorted(env.items())])
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    folder = data_dir / "stages"
    return ServerFiles(folder / f"{stage.name}-{key}.sock", folder / f"{stage.name}-{key}.lock",
                       folder / f"{stage.name}-{key}.log")


class PipesWarmClient(dg.PipesClient):
    """One job on the stage's warm worker: its Pipes session, the request, the worker's answer."""

    def __init__(self, stage: Stage, data_dir: Path, working_dir: Path, idle_s: float) -> None:
        self.stage, self.working_dir, self.idle_s = stage, working_dir, idle_s
        self.files = server_files(data_dir, stage, working_dir)

    def run(self, *, context: dg.AssetExecutionContext, extras: dict,
            announce: str = "") -> dg.PipesClientCompletedInvocation:
        """The job on the worker; `announce` begins the line logged once the worker has it."""
        with dg.open_pipes_session(context=context, context_injector=dg.PipesTempFileContextInjector(),
                                   message_reader=PipesWholeLineTempFileMessageReader(), extras=extras) as session:
            with self._connect() as conn:
                peer = self._check_peer(conn)
                conn.sendall((json.dumps({"pipes": session.get_bootstrap_env_vars()}) + "\n").encode())
                # Logged while the worker works: an event written before the hand-off or after the answer
                # would lengthen the step.
                context.log.info(f"{announce + ': ' if announce else ''}job handed to the warm {self.stage} worker "
                                 f"(pid {peer.pid}; its log {self.files.log})")
                line = conn.makefile("rb").readline()  # the job's length: the worker answers when it is done
            if not line:
                raise DagsterPipesExecutionError(
                    f"the warm {self.stage} worker died mid-job (nothing of it is committed unless it reported "
                    f"so); its log {self.files.log} ends:\n{self.files.log_tail()}")
            answer = json.loads(line)
            if not answer["ok"]:
                raise DagsterPipesExecutionError(
                    f"the warm {self.stage} worker (pid {answer['pid']}) failed its job: {answer['error']}; "
                    f"its log {self.files.log} ends:\n{self.files.log_tail()}")
        return dg.PipesClientCompletedInvocation(session)

    def _check_peer(self, conn: socket.socket) -> Peer:
        """The worker at the socket's other end, if it is this user's process; the job goes to no other."""
        peer = Peer.of(conn)
        if not peer.is_this_user:
            conn.close()
            raise DagsterPipesExecutionError(
                f"the process listening on {self.files.socket} (pid {peer.pid}) runs as uid {peer.uid}, not as this "
                f"user (uid {os.getuid()}): the {self.stage} job is not handed to it")
        return peer

    def _connect(self) -> socket.socket:
        """A connection to the stage's worker, started first if none listens (under the lock, so once)."""
        private_dir(self.files.lock.parent)
        with private_file(self.files.lock) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            conn = _try_connect(self.files.socket)
            if conn is None:
                conn = self._start()
            return conn

    def _start(self) -> socket.socket:
        self.files.socket.unlink(missing_ok=True)  # a dead worker's, or none: nothing listens on it
        env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES_")}
        with private_file(self.files.log) as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "pipeline.launch.warm", "--stage", self.stage.name, "--socket",
                 str(self.files.socket), "--lock", str(self.files.lock), "--idle-s", str(self.idle_s)],
                cwd=self.working_dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # outlives this step; the Dagster run's signals are not its
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if (conn := _try_connect(self.files.socket)) is not None:
                # A launcher that outlives its worker (a process launching many steps) reaps it: no zombie.
                threading.Thread(target=process.wait, name=f"reap-{self.stage}-worker", daemon=True).start()
                return conn
            if process.poll() is not None:
                raise DagsterPipesExecutionError(
                    f"the warm {self.stage} worker exited with code {process.returncode} at start; its log "
                    f"{self.files.log} ends:\n{self.files.log_tail()}")
            time.sleep(0.1)
        process.kill()
        raise DagsterPipesExecutionError(
            f"the warm {self.stage} worker did not listen within {START_TIMEOUT_S} s; its log {self.files.log} "
            f"ends:\n{self.files.log_tail()}")


def prestart(stage: Stage, data_dir: Path, working_dir: Path, idle_s: float) -> None:
    """The stage's warm worker started now, unless one listens already: the worker a job of this process
    (same environment, same working directory) would get."""
    client = PipesWarmClient(stage, data_dir, working_dir, idle_s)
    with client._connect() as conn:
        client._check_peer(conn)


def _try_connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with unix_address(path) as address:
            conn.connect(address)
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None
    return conn
