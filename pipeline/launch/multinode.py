"""A drafter training on several nodes: torchrun's c10d rendezvous, in production an indexed Job of pods behind a
headless Service, on one machine that many torchrun agents on loopback.

    orchestrator (Dagster step)                 training process(es), on each of N nodes
    drafter asset ── Pipes ──> torchrun --nnodes=N --nproc-per-node=M --rdzv-backend=c10d -m pipeline.training.worker
                                 ├── rank 0 (node 0): trains its share, reports back through Pipes, registers
                                 └── rank 1..NxM-1: train their shares

`launch.training.nnodes` = N > 1: one torchrun agent per node, joined by the c10d rendezvous on node 0, N x M
ranks in all (one node is `pipeline.launch.process`'s: its worker, or torchrun `--standalone`). In production the
nodes are the pods of an indexed Kubernetes Job, found through a headless Service (`training_job_spec`,
`training_service_spec`); on one machine (`launch.launcher: subprocess`) they are N agents on loopback, started
by `python -m pipeline.launch.multinode` (`run_local_nodes`), for tests and trials. `--max-restarts=0`: a node
or rank that dies fails the whole training at once, and Dagster's retry resumes it from its last checkpoint on
a fresh set of nodes. All are pure functions of the pipeline config, so the Dagster layer (the indexed Job of
`resources/launcher.py`) and the tests build exactly the same thing.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
import uuid

from pipeline.config import PipelineConfig
from pipeline.launch.process import LOOPBACK_NODES_MODULE, pod_labels, stage_pod_spec
from pipeline.stages import TRAINING

RDZV_TIMEOUT_S = 1200  # pods of one Job may start minutes apart while GPU nodes scale up (as the run monitor waits)
NODE_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def torchrun_command(nproc_per_node: int, python: str, nnodes: int, rdzv_endpoint: str, rdzv_id: str,
                     local_addr: str = "", is_host: bool | None = None) -> list[str]:
    """torchrun on one of `nnodes` nodes, one worker process per GPU: the c10d rendezvous at `rdzv_endpoint` (node 0
    serves it), `rdzv_id` naming this training; `local_addr` is how the others reach this node, and orders the
    nodes (ranks go to nodes sorted by it: node 0 gets rank 0). `is_host`: whether this agent serves the rendezvous;
    unset, torchrun decides by whether the endpoint names this machine, which an address the machine's hostname does
    not resolve to (a Ray node's) never does."""
    if nproc_per_node < 1 or nnodes < 2:
        raise ValueError(f"several nodes of at least one rank each, got {nnodes} x {nproc_per_node}")
    if not (rdzv_endpoint and rdzv_id):
        raise ValueError("several nodes need a rendezvous endpoint and id")
    return [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=join_timeout={RDZV_TIMEOUT_S},read_timeout={RDZV_TIMEOUT_S}"
            + ("" if is_host is None else f",is_host={int(is_host)}"), "--max-restarts=0",
            *([f"--local-addr={local_addr}"] if local_addr else []), "-m", TRAINING.worker]


def run_local_nodes(nnodes: int, nproc_per_node: int, python: str = sys.executable, poll_s: float = 0.2) -> int:
    """`nnodes` torchrun agents on this machine, each a node of one c10d rendezvous on loopback: the
    multi-node path on one machine. Returns the first failing agent's exit code after stopping the
    others (a dead node fails the training, as a failed pod fails its Job), else 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = torchrun_command(nproc_per_node, python, nnodes, f"127.0.0.1:{port}", uuid.uuid4().hex)
    agents = [subprocess.Popen(command) for _ in range(nnodes)]

    def stop(*_: object) -> None:
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()  # torchrun's agent passes SIGTERM to its workers
        for agent in agents:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()

    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))
    while True:
        codes = [agent.poll() for agent in agents]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is not None:
            stop()
            return failed
        if all(code == 0 for code in codes):
            return 0
        time.sleep(poll_s)


# -- an indexed Job and its headless Service


def training_job_name(run_id: str) -> str:
    """The Job (and Service) of one Dagster run's training: a DNS label short enough that its pods'
    hostnames (`<name>-<index>`) stay within 63 characters."""
    return f"drafter-train-{run_id.replace('-', '')[:12]}"


def _job_labels(cfg: PipelineConfig, step: int, name: str) -> dict[str, str]:
    return {**pod_labels(cfg, TRAINING, step), "drafter-cotraining/training-job": name}


def training_service_spec(cfg: PipelineConfig, name: str, step: int) -> dict:
    """The headless Service that gives each pod of the Job a DNS name, `<name>-<index>.<name>`:
    node 0's is the rendezvous endpoint. Addresses are published before the pods are ready, so
    the rendezvous can form while the pods start."""
    port = cfg.launch.training.rdzv_port
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": pod_labels(cfg, TRAINING, step)},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {"drafter-cotraining/training-job": name},
                 "ports": [{"name": "c10d", "port": port, "targetPort": port}]},
    }


def training_job_spec(cfg: PipelineConfig, name: str, step: int, env: dict[str, str]) -> dict:
    """The indexed Job of a training on `launch.training.nnodes` nodes: one pod per node (the training's pod,
    with `launch.training.nproc` GPUs), torchrun's c10d rendezvous at node 0, `env` (Dagster Pipes'
    bootstrap variables) in every pod. Rank 0 runs on node 0, whose log carries the Pipes messages.
    `backoffLimit: 0`: one failed pod fails the Job, whose other pods Kubernetes then stops; the
    retry is Dagster's, and resumes from the last checkpoint."""
    training = cfg.launch.training
    nnodes, port = training.nnodes, training.rdzv_port
    pod = stage_pod_spec(cfg, TRAINING)
    container = pod["containers"][0]
    container["command"] = torchrun_command(training.nproc, "python", nnodes, f"{name}-0.{name}:{port}", name,
                                            local_addr="$(NODE_ADDR)")
    container["env"] = [
        {"name": "NODE_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{NODE_INDEX_ANNOTATION}']"}}},
        {"name": "NODE_ADDR", "value": f"{name}-$(NODE_INDEX).{name}"},  # this pod's name in the Service
        *({"name": k, "value": v} for k, v in env.items()),
    ]
    container["ports"] = [{"name": "c10d", "containerPort": port}]
    pod["subdomain"] = name
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": _job_labels(cfg, step, name)},
        "spec": {
            "completionMode": "Indexed", "completions": nnodes, "parallelism": nnodes, "backoffLimit": 0,
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": _job_labels(cfg, step, name)}, "spec": pod},
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {LOOPBACK_NODES_MODULE}",
                                     description="Several torchrun nodes on this machine (loopback rendezvous).")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    args = parser.parse_args(argv)
    sys.exit(run_local_nodes(args.nnodes, args.nproc_per_node))


if __name__ == "__main__":
    main()
