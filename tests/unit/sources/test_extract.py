"""Source B: the step's policy over its rollouts, batched by a token budget and streamed into shards."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from benchmarks.extraction import Setup
from pipeline.config import load_config
from pipeline.data import buffer, shard_format, shards
from pipeline.data.rollouts import (
    Rollout,
    committed_digest,
    read_policy_pointer,
    read_rollouts,
    write_rollouts_file,
)
from pipeline.data.store import ObjectStore, open_store
from pipeline.models import drafter as drafters
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.models.eagle3 import Eagle3Drafter, read_positions, stored_layer_ids
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from tests.support.config import write_config
from tests.support.targets import tiny_target

ROOT = Path(__file__).resolve().parents[3]
LAYERS = [0, 2, 3]  # vLLM ids of a 3-layer target: the embeddings, a middle stream, the last layer before the norm


def _rollouts(lengths: list[int], vocab: int, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    return [Rollout(f"r{i}", [rng.randrange(vocab) for _ in range(n)], [0] * (n // 2) + [1] * (n - n // 2), 1.0, 1)
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_target(64, 64, 3, 4)


# -- batching plan ----------------------------------------------------------------------------------------------


def test_plan_fills_each_batch_up_to_the_padded_token_budget() -> None:
    #   sorted: 8(#2) 7(#4) 5(#0) 3(#1) 2(#3)
    #   [2, 4]     2 x 8 = 16 <= 16 (with #0: 3 x 8 = 24)
    #   [0, 1, 3]  3 x 5 = 15 <= 16
    assert extract.plan_batches([5, 3, 8, 2, 7], 16) == [[2, 4], [0, 1, 3]]


def test_plan_puts_a_sample_longer_than_the_budget_alone() -> None:
    #   sorted: 20(#1) 4(#0) 4(#2) 3(#3)
    #   [1]        20 > 10, alone
    #   [0, 2]     2 x 4 = 8 (with #3: 3 x 4 = 12 > 10)
    #   [3]
    assert extract.plan_batches([4, 20, 4, 3], 10) == [[1], [0, 2], [3]]


def test_plan_covers_every_sample_once_within_the_budget() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(200)]
    plan = extract.plan_batches(lengths, 1024)
    assert sorted(i for batch in plan for i in batch) == list(range(200))
    for batch in plan:
        longest = max(lengths[i] for i in batch)
        assert lengths[batch[0]] == longest
        assert len(batch) == 1 or len(batch) * longest <= 1024
    padded = sum(len(b) * lengths[b[0]] for b in plan)
    assert padded < 1.05 * sum(lengths)  # sorted: batches hold samples of about the same length
    assert extract.plan_batches([], 16) == []
    with pytest.raises(ValueError, match="tokens_per_batch"):
        extract.plan_batches([3], 0)


# -- padding invariance -----------------------------------------------------------------------------------------


LENGTHS = [5, 17, 33, 8, 64, 1, 40, 12]


@pytest.mark.parametrize("layer_ids", [LAYERS, None], ids=["layers", "post-norm"])
def test_padding_never_reaches_a_valid_token(target: torch.nn.Module, layer_ids) -> None:
    """Same batch shape, other padding: the valid states are bit-identical (a masked key's weight is an
    exact 0, so not even rounding changes)."""
    rng = torch.Generator().manual_seed(1)
    lengths = [40, 33, 17, 5]
    ids = torch.zeros(4, 40, dtype=torch.int64)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, 64, (n,), generator=rng)
    other = ids.clone()
    for row, n in enumerate(lengths):
        other[row, n:] = torch.randint(0, 64, (40 - n,), generator=rng)
    for a, b in zip(target_forward.layer_states(target, ids, layer_ids),
                    target_forward.layer_states(target, other, layer_ids), strict=True):
        for row, n in enumerate(lengths):
            assert torch.equal(a[row, :n], b[row, :n])


@pytest.mark.parametrize("layer_ids", [LAYERS, None], ids=["layers", "post-norm"])
def test_padded_batches_store_the_states_of_each_sample_alone(target: torch.nn.Module, layer_ids) -> None:
    """Each stored sample equals a forward of it alone (fp32 target), to within rounding: not bit for bit,
    because attention reduces over the batch's longest key axis (the masked keys add exact zeros, but the
    kernels block and sum a longer axis in another order; ~1e-7 here). In bf16 that is at most one
    rounding step on the few values that lie near a bf16 rounding boundary."""
    rollouts = _rollouts(LENGTHS, vocab=64)
    got = list(extract.iter_hidden_states(target, rollouts, 7, tokens_per_batch=96, layer_ids=layer_ids))
    assert sorted(s.sample_id for s in got) == sorted(r.sample_id for r in rollouts)
    assert len(extract.plan_batches(LENGTHS, 96)) < len(LENGTHS)  # samples did share batches
    identical = total = 0
    for sample in got:
        ids = sample.input_ids[None]
        alone = torch.stack(target_forward.layer_states(target, ids, layer_ids), dim=2)[0]  # (T, n, H) fp32
        padded_batch = next(b for b in extract.plan_batches(LENGTHS, 96) if int(sample.sample_id[1:]) in b)
        longest = max(LENGTHS[i] for i in padded_batch)
        padded = torch.cat([ids, torch.zeros(1, longest - ids.shape[1], dtype=torch.int64)], dim=1)
        fp32 = torch.stack(target_forward.layer_states(target, padded, layer_ids), dim=2)[0, : ids.shape[1]]
        torch.testing.assert_close(fp32, alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sample.hidden.float(), alone.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-5)
        assert sample.step == 7
        identical += int((sample.hidden == alone.to(torch.bfloat16)).sum())
        total += alone.numel()
    assert identical >= 0.99 * total


def test_layer_states_are_forwards_layers(target: torch.nn.Module) -> None:
    ids = torch.tensor([r.input_ids for r in _rollouts([9, 9], vocab=64)])
    out = target_forward.forward(target, ids, LAYERS)
    caught = target_forward.layer_states(target, ids, LAYERS)
    assert all(torch.equal(c, out.layers[:, :, i]) for i, c in enumerate(caught))
    assert torch.equal(target_forward.layer_states(target, ids, None)[0], out.features)
    with pytest.raises(ValueError, match="outside"):
        target_forward.layer_states(target, ids, [4])


# -- streaming --------------------------------------------------------------------------------------------------


def test_shards_are_written_while_later_batches_are_still_to_run(
    store: ObjectStore, tmp_path: Path, target: torch.nn.Module
) -> None:
    rollouts = _rollouts([30 - i for i in range(16)], vocab=64)
    batches = len(extract.plan_batches([len(r.input_ids) for r in rollouts], 60))
    forwards: list[int] = []
    hook = target.model.register_forward_hook(lambda *_: forwards.append(1))
    shards_seen: list[tuple[int, int]] = []  # (forwards run, shard files written) as each sample reaches the writer

    def watched():
        for sample in extract.iter_hidden_states(target, rollouts, 1, tokens_per_batch=60, layer_ids=LAYERS):
            shards_seen.append((len(forwards), len(list((tmp_path / "store" / "hidden_states").rglob("part-*.arrow")))))
            yield sample

    try:
        manifest = shards.write_hidden_states(store, "run", 1, watched(), hidden_size=64, layer_ids=LAYERS,
                                              target={}, samples_per_shard=2)
    finally:
        hook.remove()
    assert batches >= 6
    assert len(forwards) == batches
    # The first sample reaches the writer after its batch, with at most two more computed ahead ...
    assert shards_seen[0][0] <= 3
    # ... and shards are on storage while batches are still to run.
    assert any(f < batches and n >= 1 for f, n in shards_seen)
    assert manifest.num_samples == 16
    assert len(manifest.shards) == 8
    assert manifest.num_tokens == sum(len(r.input_ids) for r in rollouts)


def test_a_sample_refused_mid_stream_leaves_no_shard(
    store: ObjectStore, tmp_path: Path, target: torch.nn.Module
) -> None:
    rollouts = _rollouts([30, 28, 26, 24], vocab=64)
    rollouts[3] = Rollout(rollouts[3].sample_id, rollouts[3].input_ids, [0] * 24, 1.0, 1)  # nothing to train on
    samples = extract.iter_hidden_states(target, rollouts, 1, tokens_per_batch=60, layer_ids=LAYERS)
    with pytest.raises(shard_format.ShardError, match="'r3'.*loss mask is all zero"):
        shards.write_hidden_states(store, "run", 1, samples, hidden_size=64, layer_ids=LAYERS, target={},
                                   samples_per_shard=1)
    assert not list(tmp_path.rglob("*.arrow*"))


def _peak_rss(setup: Setup, samples: int, hold: bool = False) -> int:
    args = [sys.executable, "-m", "benchmarks.extraction", "--measure-step", json.dumps(asdict(setup)),
            "--samples", str(samples)] + (["--hold-step"] if hold else [])
    out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_step() -> None:
    """Peak RSS of extracting 4N rollouts stays within 10% of extracting N (each in its own process);
    the same measurement of an extraction that holds its step (the control) grows past that."""
    setup = Setup(hidden_size=512, num_layers=2, intermediate_size=64, num_heads=8, num_kv_heads=8, vocab_size=256,
                  dtype="float32", samples=24, min_len=64, max_len=1024, tokens_per_batch=2048)
    small, large = _peak_rss(setup, setup.samples), _peak_rss(setup, 4 * setup.samples)
    assert large <= 1.1 * small, (small, large)
    held_small, held_large = _peak_rss(setup, setup.samples, hold=True), _peak_rss(setup, 4 * setup.samples, hold=True)
    assert held_large > 1.1 * held_small, (held_small, held_large)


# -- layers stored once -----------------------------------------------------------------------------------------


def test_eagle3_layers_are_stored_once_and_read_in_drafter_order() -> None:
    assert stored_layer_ids((2, 16, 29), 32) == [2, 16, 29, 32]
    assert read_positions((2, 16, 29), 32) == [0, 1, 2, 3]
    assert stored_layer_ids((0, 1, 2), 2) == [0, 1, 2]  # the last layer among the aux ids of a 2-layer target
    assert read_positions((0, 1, 2), 2) == [0, 1, 2, 2]
    assert stored_layer_ids((2, 3, 3), 6) == [2, 3, 6]  # vLLM's default at 6 layers repeats one
    assert read_positions((2, 3, 3), 6) == [0, 1, 1, 2]


def test_extracted_step_stores_the_last_layer_once_and_trains_on_aux_and_last(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, {"hidden_states": {"tokens_per_batch": 64}}))
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    manifest = extract.extract_hidden_states(store, cfg, 1)
    assert manifest.layer_ids == [0, 1, 2]  # aux (0, 1, 2) of the 2-layer target, L = 2 among them
    policy = target_lib.load_policy(store, read_policy_pointer(store, cfg.run, 1).checkpoint_uri)
    drafter = drafters.fresh_drafter(cfg.drafter, policy, torch.ones(cfg.simulation.vocab_size), seed=0)
    assert isinstance(drafter, Eagle3Drafter)
    drafters.check_layers(drafter, manifest.layer_ids, 2, "step 1")
    rollouts = {r.sample_id: r for r in read_rollouts(store, cfg.run, 1)}
    sample = next(shards.iter_samples(store, cfg.run, manifest))
    ids, features, _ = drafter.training_sample(sample, 2)
    assert torch.equal(ids, torch.tensor(rollouts[sample.sample_id].input_ids))
    expected = target_forward.forward(policy, ids[None], [0, 1, 2, 2]).layers[0]  # [aux..., L]: (T, 4, H)
    torch.testing.assert_close(features, expected.to(torch.bfloat16).flatten(1), rtol=0, atol=0.02)
    with pytest.raises(ValueError, match="needs"):
        drafters.check_layers(drafter, [0, 1, 2, 2], 2, "step 1")


@pytest.mark.reliability("bad_input", "a step's rollouts republished after its hidden states were extracted: the "
                                      "buffer refuses the stale hidden states, naming the step")
def test_hidden_states_record_what_they_were_extracted_from(tmp_path: Path) -> None:
    """The manifest records the digest of the committed step it was extracted from; a step republished since
    (its rollouts.parquet rewritten under the same commit) is refused where the buffer reads the hidden states."""
    cfg = load_config(write_config(tmp_path, {"hidden_states": {"tokens_per_batch": 64}}))
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    manifest = extract.extract_hidden_states(store, cfg, 1)
    assert manifest.target["rollouts_digest"] == committed_digest(store, cfg.run, 1)
    assert buffer.build_buffer(store, cfg.run, 1, 2, 1000).num_samples > 0

    rollouts = read_rollouts(store, cfg.run, 1)
    write_rollouts_file(store, cfg.run, 1, [replace(rollouts[0], reward=-rollouts[0].reward), *rollouts[1:]])
    with pytest.raises(buffer.StaleHiddenStates, match="step-000001.*changed after its hidden states were extracted"):
        buffer.build_buffer(store, cfg.run, 1, 2, 1000)
