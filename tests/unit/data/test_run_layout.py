"""One target layout per run (pipeline.data.run_layout): a step whose policy changes hidden size,
vocabulary, layer ids or family is refused before anything of it is stored, and by the buffer."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.data import buffer, run_layout, shard_checks, shard_format, shards
from pipeline.data.keys import hidden_states_manifest_key, hidden_states_prefix, layout_key
from pipeline.data.run_layout import LayoutError, TargetLayout
from pipeline.data.shard_format import HiddenSample
from pipeline.data.store import ObjectStore

RUN = "r"
LAYOUT = TargetLayout("llama", 8, 64, 2, (2,))


def _samples(step: int, hidden: int = 8, layers: int = 1) -> list[HiddenSample]:
    return [HiddenSample(f"s{i}", step, torch.arange(1, 6), torch.ones(5, dtype=torch.int64),
                         torch.randn(5, layers, hidden).to(torch.bfloat16)) for i in range(3)]


def _write(store: ObjectStore, step: int, layout: TargetLayout | None) -> shard_format.Manifest:
    layout_of = layout or LAYOUT
    return shards.write_hidden_states(
        store, RUN, step, _samples(step, layout_of.hidden_size, len(layout_of.layer_ids)),
        hidden_size=layout_of.hidden_size, layer_ids=list(layout_of.layer_ids), target={"model_id": "m"},
        layout=layout)


CHANGED = [
    pytest.param(replace(LAYOUT, hidden_size=16), "hidden_size: 8 -> 16", id="hidden-size",
                 marks=pytest.mark.reliability("bad_input", "a step whose policy changes the hidden size")),
    pytest.param(replace(LAYOUT, vocab_size=128), "vocab_size: 64 -> 128", id="vocabulary",
                 marks=pytest.mark.reliability("bad_input", "a step whose policy changes the vocabulary")),
    pytest.param(replace(LAYOUT, num_layers=3, layer_ids=(3,)), "num_layers: 2 -> 3", id="depth",
                 marks=pytest.mark.reliability("bad_input", "a step whose policy changes the depth (layer ids)")),
    pytest.param(replace(LAYOUT, layer_ids=(0, 1, 2)), r"layer_ids: \(2,\) -> \(0, 1, 2\)", id="layer-ids",
                 marks=pytest.mark.reliability("bad_input", "a step stored with other layer ids")),
    pytest.param(replace(LAYOUT, family="qwen2"), "family: llama -> qwen2", id="family",
                 marks=pytest.mark.reliability("bad_input", "a step whose policy is of another model family")),
]


@pytest.mark.parametrize(("changed", "message"), CHANGED)
def test_a_step_of_another_layout_is_refused_before_anything_is_stored(
    store: ObjectStore, changed: TargetLayout, message: str
) -> None:
    _write(store, 1, LAYOUT)
    with pytest.raises(LayoutError, match=f"step 2 of run 'r'.*{message}.*start a new run"):
        _write(store, 2, changed)
    assert store.list_files(hidden_states_prefix(RUN, 2)) == []
    # The next valid step goes through, and the buffer over both steps is sound.
    _write(store, 3, LAYOUT)
    assert buffer.build_buffer(store, RUN, 3, buffer_steps=3, max_samples=100).composition == {1: 3, 3: 3}


@pytest.mark.reliability("bad_input", "a step of another hidden size committed without a layout: the buffer "
                                      "check refuses it")
def test_the_buffer_check_refuses_a_committed_step_of_another_layout(store: ObjectStore) -> None:
    _write(store, 1, LAYOUT)
    shards.write_hidden_states(store, RUN, 2, _samples(2, hidden=16), hidden_size=16, layer_ids=[2],
                               target={"model_id": "m"})  # an older writer: no layout in its manifest
    with pytest.raises(LayoutError, match="step 2.*hidden_size: 8 -> 16.*start a new run"):
        buffer.build_buffer(store, RUN, 2, buffer_steps=2, max_samples=100)
    assert not store.exists(f"buffer/{RUN}/step-000002/_manifest.json")


def _checkpoint(store: ObjectStore, key: str, config: dict) -> str:
    store.write_bytes(f"{key}/config.json", json.dumps(config).encode())
    return key


@pytest.mark.parametrize(("config", "message"), [
    pytest.param({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2}, "no field 'vocab_size'",
                 id="no-vocab", marks=pytest.mark.reliability("bad_input", "policy config.json without vocab_size")),
    pytest.param({"model_type": "llama", "hidden_size": "8", "vocab_size": 64, "num_hidden_layers": 2},
                 "'hidden_size' is '8'", id="string-size",
                 marks=pytest.mark.reliability("bad_input", "policy config.json with a hidden_size that is a string")),
    pytest.param({"model_type": "llama", "hidden_size": 8, "vocab_size": 64, "num_hidden_layers": -1},
                 "'num_hidden_layers' is -1", id="negative-depth",
                 marks=pytest.mark.reliability("bad_input", "policy config.json with a negative depth")),
])
def test_a_policy_config_missing_a_layout_field_is_refused(store: ObjectStore, config: dict, message: str) -> None:
    key = _checkpoint(store, "policies/r/step-000001", config)
    with pytest.raises(LayoutError, match=f"policies/r/step-000001/config.json.*{message}"):
        run_layout.checkpoint_layout(store, key, lambda n: [n])


def test_the_rollouts_side_check_reads_config_json_and_records_the_first_step(store: ObjectStore) -> None:
    config = {"model_type": "llama", "hidden_size": 8, "vocab_size": 64, "num_hidden_layers": 2}
    first = run_layout.checkpoint_layout(store, _checkpoint(store, "policies/r/step-000001", config), lambda n: [n])
    assert first == LAYOUT
    run_layout.check_step_layout(store, RUN, 1, first)
    assert run_layout.run_layout(store, RUN) == run_layout.RecordedLayout(LAYOUT, 1)
    wider = run_layout.checkpoint_layout(
        store, _checkpoint(store, "policies/r/step-000002", {**config, "vocab_size": 96}), lambda n: [n])
    with pytest.raises(LayoutError, match="vocab_size: 64 -> 96"):
        run_layout.check_step_layout(store, RUN, 2, wider)
    assert run_layout.run_layout(store, RUN) == run_layout.RecordedLayout(LAYOUT, 1)


def test_the_shards_check_reports_a_step_of_another_layout(store: ObjectStore) -> None:
    _write(store, 1, LAYOUT)
    shards.write_hidden_states(store, RUN, 2, _samples(2, hidden=16), hidden_size=16, layer_ids=[2],
                               target={"model_id": "m"})
    store.write_json(f"rollouts/{RUN}/step-000002/policy.json", {
        "schema_version": 1, "policy_version": 2, "checkpoint_uri": "policies/r/step-000002", "model_id": "m"})
    _checkpoint(store, "policies/r/step-000002", {"model_type": "llama", "hidden_size": 16, "vocab_size": 64,
                                                  "num_hidden_layers": 2})
    problems = shard_checks.check_shards(store, RUN, 2)
    assert len(problems) == 1
    assert "hidden_size: 8 -> 16" in problems[0]


@pytest.mark.reliability("security", "run layout read from a config.json symlinked out of the store: refused, no "
                                     "value of the file echoed")
def test_the_layout_reader_refuses_a_symlinked_config(store: ObjectStore, tmp_path: Path) -> None:
    secret = "Hunter2-layout"
    (tmp_path / "secrets.json").write_text(json.dumps({"model_type": "llama", "hidden_size": secret}))
    directory = tmp_path / "store" / "policies" / RUN / "step-000001"
    directory.mkdir(parents=True)
    (directory / "config.json").symlink_to(tmp_path / "secrets.json")
    with pytest.raises(LayoutError, match="policies/r/step-000001/config.json: cannot be opened as a regular file: "
                                          "a symlink") as failure:
        run_layout.checkpoint_layout(store, f"policies/{RUN}/step-000001", lambda n: [n])
    assert secret not in str(failure.value)
    (directory / "config.json").unlink()
    (tmp_path / "store" / "policies" / RUN / "step-000002").symlink_to(tmp_path)  # the directory itself
    with pytest.raises(ValueError, match="leads out of") as failure:
        run_layout.checkpoint_layout(store, f"policies/{RUN}/step-000002", lambda n: [n])
    assert secret not in str(failure.value)


def _set(doc: object, path: tuple, value: object) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


@pytest.mark.parametrize(("file", "path", "value", "field"), [
    ("layout", ("layout", "hidden_size"), 10**400, "layout.hidden_size"),
    ("layout", ("layout", "hidden_size"), "8", "layout.hidden_size"),
    ("layout", ("layout", "layer_ids"), ["2"], "layout.layer_ids"),
    ("layout", ("recorded_by_step",), -1, "recorded_by_step"),
    ("manifest", ("num_tokens",), 10**400, "num_tokens"),
    ("manifest", ("hidden_size",), 8.0, "hidden_size"),
    ("manifest", ("target",), ["m"], "target"),
    ("manifest", ("shards", 0, "name"), "../../rollouts/r/step-000001/rollouts.parquet", "shards[].name"),
    ("manifest", ("samples", 0, "row"), "0", "samples[].row"),
    ("manifest", ("samples", 0, "shard"), "elsewhere.arrow", "samples[].shard"),
    ("manifest", ("layout", "vocab_size"), 10**400, "layout.vocab_size"),
], ids=["layout-400-digits", "layout-string", "layout-layer-ids", "layout-step", "manifest-400-digits",
        "manifest-fraction", "manifest-target", "manifest-shard-path", "manifest-row", "manifest-stray-shard",
        "manifest-layout-400-digits"])
def test_a_stored_layout_or_manifest_is_read_back_as_untrusted_input(
    store: ObjectStore, file: str, path: tuple, value: object, field: str, reliability
) -> None:
    """The run's layout record and a step's hidden-states manifest are the pipeline's own, read back as trainer
    input is read: a field of the wrong type, a number of hundreds of digits, a shard name that leaves the step's
    directory are refused naming the file and the field, and nothing stored changes."""
    shown = f"a {value.bit_length()}-bit integer" if isinstance(value, int) and value > 2**64 else repr(value)
    reliability.bad_input(f"stored {file} (hidden_states/<run>/) whose {field} is {shown}: refused naming the file "
                          "and field")
    _write(store, 1, LAYOUT)
    key = layout_key(RUN) if file == "layout" else hidden_states_manifest_key(RUN, 1)
    doc = store.read_json(key)
    _set(doc, path, value)
    store.write_json(key, doc)
    before = {k: store.read_bytes(k) for k, _, _ in store.list_files("")}

    refused = LayoutError if file == "layout" else shard_format.ShardError
    read = (lambda: run_layout.check_step_layout(store, RUN, 2, LAYOUT)) if file == "layout" \
        else (lambda: shards.read_manifest(store, RUN, 1))
    with pytest.raises(refused, match=rf"{re.escape(key)}: .*field {re.escape(field)}"):
        read()
    assert {k: store.read_bytes(k) for k, _, _ in store.list_files("")} == before
