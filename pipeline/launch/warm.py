"""A warm stage worker (`launch.launcher: warm`): one long-lived process per stage that keeps its imports
(torch, transformers, MLflow, the stage's own modules) loaded and runs the stage's jobs one at a time.

    python -m pipeline.launch.warm --stage extraction --socket S --lock L --idle-s 90

It listens on the Unix socket S (in the run's private stages folder, `pipeline.rendezvous`) and runs one
job at a time; the others' requests wait, read as they arrive:

    request   one JSON line {"pipes": {...}}: the Pipes bootstrap variables the launcher's session gives
              (what a launched process finds in its environment), the context and the message channel both
    job       the stage worker's own rank-0 body, `run_pipes`, over that Pipes channel, as in a fresh
              process: the same messages, materialization, checks and logs reach Dagster
    answer    one JSON line {"ok": bool, "error": str | null, "pid": int, "jobs": int}

A connection closed before its request line is a probe (`resources.warm.prestart`: a launcher that
started the worker ahead of its first job, or checked that one listens): no job, no answer. A request
that carries no job (not JSON, no Pipes context or message channel) is answered as a failure and runs
nothing: a stage never falls back to the configuration its working directory implies. A client that
sends no request line within REQUEST_TIMEOUT_S is dropped, so an idle one holds no job up, and a
process of another user is refused as it connects (its credentials, SO_PEERCRED).

A job leaves the process as a fresh one finds it: torch's RNG state, default dtype, thread count,
grad mode and deterministic flag, the environment and the working directory are restored, an
MLflow run left active is ended, and the peak memory (the next job's placement record) is reset.
Nothing else is kept between jobs: every job loads its policy and drafters from the store, so its
output is bit for bit a fresh process's.

The launcher's side closing the connection mid-job (its Dagster step killed) ends this process at
once, as `pipeline.launch.worker.exit_with_launcher` ends a launched worker: nothing is written after its
launcher is gone. With no request for `--idle-s` seconds it removes its socket and exits; it checks
the backlog under the launcher's lock L first, so a launcher never connects to a server about to leave.
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import importlib
import json
import os
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from dagster_pipes import PipesContext, PipesMappingParamsLoader, open_dagster_pipes

from pipeline.rendezvous import Peer, unix_address
from pipeline.stages import LAUNCHED, Stage, stage_named

REQUEST_TIMEOUT_S = 30.0  # a launcher sends its request as it connects; a client silent this long is dropped
REQUEST_MAX_BYTES = 1 << 20  # the Pipes bootstrap parameters are a few hundred bytes
PIPES_KEYS = ("DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES")


@dataclass(frozen=True)
class ProcessState:
    """The process-wide state a job may change, as the server found it at start (a fresh process's)."""

    rng: torch.Tensor
    seed: int
    dtype: torch.dtype
    threads: int
    grad: bool
    deterministic: bool
    environ: dict[str, str]
    cwd: Path

    @classmethod
    def capture(cls) -> ProcessState:
        return cls(torch.get_rng_state(), torch.initial_seed(), torch.get_default_dtype(), torch.get_num_threads(),
                   torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(), dict(os.environ),
                   Path.cwd())

    def restore(self) -> None:
        torch.set_rng_state(self.rng)
        if torch.cuda.is_initialized():  # a fresh process's CUDA generators start from the default seed
            torch.cuda.manual_seed_all(self.seed)
            torch.cuda.empty_cache()
            for device in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(device)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(self.grad)
        torch.use_deterministic_algorithms(self.deterministic)
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        if "mlflow" in sys.modules:  # the registry uses MlflowClient; a fluent run left open would leak on
            import mlflow

            while mlflow.active_run():
                mlflow.end_run()
        PipesContext._instance = None  # noqa: SLF001  open_dagster_pipes returns an open singleton otherwise
        gc.collect()
        _reset_peak_rss()


def _reset_peak_rss() -> None:
    """The next job's peak resident set (its placement record) is its own, from what the process holds now, as
    a fresh process's counts from its imports (Linux: the high-water mark reset through /proc)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the peak stays the worker's: an upper bound


@dataclass(frozen=True)
class Answer:
    ok: bool
    error: str | None
    pid: int
    jobs: int

    def to_line(self) -> bytes:
        return (json.dumps({"ok": self.ok, "error": self.error, "pid": self.pid, "jobs": self.jobs}) + "\n").encode()


def _exit_when_client_leaves(conn: socket.socket, done: threading.Event) -> None:
    """The launcher sends nothing after its request: end of stream before the answer means it is gone."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    if not done.is_set():
        sys.stderr.write("the launcher disconnected mid-job: exiting\n")
        sys.stderr.flush()
        os._exit(1)


def parse_request(line: bytes) -> dict[str, str]:
    """The request's Pipes bootstrap parameters; RequestError when the line is not a request that carries a
    job: not JSON, not {"pipes": {...}}, or without the context and message channel a launcher's session gives."""
    try:
        request = json.loads(line)
    except (UnicodeDecodeError, ValueError):
        raise RequestError("the request is not a JSON line") from None
    pipes = request.get("pipes") if isinstance(request, dict) else None
    if not isinstance(pipes, dict):
        raise RequestError("the request carries no Pipes bootstrap parameters (`pipes`)")
    missing = [k for k in PIPES_KEYS if not isinstance(pipes.get(k), str) or not pipes[k]]
    if missing:
        raise RequestError(f"the request's Pipes bootstrap parameters leave out {', '.join(missing)}: no job to run "
                           "(a stage never falls back to the configuration its working directory implies)")
    return pipes


class RequestError(ValueError):
    """A request that carries no job: answered as a failure, nothing run."""


def run_job(worker, conn: socket.socket, line: bytes, jobs: int) -> Answer:
    """One request (its JSON `line`): the stage's rank-0 body over the request's Pipes channel. A request
    without a job is answered as a failure without running anything."""
    try:
        params = parse_request(line)
    except RequestError as exc:
        return Answer(False, str(exc), os.getpid(), jobs)
    done = threading.Event()
    threading.Thread(target=_exit_when_client_leaves, args=(conn, done), name="launcher-watch", daemon=True).start()
    started = time.perf_counter()
    try:
        with open_dagster_pipes(params_loader=PipesMappingParamsLoader(params)) as pipes:
            worker.run_pipes(pipes)
        answer = Answer(True, None, os.getpid(), jobs + 1)
    except Exception as e:  # noqa: BLE001  the Pipes channel carries it to Dagster; the answer says the job failed
        traceback.print_exc()
        answer = Answer(False, f"{type(e).__name__}: {e}", os.getpid(), jobs + 1)
    finally:
        done.set()
    sys.stderr.write(f"job {jobs + 1}: {'ok' if answer.ok else 'failed'} in {time.perf_counter() - started:.1f} s\n")
    sys.stderr.flush()
    return answer


@dataclass
class _Pending:
    """A connection whose request line is still on its way."""

    conn: socket.socket
    deadline: float
    received: bytearray


def serve(stage: Stage, socket_path: Path, lock_path: Path, idle_s: float) -> None:
    worker = importlib.import_module(stage.worker)  # the imports a fresh process pays for every job
    gc.freeze()  # the imports' objects are never garbage: no collection scans them again (a full one takes 0.5 s)
    fresh = ProcessState.capture()
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
    jobs, pending, last_activity = 0, {}, time.monotonic()
    while True:
        now = time.monotonic()
        wait = max(0.0, min([last_activity + idle_s - now, *(p.deadline - now for p in pending.values())]))
        readable = select.select([listener, *pending], [], [], wait)[0]
        if not readable and not pending and time.monotonic() >= last_activity + idle_s:
            if _leave_if_idle(listener, socket_path, bound, lock_path):
                _log(f"idle for {idle_s} s after {jobs} job(s): exiting")
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
                answer = run_job(worker, conn, line, jobs)
                ran, jobs = answer.jobs > jobs, answer.jobs
                try:
                    conn.sendall(answer.to_line())
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # the launcher left after the job's end: nothing more to tell it
            if not ran:
                _log(f"refused a request: {answer.error}")
                continue
            fresh.restore()  # after the answer, before the next job: off the step's time
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
    serve(stage_named(args.stage), args.socket, args.lock, args.idle_s)


if __name__ == "__main__":
    main()
