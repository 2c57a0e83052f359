"""The stand-in replica's continuous-batching engine (not vLLM), served in this process over loopback HTTP.

Concurrent completions decode in one batch, each at its own sampling parameters from its own seed; a request
that runs while the policy changes says so; a pause freezes the batch between rounds; and the batch size above
which rounds stop speculating follows from the rounds' timings (injected here: no timing is asserted).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from pipeline.evaluation import speculative
from pipeline.evaluation.rejection_sampler import RequestSampling
from pipeline.evaluation.scheduler import EXPLORE_EVERY, WINDOW, SpeculationThreshold, bucket
from pipeline.models import target as target_lib
from pipeline.sampling import GREEDY
from pipeline.serving import metrics as serving_metrics
from pipeline.serving.standin.replica import Replica, make_handler

K = 3


class Served:
    """A Replica behind its HTTP handler on a loopback port, in this process."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(replica, None, dev_mode=True))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def call(self, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(self.url + path, method="POST" if body is not None else "GET",
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read() or b"{}")

    def complete(self, prompt: list[int], max_tokens: int, **fields: object) -> dict:
        return self.call("/v1/completions", {"model": "policy", "prompt": prompt, "max_tokens": max_tokens,
                                             "return_token_ids": True, "logprobs": 1, **fields})

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            return response.read().decode()

    def wait_in_flight(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while self.call("/standin/requests")["in_flight"] < n:
            assert time.monotonic() < deadline, "the requests never reached the replica"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.replica.engine.close()


@pytest.fixture
def served(models: dict[str, str]) -> Iterator[Served]:
    s = Served(Replica(models["target"], models["v1"], K, "policy", speculation_max_batch=256))
    yield s
    s.close()


REQUESTS = [  # prompt, max_tokens, sampling fields (vLLM's names)
    ([1, 2, 3, 4], 14, {"temperature": 0}),
    ([5, 6, 7], 20, {"temperature": 1.0, "seed": 11}),
    ([8], 9, {"temperature": 0.7, "top_p": 0.9, "seed": 12}),
    ([9, 10, 11, 12, 13], 17, {"temperature": 1.2, "top_k": 5, "seed": 13}),
]


def test_concurrent_requests_decode_in_one_batch_each_reproducible_from_its_seed(
    served: Served, models: dict[str, str]
) -> None:
    """Four requests with their own parameters arrive while the replica is paused, so they join the batch at one
    round: fewer batched rounds than per-request drafts show they decoded together. Each then gets exactly the
    tokens and logprobs it gets alone from its seed; the greedy one is the target's greedy decoding."""
    served.call("/pause?mode=keep", {})
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = [pool.submit(served.complete, p, n, **f) for p, n, f in REQUESTS]
        served.wait_in_flight(len(REQUESTS))
        served.call("/resume", {})
        together = [f.result() for f in futures]
    counters = serving_metrics.parse(served.metrics())
    _, rounds = serving_metrics.read_standin(served.metrics())
    assert rounds["speculative"] < counters.drafts  # a round served several requests at once

    alone = [served.complete(p, n, **f) for p, n, f in REQUESTS]
    for (prompt, n, _), batched, single in zip(REQUESTS, together, alone, strict=True):
        choice = batched["choices"][0]
        assert choice["prompt_token_ids"] == prompt
        assert len(choice["token_ids"]) == n
        assert choice["finish_reason"] == "length"
        assert choice["token_ids"] == single["choices"][0]["token_ids"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            single["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert batched["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n,
                                    "total_tokens": len(prompt) + n}
        assert batched["standin"] == {"weight_version": None, "policy_version": "policy-target",
                                      "straddles_policy_update": False}
    target = target_lib.load_checkpoint(models["target"])
    assert together[0]["choices"][0]["token_ids"] == speculative.greedy_generate(target, torch.tensor([1, 2, 3, 4]), 14)
    other_seed = served.complete(REQUESTS[1][0], REQUESTS[1][1], temperature=1.0, seed=99)
    assert other_seed["choices"][0]["token_ids"] != together[1]["choices"][0]["token_ids"]


def test_requests_that_straddle_a_policy_update_say_so_and_a_pause_freezes_the_batch(
    served: Served, models: dict[str, str]
) -> None:
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(served.complete, [1, 2], 400, temperature=1.0, seed=5)
        deadline = time.monotonic() + 60
        while not serving_metrics.read_standin(served.metrics())[1].get("speculative"):
            assert time.monotonic() < deadline
            time.sleep(0.01)  # decoding
        served.call("/pause?mode=keep", {})
        frozen = serving_metrics.read_standin(served.metrics())[1]
        time.sleep(0.3)
        assert serving_metrics.read_standin(served.metrics())[1] == frozen  # no round while paused
        assert not running.done()
        served.call("/start_weight_update", {})
        served.call("/update_weights", {"update_info": {"path": str(Path(models["target2"][len("file://"):]))}})
        served.call("/finish_weight_update", {"weight_version": "policy-target2"})
        served.call("/resume", {})
        straddled = running.result()
    assert straddled["standin"] == {"weight_version": "policy-target2", "policy_version": "policy-target2",
                                    "straddles_policy_update": True}
    assert len(straddled["choices"][0]["token_ids"]) == 400  # held, then finished on the new policy
    after = served.complete([1, 2], 6, temperature=0)
    assert after["standin"]["straddles_policy_update"] is False
    target2 = target_lib.load_checkpoint(models["target2"])
    assert after["choices"][0]["token_ids"] == speculative.greedy_generate(target2, torch.tensor([1, 2]), 6)


@pytest.mark.reliability("bad_input", "a completion request whose seed or temperature has 400 digits, or whose top_p "
                                      "is 0 in float32 (1e-300): answered 400 naming the field")
def test_stop_tokens_and_bad_requests(served: Served) -> None:
    greedy = served.complete([3, 4, 5], 12, temperature=0)["choices"][0]["token_ids"]
    stopped = served.complete([3, 4, 5], 12, temperature=0, stop_token_ids=[greedy[4]])["choices"][0]
    assert stopped["token_ids"] == greedy[: greedy.index(greedy[4]) + 1]
    assert stopped["finish_reason"] == "stop"
    for fields, message in (({"temperature": -1}, "sampling.temperature"), ({"logprobs": 5}, "logprobs"),
                            ({"prompt": [1, 999]}, "token ids in"), ({"n": 2}, "n = 1"),
                            ({"seed": "x"}, "seed"), ({"seed": 10**400}, "seed"),
                            ({"temperature": 10**400}, "sampling.temperature"), ({"top_p": 1e-300}, "sampling.top_p")):
        body = {"model": "policy", "prompt": [1, 2], "max_tokens": 4, **fields}
        with pytest.raises(urllib.error.HTTPError) as refused:
            served.call("/v1/completions", body)
        assert refused.value.code == 400
        error = json.loads(refused.value.read())["error"]  # vLLM's ErrorResponse
        assert (error["type"], error["code"]) == ("BadRequestError", 400)
        assert message in error["message"]


@pytest.mark.reliability("bad_input", "stand-in replica: requests that end at their first token (max_tokens 1, "
                         "a first token in stop_token_ids) while others decode: each answers 200, none of the others "
                         "fails")
def test_requests_done_at_their_first_token_answer_and_leave_the_batch_decoding(served: Served) -> None:
    first = served.complete([3, 4, 5], 1, temperature=0)["choices"][0]
    assert (len(first["token_ids"]), first["finish_reason"]) == (1, "length")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(served.complete, [1, 2], 200, temperature=1.0, seed=5)
        served.wait_in_flight(1)
        for _ in range(3):
            one = served.complete([3, 4, 5], 1, temperature=0)["choices"][0]
            assert one["token_ids"] == first["token_ids"]
            stopped = served.complete([3, 4, 5], 12, temperature=0, stop_token_ids=first["token_ids"])["choices"][0]
            assert (stopped["token_ids"], stopped["finish_reason"]) == (first["token_ids"], "stop")
        long = running.result()["choices"][0]
    assert (len(long["token_ids"]), long["finish_reason"]) == (200, "length")
    assert served.call("/standin/requests")["failed"] == 0


@pytest.mark.reliability("fault", "stand-in engine: a request whose prefill fails (here a token the embedding does "
                         "not have) joins with others while a batch decodes: it alone gets the error")
def test_a_prefill_that_fails_fails_its_own_request_alone(served: Served) -> None:
    engine = served.replica.engine

    def request(prompt: list[int], max_tokens: int) -> speculative.Request:
        return speculative.Request(torch.tensor(prompt), max_tokens, RequestSampling.seeded(GREEDY, 0))

    engine.pause()
    running = engine.submit(request([1, 2], 30))
    engine.resume()
    while not serving_metrics.read_standin(served.metrics())[1]:
        time.sleep(0.01)  # the running request has its round
    engine.pause()
    broken, beside = engine.submit(request([1, 10_000], 4)), engine.submit(request([3, 4], 6))
    engine.resume()
    with pytest.raises(IndexError):
        broken.result(timeout=60)
    assert len(beside.result(timeout=60).tokens) == 6
    assert len(running.result(timeout=60).tokens) == 30


# -- the speculation threshold, on injected timings ---------------------------------------------------------------


def _measured(speculative_s: dict[int, float], plain_s: dict[int, float], tau: float) -> SpeculationThreshold:
    threshold = SpeculationThreshold()
    for b, seconds in speculative_s.items():
        threshold.record(b, True, seconds, tau)
    for b, seconds in plain_s.items():
        threshold.record(b, False, seconds)
    return threshold


def test_rounds_speculate_up_to_the_largest_batch_where_a_speculative_round_pays() -> None:
    """tau 2.5 tokens a speculative round, a plain round 1 s: speculation pays where a speculative round takes
    under 2.5 s, at batches of 1 to 8 here, not at 32."""
    threshold = _measured({1: 1.5, 8: 2.0, 32: 4.0}, {1: 1.0, 8: 1.0, 32: 1.0}, tau=2.5)
    assert threshold.threshold == 8
    assert [threshold.speculate(b) for b in (1, 5, 8)] == [True, True, True]
    assert threshold.speculate(20) is False  # bucket 32: measured, does not pay
    assert threshold.speculate(12) is True  # bucket 16: never timed speculating, so it does
    threshold.record(12, True, 3.0, 2.5)
    assert threshold.speculate(12) is False  # and never timed plain: now it runs plain
    threshold.record(12, False, 1.0)
    assert threshold.threshold == 8  # 16 does not pay either

    # A better drafter (tau 5) pays everywhere; a worse one (1.2) nowhere.
    assert _measured({1: 1.5, 8: 2.0, 32: 4.0}, {1: 1.0, 8: 1.0, 32: 1.0}, tau=5.0).threshold == 32
    assert _measured({1: 1.5, 8: 2.0, 32: 4.0}, {1: 1.0, 8: 1.0, 32: 1.0}, tau=1.2).threshold == 0


def test_a_batch_where_speculation_pays_speculates_though_a_lone_row_does_not() -> None:
    """A CPU's shape (measured with SmolLM2 on 2 cores): one row's 5-token verification costs 1.8 one-token forwards,
    4 rows' 1.6 at a higher one-token price; at tau 2 speculation pays at bucket 4 and 8, not at 1."""
    threshold = _measured({1: 2.2, 4: 1.7, 8: 1.8}, {1: 1.0, 4: 1.0, 8: 1.0}, tau=2.0)
    assert [threshold.speculate(b) for b in (1, 3, 4, 8)] == [False, True, True, True]
    assert threshold.threshold == 8
    assert _measured({1: 2.2, 4: 2.1}, {1: 1.0, 4: 1.0}, tau=2.0).threshold == 0


def test_both_kinds_of_round_stay_measured_and_new_weights_are_measured_again() -> None:
    threshold = _measured({32: 4.0}, {32: 1.0}, tau=2.5)
    decisions = [threshold.speculate(32) for _ in range(4 * EXPLORE_EVERY)]
    assert sum(decisions) == 4  # off at 32, but every EXPLORE_EVERY-th round speculates to measure again
    threshold.forget_acceptance()  # a new drafter or policy: its acceptance is unknown
    assert threshold.speculate(32) is True
    threshold.record(32, True, 4.0, 4.5)  # it accepts more: speculating pays at 32 now
    assert threshold.threshold == 32


def test_a_disturbed_round_does_not_turn_speculation_off() -> None:
    """Other work on the machine only adds time to a round: a bucket's cost is its fastest recent round, so one
    slow speculative round (4 s, where 1.5 s pays at tau 2.5) leaves speculation on, and a bucket whose every
    recent round is slow turns it off."""
    threshold = _measured({8: 1.5}, {8: 1.0}, tau=2.5)
    threshold.record(8, True, 4.0, 2.5)
    assert threshold.threshold == 8
    for _ in range(WINDOW):
        threshold.record(8, True, 4.0, 2.5)
    assert threshold.threshold == 0


def test_a_fixed_threshold_is_not_measured() -> None:
    threshold = SpeculationThreshold(fixed=4)
    threshold.record(2, True, 100.0, 1.0)
    assert [threshold.speculate(b) for b in (1, 4, 5)] == [True, True, False]
    assert threshold.threshold == 4
    assert [bucket(b) for b in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]
