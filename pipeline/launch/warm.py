"""A stage's warm worker (`launch.launcher: warm`): one long-lived process per stage that keeps its imports (torch,
transformers, MLflow, the stage's own modules) loaded and runs the stage's one-rank jobs one at a time, and the
protocol between it and its launcher, both ends.

    python -m pipeline.launch.warm --stage extraction --socket S --lock L --idle-s 90

    <folder>/                     `launch.warm_dir` (`<data_dir>/stages`), mode 0700, this user's
                                 (`rendezvous.py`): no other local user can listen, plant a file or read a log
    <folder>/<stage>-<key>.sock   the worker's socket (reached through the folder's descriptor when its path is too
                                 long for a Unix socket: it never moves elsewhere)
    <folder>/<stage>-<key>.lock   taken to connect or start, so two launchers never start two workers
    <folder>/<stage>-<key>.log    the worker's output (mode 0600): its tail is in every error the launcher's side
                                 raises

The key digests what a worker inherits at its start and a fresh process would too: the Python executable, the
working directory and the environment. A launcher with another environment (a test's fault injection, another
PYTHONPATH) gets a worker of its own. Launchers of several pipelines that share the folder share its workers (each
job carries its own configuration). Over the socket, one job per connection:

    request   one JSON line {"pipes": {...}}: the Pipes bootstrap variables the launcher's session gives
              (what a launched process finds in its environment), the context and the message channel both
    job       the stage worker's own rank-0 body, `run_pipes`, over that Pipes channel, as in a fresh
              process (`pipeline.launch.worker.WarmJobs`): the same messages, materialization, checks and logs
              reach Dagster
    answer    one JSON line {"ok": bool, "error": str | null, "pid": int, "jobs": int}, once the job is done

The job goes only to a worker of this user, and a worker takes jobs only from this user's launchers: each end
checks the other's credentials (SO_PEERCRED). A connection closed before its request line is a probe (`prestart`:
a launcher that starts the worker ahead of its first job, or checks that one listens): no job, no answer. A
request that carries no job (not JSON, no Pipes context or message channel) is answered as a failure and runs
nothing: a stage never falls back to the configuration its working directory implies. A client that sends no
request line within REQUEST_TIMEOUT_S is dropped, so an idle one holds no job up; the others' requests wait,
read as they arrive.

The launcher's side closing the connection mid-job (its Dagster step killed) ends the worker at once, as
`pipeline.launch.worker.exit_with_launcher` ends a launched worker: nothing is written after its launcher is
gone. With no request for `--idle-s` seconds the worker removes its socket and exits; it checks the backlog
under the launchers' lock first, so a launcher never connects to a worker about to leave. A worker whose socket is
gone (its folder removed with the data dir, or another worker listening there) is out of reach: it leaves within
GONE_CHECK_S, whatever its idle time.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.launch.rendezvous import Peer, private_dir, private_file, unix_address
from pipeline.stages import LAUNCHED, Stage, stage_named

START_TIMEOUT_S = 600  # a cold worker's imports on a loaded machine
REQUEST_TIMEOUT_S = 30.0  # a launcher sends its request as it connects; a client silent this long is dropped
GONE_CHECK_S = 5.0  # how often an idle worker checks that its socket is still there
REQUEST_MAX_BYTES = 1 << 20  # the Pipes bootstrap parameters are a few hundred bytes
PIPES_KEYS = ("DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES")
# Change within one process (a test's name; MLflow's telemetry session, set at its first use) or between the Dagster
# instances of one launcher (DAGSTER_HOME: a stage reaches its run through Pipes, never the instance), read by no stage.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST", "_MLFLOW_TELEMETRY_SESSION_ID", "DAGSTER_HOME")
LOG_TAIL_LINES = 30


# --- the messages ----------------------------------------------------------------------------------------------


class RequestError(ValueError):
    """A request that carries no job: answered as a failure, nothing run."""


@dataclass(frozen=True)
class Request:
    """A job for the worker: the Pipes bootstrap parameters of the launcher's session."""

    pipes: dict[str, str]

    def to_line(self) -> bytes:
        return (json.dumps({"pipes": self.pipes}) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes) -> Request:
        """RequestError when the line is not a request that carries a job: not JSON, not {"pipes": {...}}, or
        without the context and message channel a launcher's session gives."""
        try:
            request = json.loads(line)
        except (UnicodeDecodeError, ValueError):
            raise RequestError("the request is not a JSON line") from None
        pipes = request.get("pipes") if isinstance(request, dict) else None
        if not isinstance(pipes, dict):
            raise RequestError("the request carries no Pipes bootstrap parameters (`pipes`)")
        missing = [k for k in PIPES_KEYS if not isinstance(pipes.get(k), str) or not pipes[k]]
        if missing:
            raise RequestError(f"the request's Pipes bootstrap parameters leave out {', '.join(missing)}: no job to "
                               "run (a stage never falls back to the configuration its working directory implies)")
        return cls(pipes)


@dataclass(frozen=True)
class Answer:
    """How the job went: `jobs` counts the worker's jobs so far, this one included."""

    ok: bool
    error: str | None
    pid: int
    jobs: int

    def to_line(self) -> bytes:
        return (json.dumps({"ok": self.ok, "error": self.error, "pid": self.pid, "jobs": self.jobs}) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes) -> Answer:
        doc = json.loads(line)
        return cls(bool(doc["ok"]), doc["error"], int(doc["pid"]), int(doc["jobs"]))


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


def server_files(folder: Path, stage: Stage, working_dir: Path, environ: dict[str, str] | None = None) -> ServerFiles:
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in VOLATILE_ENV}
    identity = json.dumps([sys.executable, str(working_dir), sorted(env.items())])
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return ServerFiles(folder / f"{stage.name}-{key}.sock", folder / f"{stage.name}-{key}.lock",
                       folder / f"{stage.name}-{key}.log")


# --- the launcher's end ----------------------------------------------------------------------------------------


class WarmWorkerError(RuntimeError):
    """The worker did not run the job: it failed to start, died mid-job, failed it, or is not this user's; the
    message names the stage and ends with the tail of the worker's log."""


class WarmWorker:
    """The launcher's end: one stage's warm worker, started when none listens."""

    def __init__(self, stage: Stage, folder: Path, working_dir: Path, idle_s: float) -> None:
        self.stage, self.working_dir, self.idle_s = stage, working_dir, idle_s
        self.files = server_files(folder, stage, working_dir)

    def run(self, request: Request, handed: Callable[[Peer], None] = lambda peer: None) -> Answer:
        """The job on the worker, its answer once the job is done; `handed` is called with the worker once it has
        the request. WarmWorkerError when the worker died mid-job or failed the job."""
        with self.connect() as conn:
            peer = self.check_peer(conn)
            conn.sendall(request.to_line())
            handed(peer)
            line = conn.makefile("rb").readline()  # the job's length: the worker answers when it is done
        if not line:
            raise WarmWorkerError(f"the warm {self.stage} worker died mid-job (nothing of it is committed unless it "
                                  f"reported so); its log {self.files.log} ends:\n{self.files.log_tail()}")
        answer = Answer.from_line(line)
        if not answer.ok:
            raise WarmWorkerError(f"the warm {self.stage} worker (pid {answer.pid}) failed its job: {answer.error}; "
                                  f"its log {self.files.log} ends:\n{self.files.log_tail()}")
        return answer

    def prestart(self) -> None:
        """The worker started now, unless one listens already: connected as a job would, closed before a request
        (a probe)."""
        with self.connect() as conn:
            self.check_peer(conn)

    def check_peer(self, conn: socket.socket) -> Peer:
        """The worker at the socket's other end, if it is this user's process; the job goes to no other."""
        peer = Peer.of(conn)
        if not peer.is_this_user:
            conn.close()
            raise WarmWorkerError(
                f"the process listening on {self.files.socket} (pid {peer.pid}) runs as uid {peer.uid}, not as this "
                f"user (uid {os.getuid()}): the {self.stage} job is not handed to it")
        return peer

    def connect(self) -> socket.socket:
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
                raise WarmWorkerError(
                    f"the warm {self.stage} worker exited with code {process.returncode} at start; its log "
                    f"{self.files.log} ends:\n{self.files.log_tail()}")
            time.sleep(0.1)
        process.kill()
        raise WarmWorkerError(
            f"the warm {self.stage} worker did not listen within {START_TIMEOUT_S} s; its log {self.files.log} "
            f"ends:\n{self.files.log_tail()}")


def _try_connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with unix_address(path) as address:
            conn.connect(address)
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None
    return conn


# --- the worker's end ------------------------------------------------------------------------------------------


class Jobs(Protocol):
    """What the worker runs: a job over the Pipes channel a request names, then the process reset for the next."""

    def run(self, pipes: dict[str, str]) -> None: ...

    def reset(self) -> None: ...


def run_job(jobs: Jobs, conn: socket.socket, line: bytes, done_jobs: int) -> Answer:
    """One request (its JSON `line`) run, and its answer. A request without a job is answered as a failure without
    running anything."""
    try:
        request = Request.from_line(line)
    except RequestError as exc:
        return Answer(False, str(exc), os.getpid(), done_jobs)
    done = threading.Event()
    threading.Thread(target=_exit_when_client_leaves, args=(conn, done), name="launcher-watch", daemon=True).start()
    started = time.perf_counter()
    try:
        jobs.run(request.pipes)
        answer = Answer(True, None, os.getpid(), done_jobs + 1)
    except Exception as e:  # noqa: BLE001  the Pipes channel carries it to Dagster; the answer says the job failed
        traceback.print_exc()
        answer = Answer(False, f"{type(e).__name__}: {e}", os.getpid(), done_jobs + 1)
    finally:
        done.set()
    _log(f"job {done_jobs + 1}: {'ok' if answer.ok else 'failed'} in {time.perf_counter() - started:.1f} s")
    return answer


def _exit_when_client_leaves(conn: socket.socket, done: threading.Event) -> None:
    """The launcher sends nothing after its request: end of stream before the answer means it is gone."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    if not done.is_set():
        _log("the launcher disconnected mid-job: exiting")
        os._exit(1)


@dataclass
class _Pending:
    """A connection whose request line is still on its way."""

    conn: socket.socket
    deadline: float
    received: bytearray


def serve(stage: Stage, socket_path: Path, lock_path: Path, idle_s: float, jobs: Jobs) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o077)  # only this user may send jobs
    try:
        with unix_address(socket_path) as address:
            listener.bind(address)
    finally:
        os.umask(old_umask)
    listener.listen(16)
    bound = _identity(socket_path)
    _log(f"stage server {stage} pid {os.getpid()} listening on {socket_path}")
    done_jobs, pending, last_activity = 0, {}, time.monotonic()
    while True:
        now = time.monotonic()
        deadlines = [last_activity + idle_s, now + GONE_CHECK_S, *(p.deadline for p in pending.values())]
        wait = max(0.0, min(deadlines) - now)
        readable = select.select([listener, *pending], [], [], wait)[0]
        if not readable and not pending:
            if _identity(socket_path) != bound:
                _log(f"socket {socket_path} gone after {done_jobs} job(s): exiting")
                return
            if time.monotonic() >= last_activity + idle_s:
                if _leave_if_idle(listener, socket_path, bound, lock_path):
                    _log(f"idle for {idle_s} s after {done_jobs} job(s): exiting")
                    return
                continue
        if listener in readable:
            _accept(listener, pending)
        for conn in [c for c in readable if c in pending]:
            line = _receive(pending, conn)
            if line is None:
                continue
            last_activity = time.monotonic()
            with conn:
                if not line:  # a probe: the connection closed without a request
                    continue
                answer = run_job(jobs, conn, line, done_jobs)
                ran, done_jobs = answer.jobs > done_jobs, answer.jobs
                try:
                    conn.sendall(answer.to_line())
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # the launcher left after the job's end: nothing more to tell it
            if not ran:
                _log(f"refused a request: {answer.error}")
                continue
            jobs.reset()  # after the answer, before the next job: off the step's time
            last_activity = time.monotonic()
            for waiting in pending.values():  # they waited for the job, not idly: their time starts now
                waiting.deadline = last_activity + REQUEST_TIMEOUT_S
        _expire(pending)


def _log(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _accept(listener: socket.socket, pending: dict[socket.socket, _Pending]) -> None:
    """The new connection waits for its request line, unless another user's process holds its other end."""
    conn, _ = listener.accept()
    peer = Peer.of(conn)
    if not peer.is_this_user:
        _log(f"refused a connection from pid {peer.pid} of uid {peer.uid}: only this user's launchers send jobs")
        conn.close()
        return
    conn.setblocking(False)
    pending[conn] = _Pending(conn, time.monotonic() + REQUEST_TIMEOUT_S, bytearray())


def _receive(pending: dict[socket.socket, _Pending], conn: socket.socket) -> bytes | None:
    """The connection's request line once it is whole (b"" for a probe, closed before a request); None while it
    is on its way. A line longer than REQUEST_MAX_BYTES is cut there (it then fails to parse, and is answered)."""
    waiting = pending[conn]
    try:
        chunk = conn.recv(REQUEST_MAX_BYTES)
    except BlockingIOError:
        return None
    except OSError:
        chunk = b""
    waiting.received += chunk
    end = waiting.received.find(b"\n")
    if chunk and end < 0 and len(waiting.received) < REQUEST_MAX_BYTES:
        return None
    del pending[conn]
    conn.setblocking(True)
    if not chunk and end < 0:
        return bytes(waiting.received)  # closed: a probe (b""), or a request cut short (fails to parse)
    return bytes(waiting.received[: end + 1] if end >= 0 else waiting.received)


def _expire(pending: dict[socket.socket, _Pending]) -> None:
    """Connections that sent no whole request line within REQUEST_TIMEOUT_S are closed: an idle client holds
    no later job up."""
    now = time.monotonic()
    for conn in [c for c, p in pending.items() if p.deadline <= now]:
        del pending[conn]
        _log(f"a client sent no request within {REQUEST_TIMEOUT_S:.0f} s: closed")
        conn.close()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


def _leave_if_idle(listener: socket.socket, socket_path: Path, bound: tuple[int, int] | None,
                   lock_path: Path) -> bool:
    """Remove the socket unless a launcher connected meanwhile; under the launchers' lock, so none connects
    between the check and the removal. A socket path that is no longer this server's (its data dir was
    removed, another server listens there now) is left alone, and this server leaves."""
    try:
        lock = open(lock_path, "a")  # held until the socket is gone
    except FileNotFoundError:
        return True  # the run's data dir is gone: nobody can reach this server any more
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if select.select([listener], [], [], 0)[0]:
            return False
        if _identity(socket_path) == bound:
            socket_path.unlink()
        return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.launch.warm", description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=sorted(s.name for s in LAUNCHED), required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--lock", type=Path, required=True, help="the lock launchers take to connect or start one")
    parser.add_argument("--idle-s", type=float, required=True, help="exit after this many seconds without a job")
    args = parser.parse_args(argv)
    # A worker outlives the data dirs of its jobs: MLflow keeps one store per tracking URI for the process's life,
    # and pooled SQLite connections would keep a removed database's file open (a demo run again writes to a new
    # one: "attempt to write a readonly database"). Unpooled, each MLflow session opens the file there now.
    os.environ.setdefault("MLFLOW_SQLALCHEMYSTORE_POOLCLASS", "NullPool")
    from pipeline.launch.worker import WarmJobs  # the worker's process: torch, Dagster Pipes, the stage's imports

    stage = stage_named(args.stage)
    serve(stage, args.socket, args.lock, args.idle_s, WarmJobs(stage))


if __name__ == "__main__":
    main()
