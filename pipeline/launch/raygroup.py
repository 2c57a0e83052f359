"""A training on several nodes inside one Ray job (`launch.launcher: ray`, `launch.training.nnodes` > 1): a
placement group of one bundle per node, a torchrun agent in each bundle, joined by torchrun's c10d rendezvous at
bundle 0's node.

    Ray job: this module, its driver (it asks for no resources itself)
      placement group of N bundles, each one node's share (`launch.training`: CPUs, memory, a GPU per rank,
      `launch.ray.resources`), placed by `launch.ray.placement_strategy`
        ├── bundle 0: torchrun --nnodes=N --rdzv-endpoint=<its node>:<port> (is_host=1) ... -m pipeline.training.worker
        └── bundle i: the same agent, on a node of its own (STRICT_SPREAD) or beside the others (PACK)

Ray reserves a group's bundles all at once, so the training never starts on part of its nodes: it waits for the
whole group, never preempting what holds the resources. The driver copies every agent's output into the job's log
line by line, unprefixed (Ray prefixes what a task prints itself), so rank 0's Pipes messages reach Dagster as a
one-node job's do. An agent that fails (a rank killed, a node lost) fails the job with its exit code once the group
is removed, which ends the other agents: `--max-restarts=0`, as for pods; the retry is Dagster's. Each agent dies
with the Ray worker that runs it (PR_SET_PDEATHSIG), so a stopped job leaves no torchrun behind.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.launch.multinode import torchrun_command

MODULE = "pipeline.launch.raygroup"
STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")  # Ray's placement group strategies
LOCAL_ADDR = "{node_addr}"  # in the agents' command: each agent's own node address, known only on its node
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class NodeGroup:
    """A training's nodes as a placement group: `nnodes` bundles of `bundle` (Ray resource names: CPU, GPU,
    memory in bytes, custom), `nproc_per_node` ranks in each."""

    nnodes: int
    nproc_per_node: int
    bundle: dict[str, float]
    strategy: str = "STRICT_SPREAD"

    def __post_init__(self) -> None:
        if self.nnodes < 2 or self.nproc_per_node < 1:
            raise ValueError(f"a group of several nodes of at least one rank each, got {self.nnodes} x "
                             f"{self.nproc_per_node}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")

    def driver_command(self, python: str, cwd: str) -> list[str]:
        """The Ray job's entrypoint: this module's driver for the group; `cwd`: where the agents run (the project
        directory on a cluster sharing this machine's filesystem), empty for their task's own (its working_dir)."""
        return [python, "-m", MODULE, f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}",
                f"--bundle={json.dumps(self.bundle, sort_keys=True)}", f"--strategy={self.strategy}",
                f"--cwd={cwd}"]

    def task_options(self) -> dict:
        """One bundle's resources as a Ray task's options: an agent holds all of its bundle (its GPUs become the
        task's CUDA_VISIBLE_DEVICES, which its ranks inherit)."""
        named = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}
        options = {named[k]: v for k, v in self.bundle.items() if k in named and v}
        custom = {k: v for k, v in self.bundle.items() if k not in named}
        return {"num_cpus": 0, **options, **({"resources": custom} if custom else {})}


class AgentFailed(RuntimeError):
    """A node's torchrun agent exited non-zero (`code`)."""

    def __init__(self, node: int, code: int) -> None:
        super().__init__(node, code)  # its arguments: how Ray rebuilds it in the driver
        self.node, self.code = node, code

    def __str__(self) -> str:
        return f"training node {self.node}: torchrun exited with {self.code}"


# -- what runs in the group's bundles (standard library and Ray only: a Ray worker runs it)


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # torchrun ends its ranks on it


def rendezvous_endpoint() -> str:
    """`<this node's address>:<a free port>`, found on bundle 0's node, where its agent serves the rendezvous."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def run_agent(node: int, command: list[str], cwd: str) -> Iterator[str]:
    """One node's torchrun agent, `LOCAL_ADDR` in its command this node's address, its output line by line;
    raises AgentFailed."""
    import ray

    here = ray.util.get_node_ip_address()
    yield f"training node {node} on Ray node {ray.get_runtime_context().get_node_id()} ({here})\n"
    with subprocess.Popen([arg.replace(LOCAL_ADDR, here) for arg in command], cwd=cwd or None, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its lines as they are written
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent) as agent:
        for line in agent.stdout:  # noqa: UP028 - Ray drives a generator task with send(), which a file lacks
            yield line
    if agent.returncode:
        raise AgentFailed(node, agent.returncode)


# -- the driver


def run_group(group: NodeGroup, cwd: str, python: str = sys.executable) -> int:
    """Reserve the group, start an agent in every bundle and copy their output to stdout; the first failing agent's
    exit code (the group removed, which ends the rest), else 0."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init()  # the job's cluster; the driver runs as `python -m`, so Ray ships the agents' code with their tasks
    pg = placement_group([dict(group.bundle)] * group.nnodes, strategy=group.strategy)
    _say(f"waiting for {group.nnodes} bundles of {group.bundle} ({group.strategy})")
    ray.get(pg.ready())
    in_bundle = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(group.nnodes)]
    endpoint = ray.get(ray.remote(rendezvous_endpoint).options(num_cpus=0, scheduling_strategy=in_bundle[0]).remote())
    rdzv_id = uuid.uuid4().hex
    agent = ray.remote(max_retries=0)(run_agent)  # a failed node fails the attempt: the retry is Dagster's
    streams = [agent.options(name=f"training-node-{i}", scheduling_strategy=in_bundle[i], **group.task_options())
               .remote(i, torchrun_command(group.nproc_per_node, python, group.nnodes, endpoint, rdzv_id, LOCAL_ADDR,
                                           is_host=i == 0), cwd)
               for i in range(group.nnodes)]
    ended: queue.Queue[tuple[int, int]] = queue.Queue()
    lock = threading.Lock()

    def copy(node: int, stream) -> None:  # noqa: ANN001 (Ray's ObjectRefGenerator)
        code = 0
        try:
            for ref in stream:
                line = ray.get(ref)
                with lock:
                    sys.stdout.write(line)
                    sys.stdout.flush()
        except ray.exceptions.RayTaskError as error:
            code = getattr(error.cause, "code", 1)  # AgentFailed's
            _say(f"training node {node} failed: {error.cause or error}")
        except ray.exceptions.RayError as error:  # its worker or node lost
            code = 1
            _say(f"training node {node} lost: {error}")
        ended.put((node, code))

    for i, stream in enumerate(streams):
        threading.Thread(target=copy, args=(i, stream), daemon=True).start()
    for _ in streams:
        _, code = ended.get()
        if code:
            remove_placement_group(pg)  # kills the other agents' tasks, and their torchrun with them
            return code
    remove_placement_group(pg)
    return 0


def _say(line: str) -> None:
    sys.stderr.write(f"[{MODULE}] {line}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                     description="A training's nodes as a Ray placement group (a Ray job's driver).")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--bundle", type=json.loads, required=True, help="one node's Ray resources, JSON")
    parser.add_argument("--strategy", choices=STRATEGIES, default="STRICT_SPREAD")
    parser.add_argument("--cwd", default=str(Path.cwd()), help="where the agents run; empty: their task's own")
    args = parser.parse_args(argv)
    sys.exit(run_group(NodeGroup(args.nnodes, args.nproc_per_node, args.bundle, args.strategy), args.cwd))


if __name__ == "__main__":
    main()
