"""A capture replica: vLLM prefills a step's rollouts with its `extract_hidden_states` method, and its hidden-states
connector writes each one's hidden states to a directory that `vllm_connector.ingest_directory` reads.

The replica is started for the extraction stage and stopped after it, not borrowed from the fleet between steps:
a vLLM engine runs one speculative method, and the fleet's replicas run `eagle3` with the drafter, while capture
needs `extract_hidden_states` (which drafts nothing), prefix caching off (a cached prefix is not recomputed, so its
hidden states would be missing) and the step's policy, which the fleet may already have replaced by the next.
Borrowing a fleet replica would mean restarting it twice per step and serving nothing meanwhile.

Each rollout of the capture plan is sent whole as the prompt, with `max_tokens: 1` (the connector saves prompt
tokens only), `concurrency` at a time so that vLLM batches their prefills.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.rollouts import Rollout
from pipeline.serving.drivers import HiddenStatesCapture, ReplicaSpec, VllmCaptureDriver, VllmServer
from pipeline.serving.gates import GateError, wait_healthy
from pipeline.sources import vllm_connector

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Captured:
    """What a capture replica wrote, and what it cost."""

    names: dict[str, str]  # connector file name -> the sample id of the rollout it holds
    tokens: int  # prompt tokens prefilled
    bytes_written: int  # the connector's files, together
    start_s: float  # starting the replica, until /health answers
    capture_s: float  # from the first request until the last file is written

    def metadata(self) -> dict[str, int]:
        return {"capture_tokens": self.tokens, "capture_bytes_written": self.bytes_written,
                "capture_replica_start_ms": round(1000 * self.start_s), "capture_ms": round(1000 * self.capture_s)}


def capture(server: VllmServer, policy_dir: str, rollouts: list[Rollout], layer_ids: list[int], directory: Path,
            state_dir: Path, concurrency: int = 8) -> Captured:
    """Start a capture replica of the policy in `policy_dir`, have it write the hidden states of `layer_ids`
    (vLLM ids) of each of `rollouts` into `directory`, stop it. GateError when it does not start."""
    if not rollouts:
        return Captured({}, 0, 0, 0.0, 0.0)
    longest = max(len(r.input_ids) for r in rollouts)
    # Room for the longest prompt and its one sampled token, and no more: the KV cache holds more sequences.
    server = dataclasses.replace(server, max_model_len=longest + 1)
    driver = VllmCaptureDriver(server, HiddenStatesCapture(tuple(layer_ids), str(directory)), state_dir)
    replica = ReplicaSpec("capture", "127.0.0.1", _free_port())
    started = time.monotonic()
    driver.restart(replica, policy_dir, "")
    try:
        try:
            wait_healthy(replica, START_TIMEOUT_S, lambda: driver.alive(replica))
        except GateError as exc:
            log = driver.log_file(replica)
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            raise GateError(f"capture replica: {exc}; its log ends:\n{tail}") from None
        begun = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="capture") as pool:
            paths = list(pool.map(lambda r: vllm_connector.request_hidden_states(
                replica.url, replica.served_model_name, r.input_ids, timeout_s=REQUEST_TIMEOUT_S), rollouts))
        for path in paths:  # a response comes before its file is written: the writer holds the file's lock until then
            vllm_connector.wait_written(Path(path), REQUEST_TIMEOUT_S)
        done = time.monotonic()
    finally:
        driver.stop(replica)
    return Captured({Path(p).name: r.sample_id for p, r in zip(paths, rollouts, strict=True)},
                    sum(len(r.input_ids) for r in rollouts), sum(Path(p).stat().st_size for p in paths),
                    begun - started, done - begun)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
