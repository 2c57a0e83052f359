"""The rolling cross-step buffer: selection semantics and the manifest round trip."""

from __future__ import annotations

import pytest
import torch

from pipeline.data import buffer, shard_format, shards
from pipeline.data.buffer import select_buffer
from pipeline.data.buffer_record import BufferEntry, composition
from pipeline.data.keys import buffer_key
from pipeline.data.shard_format import ByteRange, HiddenSample, Manifest, SampleIndex
from pipeline.data.store import ObjectStore
from tests.support.targets import tiny_target

RUN = "r"
H = 4


def manifest(step: int, tokens: list[int], per_shard: int = 100) -> Manifest:
    """A hand-made manifest: sample i of `step` is 's<step>-<i>' with tokens[i] tokens."""
    samples = [
        SampleIndex(f"s{step}-{i}", f"part-{i // per_shard:05d}-x.parquet", i % per_shard, n,
                    ByteRange(0, 0, ""), 0, 0, [])
        for i, n in enumerate(tokens)
    ]
    return Manifest(
        step=step, hidden_size=H, layer_ids=[1], dtype="bfloat16", target={}, shards=[],
        num_samples=len(tokens), num_tokens=sum(tokens), samples=samples,
    )


def ids(entries: list[BufferEntry]) -> list[str]:
    return [e.sample_id for e in entries]


# -- select_buffer ----------------------------------------------------------------------------------------------


def test_keeps_only_the_last_n_steps() -> None:
    manifests = [manifest(s, [5, 5]) for s in range(1, 7)]  # step 6 is "in the future" of step 5

    entries = select_buffer(manifests, current_step=5, buffer_steps=2, max_samples=100)

    assert ids(entries) == ["s4-0", "s4-1", "s5-0", "s5-1"]
    assert composition(entries) == {4: 2, 5: 2}


def test_one_step_buffer_is_the_current_step() -> None:
    entries = select_buffer([manifest(s, [3, 3]) for s in range(4)], current_step=3, buffer_steps=1, max_samples=10)
    assert ids(entries) == ["s3-0", "s3-1"]


def test_missing_steps_are_skipped_not_replaced_by_older_ones() -> None:
    manifests = [manifest(1, [3]), manifest(2, [3]), manifest(4, [3])]  # step 3 was never committed

    entries = select_buffer(manifests, current_step=4, buffer_steps=2, max_samples=10)

    assert ids(entries) == ["s4-0"]


@pytest.mark.parametrize(
    ("max_samples", "expected"),
    [
        pytest.param(7, ["s4-0", "s4-1", "s4-2", "s5-0", "s5-1", "s5-2"], id="all-fit"),
        pytest.param(6, ["s4-0", "s4-1", "s4-2", "s5-0", "s5-1", "s5-2"], id="exactly-full"),
        pytest.param(4, ["s4-2", "s5-0", "s5-1", "s5-2"], id="oldest-evicted-first"),
        pytest.param(3, ["s5-0", "s5-1", "s5-2"], id="only-newest-step"),
        pytest.param(1, ["s5-2"], id="single-newest-sample"),
    ],
)
def test_newest_max_samples_are_kept(max_samples: int, expected: list[str]) -> None:
    manifests = [manifest(4, [5, 5, 5]), manifest(5, [5, 5, 5])]
    assert ids(select_buffer(manifests, 5, 2, max_samples)) == expected


def test_order_is_by_step_then_row_whatever_the_input_order() -> None:
    manifests = [manifest(3, [4, 4, 4], per_shard=2), manifest(1, [4, 4]), manifest(2, [4, 4, 4], per_shard=2)]

    entries = select_buffer(manifests, current_step=3, buffer_steps=3, max_samples=100)

    assert [(e.step, e.shard, e.row) for e in entries] == [
        (1, "part-00000-x.parquet", 0), (1, "part-00000-x.parquet", 1),
        (2, "part-00000-x.parquet", 0), (2, "part-00000-x.parquet", 1), (2, "part-00001-x.parquet", 0),
        (3, "part-00000-x.parquet", 0), (3, "part-00000-x.parquet", 1), (3, "part-00001-x.parquet", 0),
    ]


def test_samples_under_two_tokens_are_dropped() -> None:
    entries = select_buffer([manifest(1, [1, 2, 0, 7])], current_step=1, buffer_steps=1, max_samples=10)

    assert ids(entries) == ["s1-1", "s1-3"]
    assert [e.tokens for e in entries] == [2, 7]


def test_entries_carry_the_manifest_index() -> None:
    (entry,) = select_buffer([manifest(9, [6])], 9, 1, 1)
    assert entry == BufferEntry(step=9, sample_id="s9-0", shard="part-00000-x.parquet", row=0, tokens=6)


@pytest.mark.parametrize(
    ("buffer_steps", "max_samples"),
    [
        pytest.param(0, 10, id="zero-steps"),
        pytest.param(-1, 10, id="negative-steps"),
        pytest.param(2, 0, id="zero-samples"),
        pytest.param(2, -5, id="negative-samples"),
    ],
)
def test_invalid_arguments_raise(buffer_steps: int, max_samples: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        select_buffer([manifest(1, [3])], 1, buffer_steps, max_samples)


def test_composition_counts_per_step() -> None:
    entries = select_buffer([manifest(2, [3] * 4), manifest(1, [3] * 5), manifest(3, [3, 1, 3])], 3, 3, 100)
    assert composition(entries) == {1: 5, 2: 4, 3: 2}
    assert list(composition(entries)) == [1, 2, 3]
    assert composition([]) == {}


# -- through a real store ---------------------------------------------------------------------------------------


def _hidden_samples(step: int, lengths: list[int]) -> list[HiddenSample]:
    gen = torch.Generator().manual_seed(step)
    return [
        HiddenSample(
            sample_id=f"s{step}-{i}", step=step,
            input_ids=torch.randint(0, 32, (n,), generator=gen),
            loss_mask=torch.cat([torch.zeros(n // 2, dtype=torch.int64), torch.ones(n - n // 2, dtype=torch.int64)]),
            hidden=torch.randn(n, 1, H, generator=gen).to(torch.bfloat16),
        )
        for i, n in enumerate(lengths)
    ]


@pytest.fixture
def store_with_steps(store: ObjectStore) -> tuple[ObjectStore, dict[str, HiddenSample]]:
    """Steps 0..3 committed with 2 samples per shard; step 2 holds a 1-token sample."""
    lengths = {0: [3, 4, 5], 1: [6, 2, 3, 4, 5], 2: [4, 1, 7], 3: [5, 6, 7, 8]}
    written: dict[str, HiddenSample] = {}
    for step, ls in lengths.items():
        samples = _hidden_samples(step, ls)
        shards.write_hidden_states(
            store, RUN, step, samples, hidden_size=H, layer_ids=[1], target={"model_id": "m"}, samples_per_shard=2
        )
        written |= {s.sample_id: s for s in samples}
    return store, written


def test_build_write_read_round_trip(store_with_steps: tuple[ObjectStore, dict[str, HiddenSample]]) -> None:
    store, written = store_with_steps

    built = buffer.build_buffer(store, RUN, 2, buffer_steps=2, max_samples=100)

    expected_ids = ["s1-0", "s1-1", "s1-2", "s1-3", "s1-4", "s2-0", "s2-2"]  # s2-1 has one token
    assert ids(built.entries) == expected_ids
    assert built.step == 2
    assert built.num_samples == 7
    assert built.num_tokens == sum(written[i].input_ids.shape[0] for i in expected_ids)
    assert built.composition == {1: 5, 2: 2}
    doc = store.read_json(buffer_key(RUN, 2))
    assert doc == {"schema_version": 1, **built.to_json()}
    assert (doc["num_samples"], doc["composition"]) == (7, {"1": 5, "2": 2})  # as readers of the JSON see it

    assert buffer.read_buffer(store, RUN, 2) == built
    entries = list(built.entries)
    assert ids(entries) == expected_ids
    assert all(isinstance(e, BufferEntry) for e in entries)

    loaded = list(buffer.iter_buffer_samples(store, RUN, entries))
    assert [s.sample_id for s in loaded] == expected_ids
    for got in loaded:
        want = written[got.sample_id]
        assert got.step == want.step
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.loss_mask, want.loss_mask)
        assert torch.equal(got.hidden.view(torch.int16), want.hidden.view(torch.int16))


def test_build_buffer_evicts_oldest_first(store_with_steps: tuple[ObjectStore, dict[str, HiddenSample]]) -> None:
    store, _ = store_with_steps

    built = buffer.build_buffer(store, RUN, 3, buffer_steps=3, max_samples=6)

    assert ids(built.entries) == ["s2-0", "s2-2", "s3-0", "s3-1", "s3-2", "s3-3"]
    assert built.composition == {2: 2, 3: 4}


def test_build_buffer_at_step_zero_clamps_the_range(
    store_with_steps: tuple[ObjectStore, dict[str, HiddenSample]],
) -> None:
    store, _ = store_with_steps

    built = buffer.build_buffer(store, RUN, 0, buffer_steps=5, max_samples=100)

    assert built.composition == {0: 3}


def test_build_buffer_requires_the_current_step(store_with_steps: tuple[ObjectStore, dict[str, HiddenSample]]) -> None:
    store, _ = store_with_steps

    with pytest.raises(FileNotFoundError, match="step 4"):
        buffer.build_buffer(store, RUN, 4, buffer_steps=2, max_samples=10)
    assert not store.exists(buffer_key(RUN, 4))


def test_iter_buffer_samples_follows_entry_order(store_with_steps: tuple[ObjectStore, dict[str, HiddenSample]]) -> None:
    store, written = store_with_steps
    buffer.build_buffer(store, RUN, 3, buffer_steps=4, max_samples=100)
    entries = buffer.read_buffer(store, RUN, 3).entries
    shuffled = [entries[i] for i in torch.randperm(len(entries), generator=torch.Generator().manual_seed(0))]
    assert ids(shuffled) != ids(entries)

    loaded = list(buffer.iter_buffer_samples(store, RUN, shuffled))

    assert [s.sample_id for s in loaded] == ids(shuffled)
    for got in loaded:
        assert torch.equal(got.hidden.view(torch.int16), written[got.sample_id].hidden.view(torch.int16))


def test_write_buffer_overwrites(store: ObjectStore) -> None:
    first = select_buffer([manifest(1, [3, 3])], 1, 1, 10)
    buffer.write_buffer(store, RUN, 1, first)

    buffer.write_buffer(store, RUN, 1, first[:1])

    assert list(buffer.read_buffer(store, RUN, 1).entries) == first[:1]


def test_corrupt_shard_is_skipped_with_a_warning(store: ObjectStore, caplog: pytest.LogCaptureFixture) -> None:
    """A shard whose bytes changed after the manifest was written is never read into training."""
    g = torch.Generator().manual_seed(0)
    samples = [
        shard_format.HiddenSample(f"s{i}", 1, torch.arange(6), torch.tensor([0, 0, 1, 1, 1, 1]),
                            torch.randn(6, 1, 8, generator=g).to(torch.bfloat16))
        for i in range(4)
    ]
    manifest = shards.write_hidden_states(store, "run", 1, samples, hidden_size=8, layer_ids=[1],
                                          target={"model_id": "m"}, samples_per_shard=2)
    entries = buffer.select_buffer([manifest], 1, buffer_steps=1, max_samples=10)
    key = f"hidden_states/run/step-000001/{manifest.shards[0].name}"
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(key, bytes(data))

    with caplog.at_level("WARNING", logger="pipeline.data.buffer"):
        loaded = list(buffer.iter_buffer_samples(store, "run", entries))
    assert [s.sample_id for s in loaded] == ["s2", "s3"]
    assert "does not match its manifest checksum" in caplog.text
    assert "skipping its 2 buffer samples" in caplog.text
    with pytest.raises(shard_format.CorruptShardError, match=f"{manifest.shards[0].name}.*sample 's1'"):
        shards.read_rows(store, "run", manifest, manifest.shards[0].name, [1])
    # Reads are verified per range: a sample whose own bytes are intact still reads.
    (intact,) = shards.read_rows(store, "run", manifest, manifest.shards[0].name, [0])
    assert torch.equal(intact.hidden.view(torch.int16), samples[0].hidden.view(torch.int16))


def test_shard_check_reports_a_corrupt_shard_once(store: ObjectStore) -> None:
    """The asset check reads each shard once and names the one whose bytes changed."""
    from pipeline.data import shard_checks as checks
    from pipeline.data.rollouts import PolicyPointer, Rollout, write_rollouts
    from pipeline.models.target import save_checkpoint

    save_checkpoint(tiny_target(16, 8, 1, 2), store, "policies/run/p")
    write_rollouts(store, "run", 1, [Rollout("a", [1, 2, 3], [0, 1, 1], 0.0, 1)],
                   PolicyPointer(1, "policies/run/p", "m"))
    g = torch.Generator().manual_seed(0)
    samples = [shard_format.HiddenSample(f"s{i}", 1, torch.arange(6), torch.tensor([0, 0, 1, 1, 1, 1]),
                                   torch.randn(6, 1, 8, generator=g).to(torch.bfloat16)) for i in range(4)]
    manifest = shards.write_hidden_states(store, "run", 1, samples, hidden_size=8, layer_ids=[1],
                                          target={"model_id": "m"}, samples_per_shard=2)
    assert checks.check_shards(store, "run", 1) == []
    key = f"hidden_states/run/step-000001/{manifest.shards[1].name}"
    data = bytearray(store.read_bytes(key))
    data[-20] ^= 0xFF
    store.write_bytes(key, bytes(data))
    problems = checks.check_shards(store, "run", 1)
    assert problems[0] == f"step 1: shard {manifest.shards[1].name} does not match its manifest checksum"
    assert problems[1:] == ["2 rows stored, manifest says 4"]
