"""A Ray cluster on loopback, for the tests and the benchmarks of `launch.launcher: ray`: a head (with the dashboard,
whose job API takes Ray jobs) and worker nodes, each with its own CPUs and custom resources, started by Ray's own
CLI (`ray start --block`, one process per node, its node's processes under it) in a temp dir of its own, and
stopped node by node: never `ray stop`, which stops every Ray process on the machine, another user's cluster
included."""

from __future__ import annotations

import json
import os
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

RAY = str(Path(sys.executable).with_name("ray"))  # the CLI of this environment's Ray, which the jobs run
START_TIMEOUT_S = 120.0  # a node's start on a loaded 2-core machine takes 5-20 s


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

    def node_ids(self) -> dict[str, str]:
        """Each alive node's id by the first custom resource its test gave it ("head" for the head)."""
        from ray.util.state import list_nodes

        names = [next(iter(node.resources), f"worker-{i}") for i, node in enumerate(self.workers)]
        ids = {}
        for node in list_nodes(address=self.address, detail=True):
            if node.state == "ALIVE":
                ids[next((n for n in names if n in node.resources_total), "head")] = node.node_id
        return ids


def _node_ports() -> list[str]:
    """Ports of their own for a node's agents: the defaults are fixed, and clash between nodes on one machine."""
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            "--object-store-memory=78643200"]  # 75 MiB, Ray's least: the stages pass nothing through Ray's objects


@contextmanager
def _node(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("w") as out:
        proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
                                 *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
    from ray.job_submission import JobSubmissionClient

    # A short root: Ray's unix sockets live under it, and a socket's path holds at most 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    gcs_port, dashboard_port = free_port(), free_port()
    cluster = RayCluster(f"http://127.0.0.1:{dashboard_port}", f"127.0.0.1:{gcs_port}", workers)
    with ExitStack() as nodes:
        nodes.callback(shutil.rmtree, root, ignore_errors=True)
        nodes.enter_context(_node(["--head", f"--port={gcs_port}", f"--num-cpus={head_cpus}", f"--temp-dir={root}",
                                   "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                   f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free_port()}",
                                   *_node_ports()], root / "head.log"))
        _wait(lambda: JobSubmissionClient(cluster.address).list_jobs() is not None, "the job API", root)
        for i in range(len(workers)):
            _start_worker(nodes, cluster, i, root)
        yield cluster


def _start_worker(nodes: ExitStack, cluster: RayCluster, i: int, root: Path, attempts: int = 3) -> None:
    """Worker `i`, once registered with the head; one at a time, and started again if its `ray start` gives up
    (it waits a fixed 30 s for its raylet to register, which a loaded 2-core machine may exceed)."""
    node = cluster.workers[i]
    for attempt in range(attempts):
        proc = nodes.enter_context(_node([f"--address={cluster.gcs_address}", f"--num-cpus={node.cpus}",
                                          f"--resources={json.dumps(node.resources)}", f"--temp-dir={root}",
                                          *_node_ports()], root / f"worker-{i}-{attempt}.log"))
        _wait(lambda p=proc: p.poll() is not None or len(cluster.node_ids()) == i + 2, f"worker node {i}", root)
        if proc.poll() is None:
            return
    raise RuntimeError(f"worker node {i} of the loopback Ray cluster did not start in {attempts} attempts "
                       f"(its logs: {root})")
