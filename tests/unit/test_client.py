"""The trainer-side client (pipeline.client): what it writes the pipeline reads unchanged; what the
pipeline would refuse, it refuses first, with nothing written and nothing stored changed."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from pipeline.client import Rollout, RolloutsError, publish_checkpoint, publish_step, stage_checkpoint
from pipeline.data.keys import policy_prefix
from pipeline.data.rollouts import TargetLimits, is_committed, read_policy_pointer, read_rollouts
from pipeline.data.store import ObjectStore
from pipeline.models import target as target_lib
from tests.support.contract_cases import BAD, BAD_CALLER_ROLLOUTS, BAD_ROLLOUTS, LIMITS, ok, refused_by_the_client
from tests.support.targets import tiny_target

RUN, STEP = "r", 3
ROOT = Path(__file__).resolve().parents[2]


def stored_files(store: ObjectStore) -> dict[str, bytes]:
    return {key: store.read_bytes(key) for key, _, _ in store.list_files("")}


def fake_checkpoint(directory: Path, vocab_size: int = LIMITS.vocab_size, max_positions: int = 8) -> Path:
    """config.json + a small safetensors file: what the client checks (the pipeline loads real ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"vocab_size": vocab_size,
                                                       "max_position_embeddings": max_positions}))
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(directory / "model.safetensors"))
    return directory


def group(n: int = 4) -> list[Rollout]:
    """A GRPO group: one prompt, identical completions included."""
    return [Rollout.from_prompt_and_response(f"s3-{i}", [5, 6], [7, 8] if i < 2 else [9], 0.5 * i, 2)
            for i in range(n)]


def test_round_trip_reads_back_unchanged(store: ObjectStore, tmp_path: Path) -> None:
    model = tiny_target(32, 16, 1, 2)
    staged = publish_checkpoint(model, tmp_path / "staging")
    items = group()

    published = publish_step(store, RUN, STEP, items, staged, policy_version=2, model_id="tiny",
                             tokenizer_vocab_size=30)

    assert published.written
    assert read_rollouts(store, RUN, STEP, TargetLimits.of(model.config)) == items
    assert [r.loss_mask for r in items[:3]] == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1]]
    pointer = read_policy_pointer(store, RUN, STEP)
    assert (pointer.policy_version, pointer.model_id, pointer.checkpoint_uri) == (2, "tiny", policy_prefix(RUN, STEP))
    loaded = target_lib.load_policy(store, pointer.checkpoint_uri)
    ids = torch.tensor([items[0].input_ids])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_sharded_checkpoint_is_published_with_its_index(store: ObjectStore, tmp_path: Path) -> None:
    model = tiny_target(32, 16, 2, 2)
    staged = publish_checkpoint(model, tmp_path / "staging", max_shard_size=20_000)

    publish_step(store, RUN, STEP, group(), staged, policy_version=2, model_id="tiny")

    names = {key.rsplit("/", 1)[-1] for key, _, _ in store.list_files(policy_prefix(RUN, STEP))}
    assert "model.safetensors.index.json" in names
    assert len([n for n in names if n.startswith("model-")]) > 1
    assert names == set(staged.files)
    loaded = target_lib.load_policy(store, policy_prefix(RUN, STEP))  # the pipeline reads the shards
    ids = torch.tensor([group()[0].input_ids])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_publish_writes_policy_json_last(store: ObjectStore, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    order: list[str] = []
    write = ObjectStore.open_write

    def recording(self, key):  # noqa: ANN001, ANN202
        order.append(key.rsplit("/", 1)[-1])
        return write(self, key)

    monkeypatch.setattr(ObjectStore, "open_write", recording)
    publish_step(store, RUN, STEP, group(), fake_checkpoint(tmp_path / "ckpt"), policy_version=2, model_id="m")
    assert order == ["rollouts.parquet", "config.json", "model.safetensors", "policy.json"]


def test_same_step_twice_with_the_same_content_is_a_no_op(store: ObjectStore, tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    publish_step(store, RUN, STEP, group(), ckpt, policy_version=2, model_id="m")
    before = stored_files(store)

    again = publish_step(store, RUN, STEP, group(), ckpt, policy_version=2, model_id="m")

    assert not again.written
    assert stored_files(store) == before


def _other_reward(items: list[Rollout], ckpt: Path) -> tuple[list[Rollout], Path, dict]:
    return [replace(items[0], reward=9.0), *items[1:]], ckpt, {}


def _other_tokens(items: list[Rollout], ckpt: Path) -> tuple[list[Rollout], Path, dict]:
    return [*items[:-1], replace(items[-1], input_ids=[5, 6, 8])], ckpt, {}


def _one_sample_less(items: list[Rollout], ckpt: Path) -> tuple[list[Rollout], Path, dict]:
    return items[:-1], ckpt, {}


def _other_version(items: list[Rollout], ckpt: Path) -> tuple[list[Rollout], Path, dict]:
    return items, ckpt, {"policy_version": 7}


def _other_weights(items: list[Rollout], ckpt: Path) -> tuple[list[Rollout], Path, dict]:
    save_file({"w": np.ones((2, 3), dtype=np.float32)}, str(ckpt / "model.safetensors"))
    return items, ckpt, {}


@pytest.mark.parametrize(
    ("change", "sample", "field"),
    [
        pytest.param(_other_reward, "s3-0", "reward", id="reward"),
        pytest.param(_other_tokens, "s3-3", "input_ids", id="tokens"),
        pytest.param(_one_sample_less, "s3-3", "sample_id", id="fewer-samples"),
        pytest.param(_other_version, None, "policy_version", id="policy-version"),
        pytest.param(_other_weights, None, "checkpoint", id="weights"),
    ],
)
@pytest.mark.reliability("bad_input", "second, different publication of a committed step (client)")
def test_second_different_publication_is_refused_and_changes_nothing(
    store: ObjectStore, tmp_path: Path, change, sample: str | None, field: str  # noqa: ANN001
) -> None:
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    publish_step(store, RUN, STEP, group(), ckpt, policy_version=2, model_id="m")
    before = stored_files(store)
    items, ckpt, kwargs = change(group(), ckpt)

    with pytest.raises(RolloutsError, match="already committed") as excinfo:
        publish_step(store, RUN, STEP, items, ckpt, **{"policy_version": 2, "model_id": "m", **kwargs})

    assert "step-000003" in str(excinfo.value)
    assert (excinfo.value.sample, excinfo.value.field) == (sample, field)
    assert stored_files(store) == before


@pytest.mark.parametrize(("items", "sample", "field", "message"),
                         refused_by_the_client(BAD_ROLLOUTS) + BAD_CALLER_ROLLOUTS)
def test_client_refuses_what_the_pipeline_refuses_with_nothing_written(
    store: ObjectStore, tmp_path: Path, items: list[Rollout], sample: str | None, field: str | None, message: str
) -> None:
    with pytest.raises(RolloutsError) as excinfo:
        publish_step(store, RUN, STEP, items, fake_checkpoint(tmp_path / "ckpt"), policy_version=3, model_id="m")

    assert "step-000003" in excinfo.value.where
    assert (excinfo.value.sample, excinfo.value.field) == (sample, field)
    assert message in str(excinfo.value)
    assert stored_files(store) == {}


@pytest.mark.parametrize(
    ("prepare", "message"),
    [
        pytest.param(lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
                     "found pytorch_model.bin, pickled weights are not accepted", id="pickle",
                     marks=BAD("policy checkpoint that is a pickle (client)")),
        pytest.param(lambda d: (d / "model.safetensors").write_bytes(b"\x80\x04not safetensors"),
                     "model.safetensors is not a safetensors file", id="corrupt",
                     marks=BAD("policy checkpoint whose weights are not safetensors (client)")),
        pytest.param(lambda d: (d / "config.json").unlink(), "has no config.json", id="no-config"),
        pytest.param(lambda d: (d / "config.json").write_text("{}"), "no positive integer vocab_size",
                     id="no-vocab"),
    ],
)
def test_checkpoint_that_is_not_safetensors_is_refused(store: ObjectStore, tmp_path: Path, prepare,  # noqa: ANN001
                                                       message: str) -> None:
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    prepare(ckpt)

    with pytest.raises(RolloutsError, match=message) as excinfo:
        publish_step(store, RUN, STEP, group(), ckpt, policy_version=2, model_id="m")

    assert excinfo.value.field == "checkpoint"
    assert stored_files(store) == {}


@pytest.mark.reliability("bad_input", "tokenizer with more ids than the policy's vocabulary (client)")
def test_tokenizer_vocabulary_mismatch_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(RolloutsError, match="tokenizer has 51 ids, more than the policy's vocabulary") as excinfo:
        publish_step(store, RUN, STEP, group(), fake_checkpoint(tmp_path / "ckpt", vocab_size=50),
                     policy_version=2, model_id="m", tokenizer_vocab_size=51)

    assert "step-000003" in str(excinfo.value)
    assert excinfo.value.field == "vocab_size"
    assert stored_files(store) == {}


@pytest.mark.parametrize("step", [-1, 2**63, True, 1.0], ids=["negative", "beyond-int64", "bool", "float"])
@pytest.mark.reliability("bad_input", "step number that is negative, fractional or too large for int64 (client)")
def test_bad_step_numbers_are_refused(store: ObjectStore, tmp_path: Path, step: object) -> None:
    with pytest.raises(RolloutsError, match="RL step must be an integer"):
        publish_step(store, RUN, step, group(), fake_checkpoint(tmp_path / "ckpt"), policy_version=2,
                     model_id="m")
    assert stored_files(store) == {}


@pytest.mark.parametrize("version", [-1, 1.5, True], ids=["negative", "fractional", "bool"])
def test_bad_pointer_policy_versions_are_refused(store: ObjectStore, tmp_path: Path, version: object) -> None:
    with pytest.raises(RolloutsError) as excinfo:
        publish_step(store, RUN, STEP, group(), fake_checkpoint(tmp_path / "ckpt"), policy_version=version,
                     model_id="m")
    assert excinfo.value.field == "policy_version"
    assert "policy.json" in excinfo.value.where
    assert stored_files(store) == {}


def test_a_partial_publication_is_completed_by_the_retry(store: ObjectStore, tmp_path: Path) -> None:
    """A trainer killed before policy.json left rollouts but no commit: the retry writes the step."""
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    publish_step(store, RUN, STEP, [ok("old")], ckpt, policy_version=2, model_id="m")
    store.delete_prefix(f"rollouts/{RUN}/step-000003/policy.json")
    assert not is_committed(store, RUN, STEP)

    publish_step(store, RUN, STEP, group(), ckpt, policy_version=2, model_id="m")

    assert [r.sample_id for r in read_rollouts(store, RUN, STEP)] == [r.sample_id for r in group()]


def test_stage_checkpoint_reads_the_limits(tmp_path: Path) -> None:
    staged = stage_checkpoint(fake_checkpoint(tmp_path / "ckpt", vocab_size=40, max_positions=16))
    assert (staged.limits.vocab_size, staged.limits.max_positions) == (40, 16)
    assert staged.files == ("config.json", "model.safetensors")


def test_client_imports_neither_torch_nor_dagster() -> None:
    code = ("import sys, pipeline.client; "
            "print(sorted(m for m in ('torch', 'dagster', 'transformers', 'mlflow') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "[]"
