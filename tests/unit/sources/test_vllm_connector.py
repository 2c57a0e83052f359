"""Source A: vLLM hidden-state connector files, in exactly the connector's layout.

vLLM cannot run here (CUDA only), so files are written by the test in the connector's
format, and `request_hidden_states` talks to a stand-in HTTP server that answers as vLLM's
/v1/completions does with the hidden-states connector.
"""

from __future__ import annotations

import fcntl
import json
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
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from pipeline.sources.vllm_connector import (
    ConnectorFileError,
    join_to_rollouts,
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


def test_join_picks_layers_and_matches_by_tokens(tmp_path: Path) -> None:
    hidden = torch.randn(5, 4, 8).to(torch.bfloat16)  # requested layers [5, 1, 3, 8]
    _connector_file(tmp_path / "a.safetensors", [4, 5, 6, 7, 8], hidden)
    _connector_file(tmp_path / "other-step.safetensors", [9, 9, 9], torch.zeros(3, 4, 8, dtype=torch.bfloat16))
    rollouts = [_rollout("r0", [1, 2, 3]), _rollout("r1", [4, 5, 6, 7, 8])]
    samples, unmatched = join_to_rollouts(sorted(tmp_path.glob("*.safetensors")), rollouts, 1, [5, 1, 3, 8], [1, 3, 8])
    assert [s.sample_id for s in samples] == ["r1"]
    assert [p.name for p in unmatched] == ["other-step.safetensors"]
    assert torch.equal(samples[0].hidden.view(torch.int16), hidden[:, 1:].view(torch.int16))
    assert samples[0].loss_mask.tolist() == [0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    ("tokens", "hidden_rows", "requested", "wanted", "message"),
    [
        ([4, 5, 6], 3, [1, 2], [1, 2], "match rollout 'r1' .* only up to the shorter length"),
        ([4, 5, 6, 7, 8], 4, [1, 2], [1, 2], "5 token ids but 4 hidden-state rows"),
        ([4, 5, 6, 7, 8], 5, [1, 2], [1, 3], r"layers \[3\] were not requested"),
        ([4, 5, 6, 7, 8], 5, [1, 2, 3], [1, 2], "2 layers, but 3 were requested"),
    ],
    ids=["prefix-caching-length", "rows-vs-tokens", "layer-not-requested", "layer-count"],
)
def test_bad_connector_files_are_refused(
    tmp_path: Path, tokens: list[int], hidden_rows: int, requested: list[int], wanted: list[int], message: str
) -> None:
    path = tmp_path / "bad.safetensors"
    save_file({"token_ids": torch.tensor(tokens), "hidden_states": torch.zeros(hidden_rows, 2, 8)}, str(path))
    with pytest.raises(ConnectorFileError, match=message):
        join_to_rollouts([path], [_rollout("r1", [4, 5, 6, 7, 8])], 1, requested, wanted)


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
    base = write_config(tmp_path, {"drafter": {"kind": kind}})
    cfg = load_config(base)
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    policy = target_lib.load_policy(store, read_policy_pointer(store, cfg.run, 1).checkpoint_uri)
    for i, r in enumerate(read_rollouts(store, cfg.run, 1)):  # stand-in for vLLM's connector
        layers = target_lib.forward(policy, torch.tensor([r.input_ids]), requested).layers[0]
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
