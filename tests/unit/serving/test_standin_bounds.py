"""A stand-in replica process under clients that ask too much or go away, over real HTTP on loopback: one client
must not stall or fail the others.

A request beyond the policy's context (a 20,000-token prompt among them) is refused with vLLM's 400 before it is
admitted, while a request decoding beside it finishes; a client that disconnects stops its request's decoding; a
burst of 200 connections at once is answered, none reset.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.serving import metrics as serving_metrics
from tests.unit.serving.conftest import free_port

ROOT = Path(__file__).resolve().parents[3]
CONTEXT = 2048  # the tiny target's max_position_embeddings
BURST = 200


class Process:
    """`python -m pipeline.serving.standin.replica` on a loopback port, stopped at the end."""

    def __init__(self, models: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "pipeline.serving.standin.replica", "--port", str(self.port),
                "--target", models["target"], "--drafter", models["v1"], "--num-speculative-tokens", "3",
                "--speculation-max-batch", "256"]
        self.log = log.open("wb")
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "the stand-in never became healthy"
                time.sleep(0.2)

    def call(self, path: str, body: dict | None = None, timeout: float = 120) -> dict:
        request = urllib.request.Request(self.url + path, method="POST" if body is not None else "GET",
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")

    def complete(self, prompt: list[int], max_tokens: int, **fields: object) -> dict:
        return self.call("/v1/completions", {"model": "policy", "prompt": prompt, "max_tokens": max_tokens,
                                             "return_token_ids": True, **fields})

    def counts(self) -> dict:
        return self.call("/standin/requests")

    def rounds(self) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            return sum(serving_metrics.read_standin(response.read().decode())[1].values())

    def wait(self, condition, what: str, seconds: float = 60) -> None:  # noqa: ANN001
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture
def replica(models: dict[str, str], tmp_path: Path) -> Iterator[Process]:
    process = Process(models, tmp_path / "replica.log")
    yield process
    process.close()


@pytest.mark.reliability("bad_input", "stand-in replica process: prompt plus max_tokens beyond the policy's context, "
                         "and a 20,000-token prompt: 400 in vLLM's error shape before admission, a request decoding "
                         "beside them finishes")
def test_requests_beyond_the_context_are_refused_with_vllms_400_and_the_batch_decodes_on(replica: Process) -> None:
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(replica.complete, [1, 2], 600, temperature=1.0, seed=3)
        replica.wait(lambda: replica.counts()["in_flight"] == 1, "the running request never arrived")
        for prompt, max_tokens, says in (
            ([1] * 2000, 100, "'max_tokens' or 'max_completion_tokens' is too large: 100"),
            ([1] * 20_000, 16, "your request has 20000 input tokens"),
            ([1] * CONTEXT, 1, f"maximum context length is {CONTEXT} tokens"),
        ):
            with pytest.raises(urllib.error.HTTPError) as refused:
                replica.complete(prompt, max_tokens)
            assert refused.value.code == 400
            error = json.loads(refused.value.read())
            assert error == {"error": {"message": error["error"]["message"], "type": "BadRequestError",
                                       "param": None, "code": 400}}
            assert says in error["error"]["message"]
        fits = replica.complete([1] * 2000, CONTEXT - 2000, temperature=0)["choices"][0]
        assert len(fits["token_ids"]) == CONTEXT - 2000
        decoded = running.result()["choices"][0]
    assert (len(decoded["token_ids"]), decoded["finish_reason"]) == (600, "length")
    assert replica.counts()["failed"] == 0


@pytest.mark.reliability("fault", "stand-in replica process: a client disconnects while its request decodes: the "
                         "request stops decoding (cancelled), the replica serves the next")
def test_a_request_whose_client_disconnects_stops_decoding(replica: Process) -> None:
    body = json.dumps({"model": "policy", "prompt": [1, 2], "max_tokens": CONTEXT - 2, "temperature": 1.0}).encode()
    client = socket.create_connection(("127.0.0.1", replica.port), timeout=30)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    replica.wait(lambda: replica.rounds() >= 3, "the request never decoded")
    client.close()
    replica.wait(lambda: replica.counts()["cancelled"] == 1, "the request went on decoding after its client left")
    counts = replica.counts()
    assert (counts["in_flight"], counts["completed"], counts["failed"]) == (0, 0, 0)
    after = replica.rounds()
    assert after < CONTEXT - 2  # it stopped well before its max_tokens
    nxt = replica.complete([3, 4], 5, temperature=0)["choices"][0]
    assert len(nxt["token_ids"]) == 5


@pytest.mark.reliability("fault", "stand-in replica process: 200 clients connect at once: every one answered, "
                         "none reset (the listen backlog holds the burst)")
def test_a_burst_of_connections_is_answered_every_one(replica: Process) -> None:
    start = threading.Barrier(BURST)
    body = json.dumps({"model": "policy", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})

    def one(_: int) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", replica.port, timeout=120)
        start.wait(timeout=60)
        try:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            return connection.getresponse().status
        except OSError as exc:
            return -1 if isinstance(exc, ConnectionResetError) else -2
        finally:
            connection.close()

    with ThreadPoolExecutor(BURST) as pool:
        statuses = list(pool.map(one, range(BURST)))
    assert statuses == [200] * BURST, {s: statuses.count(s) for s in set(statuses)}
