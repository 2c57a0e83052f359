"""A Ray cluster on loopback, for the tests and the benchmarks of `launch.launcher: ray`: a head (with the dashboard,
whose job API takes Ray jobs) and worker nodes, each with its own CPUs and custom resources, started by Ray's own
CLI (`ray start --block`, one process per node, its node's processes under it) in a temp dir of its own, and
stopped node by node: never `ray stop`, which stops every Ray process on the machine, another user's cluster
included.

A job runs as this user, with this user's environment: whoever can submit one runs their code as the pipeline.
So the cluster is this user's alone. Every server of it (GCS, raylets, agents, the dashboard) listens on
127.0.0.1 only, and every request, HTTP or gRPC, must carry its token (Ray's token authentication,
`RAY_AUTH_MODE=token`): a random one, in a file only this user can read, in a folder only this user can enter
(Ray opens its own temp dir to everyone, mode 0777, so that folder is the token's parent, not Ray's):

    /tmp/ray-XXXXXXXX/        mode 0700, this user's
    ├── auth_token            mode 0600: the token every node checks and every client sends
    ├── head.log, worker-*.log
    └── ray/                  the nodes' --temp-dir (Ray makes it 0777): session_*/, its logs and sockets
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 120.0  # a node's start on a loaded 2-core machine takes 5-20 s
TOKEN_FILE = "auth_token"

# Ray's CLI (`ray start`) with a node's address kept on loopback. Ray replaces a loopback node address by the
# machine's own (so that other machines reach the node), and its GCS, raylets and agents then listen on every
# interface; they listen on 127.0.0.1 alone when the node's address is 127.0.0.1. So the node's `ray start`
# keeps 127.0.0.1 as given, and the processes under it (the node's agents, its jobs' drivers, whose `ray.init`
# resolves the cluster's address the same way) take this machine as loopback (Ray's setting for a cluster on
# one machine, read as each of them imports Ray; `ray start` itself has read it as unset, which a worker
# node's start requires).
_LOOPBACK_RAY_START = """
import os, sys
import ray._private.services as services
services.resolve_ip_for_localhost = lambda host: host
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
from ray.scripts.scripts import main
sys.exit(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RayNode:
    cpus: int
    resources: dict[str, float]


@dataclass(frozen=True)
class RayCluster:
    address: str  # the dashboard's: what JobSubmissionClient, `launch.ray.address` and RAY_ADDRESS take
    gcs_address: str  # what `ray start --address` and ray.init take
    workers: tuple[RayNode, ...]
    token_file: Path  # what `launch.ray.token_file` and RAY_AUTH_TOKEN_PATH take; never the token itself

    def headers(self) -> dict[str, str]:
        """What a request to the dashboard carries: the cluster's token, as Ray's own clients send it."""
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def jobs(self):  # noqa: ANN201 - Ray's type, imported only where Ray is installed
        """A client of the job API, sending the token."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address, headers=self.headers())

    def state(self):  # noqa: ANN201 - as `jobs`
        """A client of Ray's state API (nodes, tasks), sending the token."""
        from ray.util.state.api import StateApiClient

        return StateApiClient(self.address, headers={**self.headers(), "Content-Type": "application/json"})

    def node_ids(self) -> dict[str, str]:
        """Each alive node's id by the first custom resource its test gave it ("head" for the head)."""
        from ray.util.state.common import ListApiOptions, StateResource

        names = [next(iter(node.resources), f"worker-{i}") for i, node in enumerate(self.workers)]
        ids = {}
        nodes = self.state().list(StateResource.NODES, options=ListApiOptions(detail=True),
                                  raise_on_missing_output=True)
        for node in nodes:
            if node.state == "ALIVE":
                ids[next((n for n in names if n in node.resources_total), "head")] = node.node_id
        return ids


def _node_ports() -> list[str]:
    """Ports of their own for a node's agents: the defaults are fixed, and clash between nodes on one machine."""
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            "--object-store-memory=78643200"]  # 75 MiB, Ray's least: the stages pass nothing through Ray's objects


def _write_token(root: Path) -> Path:
    """A fresh random token in `root` (this user's, mode 0700), in a file only this user can read."""
    path = root / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    return path


def _node_env(token_file: Path) -> dict[str, str]:
    """A node's environment: this one's, with token authentication on and the cluster's token file (a token
    given in RAY_AUTH_TOKEN would take precedence over the file, so it is dropped)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}


@contextmanager
def _node(args: list[str], log: Path, token_file: Path) -> Iterator[subprocess.Popen]:
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _LOOPBACK_RAY_START, "start", "--block",
                                 "--disable-usage-stats", "--node-ip-address=127.0.0.1", *args],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=_node_env(token_file))
    try:
        yield proc
    finally:
        # `--block` stops its node's processes on SIGTERM; a node whose head is gone may hang in that, and one
        # whose start gave up may leave a raylet behind: what is left of its process group (this node's
        # processes, none other) then gets SIGKILL.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait(condition: Callable[[], bool], what: str, log_dir: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if condition():
                return
        except Exception:  # noqa: BLE001 - the dashboard refuses connections until it is up
            pass
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(log_dir.glob("*.log")))
            raise TimeoutError(f"the loopback Ray cluster: {what} not within {START_TIMEOUT_S} s\n{logs}")
        time.sleep(0.5)


@contextmanager
def ray_cluster(head_cpus: int, workers: tuple[RayNode, ...] = ()) -> Iterator[RayCluster]:
    """A head with `head_cpus` CPUs and no custom resources, and `workers`, all up and registered."""
    # A short root: Ray's unix sockets live under it, and a socket's path holds at most 107 bytes. mkdtemp's
    # folder is this user's, mode 0700: the token's, and the way into Ray's own.
    root = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    temp_dir = root / "ray"
    gcs_port, dashboard_port = free_port(), free_port()
    with ExitStack() as nodes:
        nodes.callback(shutil.rmtree, root, ignore_errors=True)
        cluster = RayCluster(f"http://127.0.0.1:{dashboard_port}", f"127.0.0.1:{gcs_port}", workers,
                             _write_token(root))
        nodes.enter_context(_node(["--head", f"--port={gcs_port}", f"--num-cpus={head_cpus}", f"--temp-dir={temp_dir}",
                                   "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                   f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free_port()}",
                                   *_node_ports()], root / "head.log", cluster.token_file))
        _wait(lambda: cluster.jobs().list_jobs() is not None, "the job API", root)
        for i in range(len(workers)):
            _start_worker(nodes, cluster, i, root)
        yield cluster


def _start_worker(nodes: ExitStack, cluster: RayCluster, i: int, root: Path, attempts: int = 3) -> None:
    """Worker `i`, once registered with the head; one at a time, and started again if its `ray start` gives up
    (it waits a fixed 30 s for its raylet to register, which a loaded 2-core machine may exceed)."""
    node = cluster.workers[i]
    for attempt in range(attempts):
        proc = nodes.enter_context(_node([f"--address={cluster.gcs_address}", f"--num-cpus={node.cpus}",
                                          f"--resources={json.dumps(node.resources)}", f"--temp-dir={root / 'ray'}",
                                          *_node_ports()], root / f"worker-{i}-{attempt}.log",
                                         cluster.token_file))
        _wait(lambda p=proc: p.poll() is not None or len(cluster.node_ids()) == i + 2, f"worker node {i}", root)
        if proc.poll() is None:
            return
    raise RuntimeError(f"worker node {i} of the loopback Ray cluster did not start in {attempts} attempts "
                       f"(its logs: {root})")
