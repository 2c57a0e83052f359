"""Hidden-state shards: bit-exact bf16 round trip, manifest, validation that writes nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.data import shard_file, shard_format, shards
from pipeline.data.compression import CHUNK_WORDS, CompressionError, compress_bf16, decompress_bf16_into
from pipeline.data.keys import hidden_states_prefix
from pipeline.data.shard_format import HiddenSample, ShardError
from pipeline.data.store import ObjectStore

RUN = "r"
H = 8
LAYER_IDS = [2]
TARGET = {"model_id": "tiny", "policy_version": "3"}

# bf16 bit patterns worth preserving exactly: zeros of both signs, the smallest/largest subnormal,
# the smallest normal, the largest finite value, 1, -1 and the value next to 1.
SPECIAL_BITS = [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x3F81]


def _bf16_from_bits(bits: list[int] | torch.Tensor) -> torch.Tensor:
    words = torch.as_tensor(bits, dtype=torch.int32)
    words = torch.where(words >= 0x8000, words - 0x10000, words)  # two's complement 16-bit
    return words.to(torch.int16).view(torch.bfloat16)


def random_bf16(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random finite bf16 drawn from ALL bit patterns (subnormals, -0, huge values), plus special values."""
    bits = torch.randint(0, 0x10000, shape, generator=gen, dtype=torch.int32)
    values = _bf16_from_bits(bits)
    values = torch.where(torch.isfinite(values), values, torch.zeros((), dtype=torch.bfloat16))
    flat = values.flatten()
    special = _bf16_from_bits(SPECIAL_BITS)
    n = min(len(special), flat.numel())
    flat[:n] = special[:n]
    return flat.view(shape)


def make_sample(
    sample_id: str, step: int, length: int, gen: torch.Generator, hidden_size: int = H, layers: int = 1
) -> HiddenSample:
    mask = torch.zeros(length, dtype=torch.int64)
    mask[length // 2 :] = 1
    return HiddenSample(
        sample_id=sample_id,
        step=step,
        input_ids=torch.randint(0, 32, (length,), generator=gen),
        loss_mask=mask,
        hidden=random_bf16((length, layers, hidden_size), gen),
    )


def make_samples(step: int, lengths: list[int], seed: int = 0, layers: int = 1) -> list[HiddenSample]:
    gen = torch.Generator().manual_seed(seed)
    return [make_sample(f"s{step}-{i}", step, n, gen, layers=layers) for i, n in enumerate(lengths)]


def write(store: ObjectStore, step: int, samples: list[HiddenSample], **kwargs) -> shard_format.Manifest:
    opts = {"hidden_size": H, "layer_ids": LAYER_IDS, "target": TARGET, **kwargs}
    return shards.write_hidden_states(store, RUN, step, samples, **opts)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_sample(got: HiddenSample, want: HiddenSample) -> None:
    assert got.sample_id == want.sample_id
    assert got.step == want.step
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.loss_mask, want.loss_mask)
    assert got.hidden.dtype == torch.bfloat16
    assert got.hidden.shape == want.hidden.shape
    assert torch.equal(got.hidden.view(torch.int16), want.hidden.view(torch.int16))  # bit-exact


# -- round trip -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "per_shard", "layers"),
    [
        pytest.param([5], 256, 1, id="one-sample"),
        pytest.param([3, 7, 2, 11, 1, 6], 256, 1, id="one-shard"),
        pytest.param([3, 7, 2, 11, 1, 6], 4, 1, id="two-shards"),
        pytest.param([3, 7, 2, 11, 1, 6], 1, 1, id="shard-per-sample"),
        pytest.param([4, 9, 5], 2, 3, id="three-layers"),
    ],
)
@pytest.mark.parametrize("compression", shard_format.LOSSLESS)
def test_round_trip_is_bit_exact(
    store: ObjectStore, lengths: list[int], per_shard: int, layers: int, compression: str
) -> None:
    samples = make_samples(7, lengths, layers=layers)
    layer_ids = list(range(layers))

    manifest = write(store, 7, samples, samples_per_shard=per_shard, layer_ids=layer_ids, compression=compression)
    read_back = shards.read_manifest(store, RUN, 7)
    streamed = list(shards.iter_samples(store, RUN, read_back))

    assert read_back == manifest
    assert len(streamed) == len(samples)
    for got, want in zip(streamed, samples, strict=True):
        assert_same_sample(got, want)
    # Random access through the manifest's (shard, row) index, rows out of order.
    by_id = {s.sample_id: s for s in samples}
    for shard in manifest.shards:
        entries = [e for e in manifest.samples if e.shard == shard.name][::-1]
        rows = shards.read_rows(store, RUN, manifest, shard.name, [e.row for e in entries])
        for got, entry in zip(rows, entries, strict=True):
            assert got.sample_id == entry.sample_id
            assert_same_sample(got, by_id[entry.sample_id])


@pytest.mark.parametrize("compression", shard_format.LOSSLESS)
def test_a_drafter_reads_only_the_layers_it_needs(store: ObjectStore, compression: str) -> None:
    samples = make_samples(4, [5, 9], layers=3)
    manifest = write(store, 4, samples, layer_ids=[3, 7, 12], compression=compression)

    for layers in ([12], [7, 3], None):
        for got, want in zip(shards.iter_samples(store, RUN, manifest, layers=layers), samples, strict=True):
            positions = [[3, 7, 12].index(i) for i in layers] if layers else [0, 1, 2]
            assert torch.equal(got.hidden.view(torch.int16), want.hidden[:, positions].view(torch.int16))
    with pytest.raises(ShardError, match=r"layers \[5\] are not stored \(stored: \[3, 7, 12\]\)"):
        shards.read_sample(store, RUN, manifest, "s4-0", layers=[5])


def test_raw_layers_of_a_local_shard_are_viewed_in_place_copy_on_write(store: ObjectStore, tmp_path: Path) -> None:
    samples = make_samples(5, [6, 3], layers=3)
    manifest = write(store, 5, samples, layer_ids=[3, 7, 12])
    shard = manifest.shards[0]
    before = snapshot(tmp_path / "store")

    for layers, positions in (([3, 7, 12], [0, 1, 2]), ([3, 12], [0, 2]), ([12, 3], [2, 0]), ([7], [1])):
        got = shards.read_rows(store, RUN, manifest, shard.name, [1, 0], layers=layers)
        for sample, want in zip(got, [samples[1], samples[0]], strict=True):
            assert torch.equal(sample.hidden.view(torch.int16), want.hidden[:, positions].view(torch.int16))
        # Evenly spaced layers are views of the mapped file (two samples lie as far apart in memory as
        # in the file), not copies; [12, 3] runs backwards: copied.
        rows = {e.row: e.layers[positions[0]].offset for e in manifest.samples}
        viewed = got[0].hidden.data_ptr() - got[1].hidden.data_ptr() == rows[1] - rows[0]
        assert viewed == (layers != [12, 3])
        for sample in got:  # a caller's writes stay in its own pages
            sample.hidden.fill_(1.0)

    assert snapshot(tmp_path / "store") == before
    again = shards.read_rows(store, RUN, manifest, shard.name, [0, 1])
    for sample, want in zip(again, samples, strict=True):
        assert_same_sample(sample, want)


@pytest.mark.parametrize("compression", shard_format.LOSSLESS)
def test_one_sample_by_id_reads_only_its_own_ranges(store: ObjectStore, tmp_path: Path, compression: str) -> None:
    samples = make_samples(6, [4, 7, 5], layers=2)
    manifest = write(store, 6, samples, layer_ids=[1, 2], compression=compression)
    path = tmp_path / "store" / hidden_states_prefix(RUN, 6) / manifest.shards[0].name
    entry = manifest.samples[1]
    # Zero every byte of the shard outside sample s6-1's metadata and layer-2 ranges: it still reads.
    keep = [(entry.meta.offset, entry.meta.length), (entry.layers[1].offset, entry.layers[1].length)]
    data = path.read_bytes()
    kept = bytearray(len(data))
    for offset, length in keep:
        kept[offset : offset + length] = data[offset : offset + length]
    path.write_bytes(bytes(kept))

    got = shards.read_sample(store, RUN, manifest, "s6-1", layers=[2])

    assert torch.equal(got.input_ids, samples[1].input_ids)
    assert torch.equal(got.loss_mask, samples[1].loss_mask)
    assert torch.equal(got.hidden.view(torch.int16), samples[1].hidden[:, 1:].view(torch.int16))
    with pytest.raises(shard_format.CorruptShardError, match="layer 1 of sample 's6-1'"):
        shards.read_sample(store, RUN, manifest, "s6-1")
    with pytest.raises(KeyError, match="no sample 'nope'"):
        shards.read_sample(store, RUN, manifest, "nope")


@pytest.mark.parametrize("compression", shard_format.COMPRESSIONS)
def test_a_flipped_layer_byte_is_caught_by_every_reader(store: ObjectStore, tmp_path: Path, compression: str) -> None:
    samples = make_samples(8, [6, 6])
    manifest = write(store, 8, samples, compression=compression)
    path = tmp_path / "store" / hidden_states_prefix(RUN, 8) / manifest.shards[0].name
    offset, length = manifest.samples[1].layers[0].offset, manifest.samples[1].layers[0].length
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x01
    path.write_bytes(bytes(data))

    with pytest.raises(shard_format.CorruptShardError, match=f"shard {manifest.shards[0].name} does not match"):
        list(shards.iter_samples(store, RUN, manifest))
    with pytest.raises(shard_format.CorruptShardError, match="sample 's8-1'"):
        shards.read_sample(store, RUN, manifest, "s8-1")
    intact = shards.read_sample(store, RUN, manifest, "s8-0")
    if compression in shard_format.LOSSLESS:
        assert_same_sample(intact, samples[0])


@pytest.mark.parametrize("compression", shard_format.COMPRESSIONS)
def test_a_truncated_shard_is_reported_as_corrupt(store: ObjectStore, tmp_path: Path, compression: str) -> None:
    manifest = write(store, 9, make_samples(9, [6, 6]), compression=compression)
    path = tmp_path / "store" / hidden_states_prefix(RUN, 9) / manifest.shards[0].name
    path.write_bytes(path.read_bytes()[: manifest.samples[1].layers[0].offset + 3])

    shorter = f"shard {manifest.shards[0].name} is shorter than its manifest"
    with pytest.raises(shard_format.CorruptShardError, match=shorter):
        shards.read_sample(store, RUN, manifest, "s9-1")


def test_split_zstd_is_smaller_on_activation_like_values(store: ObjectStore) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 1, 256, generator=gen).to(torch.bfloat16)
    sample = HiddenSample("a", 1, torch.arange(64), torch.ones(64, dtype=torch.int64), hidden)
    plain = write(store, 1, [sample], hidden_size=256)
    packed = write(store, 2, [replace(sample, step=2)], hidden_size=256, compression="split-zstd")

    assert packed.compression == "split-zstd"
    assert packed.total_bytes < 0.8 * plain.total_bytes
    assert_same_sample(shards.read_sample(store, RUN, packed, "a"), replace(sample, step=2))


def test_fp8_halves_the_bytes_within_e4m3_precision(store: ObjectStore) -> None:
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-3, 3, 64)[:, None, None]  # tokens of very different scales
    hidden = (torch.randn(64, 2, 256, generator=gen) * magnitudes).to(torch.bfloat16)
    hidden[5] = 0  # an all-zero token
    sample = HiddenSample("a", 1, torch.arange(64), torch.ones(64, dtype=torch.int64), hidden)
    plain = write(store, 1, [sample], hidden_size=256, layer_ids=[1, 2])
    lossy = write(store, 2, [replace(sample, step=2)], hidden_size=256, layer_ids=[1, 2], compression="fp8-e4m3")

    assert lossy.compression == "fp8-e4m3"
    assert [r.length for r in lossy.samples[0].layers] == [64 * (4 + 256)] * 2  # scale + 1 B/value
    assert lossy.total_bytes < 0.53 * plain.total_bytes
    got = shards.read_sample(store, RUN, lossy, "a", layers=[2]).hidden
    want = hidden[:, 1:].float()
    assert got.dtype == torch.bfloat16
    assert got.shape == want.shape
    error, token_max = (got.float() - want).abs(), want.abs().amax(dim=2, keepdim=True)
    assert (error <= token_max * 2**-4).all()  # e4m3 keeps 3 mantissa bits of every token's largest values
    large = want.abs() >= token_max / 8
    assert (error[large] <= want.abs()[large] * (2**-4 + 2**-8)).all()
    assert not got[5].any()


def test_unknown_compression_is_refused(store: ObjectStore) -> None:
    with pytest.raises(ShardError, match="compression 'gzip' is not one of none, split-zstd"):
        write(store, 1, make_samples(1, [3]), compression="gzip")
    assert not shards.has_manifest(store, RUN, 1)


def test_special_values_survive(store: ObjectStore) -> None:
    special = _bf16_from_bits(SPECIAL_BITS)
    sample = HiddenSample(
        "special", 1, torch.arange(len(special)), torch.ones(len(special), dtype=torch.int64),
        special.repeat_interleave(H).view(len(special), 1, H),
    )

    manifest = write(store, 1, [sample])
    (got,) = shards.iter_samples(store, RUN, manifest)

    assert torch.equal(got.hidden.view(torch.int16), sample.hidden.view(torch.int16))
    assert torch.signbit(got.hidden[1]).all()
    assert (got.hidden[1] == 0).all()


# -- manifest ---------------------------------------------------------------------------------------------------


def test_manifest_fields_match_the_files(store: ObjectStore, tmp_path: Path) -> None:
    lengths = [3, 4, 5, 6, 7]
    samples = make_samples(12, lengths)

    manifest = write(store, 12, samples, samples_per_shard=2)

    assert manifest.step == 12
    assert manifest.hidden_size == H
    assert manifest.layer_ids == LAYER_IDS
    assert manifest.dtype == "bfloat16"
    assert manifest.target == TARGET
    assert manifest.schema_version == shard_format.SCHEMA_VERSION
    assert manifest.compression == "none"
    assert manifest.num_samples == 5
    assert manifest.num_tokens == sum(lengths)
    assert [s.rows for s in manifest.shards] == [2, 2, 1]
    assert len({s.name for s in manifest.shards}) == 3
    prefix = hidden_states_prefix(RUN, 12)
    for info in manifest.shards:
        data = (tmp_path / "store" / prefix / info.name).read_bytes()
        assert info.bytes == len(data) == store.size(f"{prefix}/{info.name}")
        entries = [e for e in manifest.samples if e.shard == info.name]
        assert info.xxh3_128 == shard_file.shard_digest(memoryview(data), entries)
    assert manifest.total_bytes == sum(s.bytes for s in manifest.shards)
    assert [(e.sample_id, e.tokens) for e in manifest.samples] == [
        (s.sample_id, n) for s, n in zip(samples, lengths, strict=True)
    ]
    assert [(e.shard, e.row) for e in manifest.samples] == [
        (manifest.shards[i // 2].name, i % 2) for i in range(5)
    ]
    # The stored manifest is the returned one, and the directory holds nothing else.
    on_disk = store.read_json(f"{prefix}/{shard_format.MANIFEST}")
    assert on_disk == manifest.to_json()
    assert sorted(p.name for p in (tmp_path / "store" / prefix).iterdir()) == sorted(
        [shard_format.MANIFEST, *(s.name for s in manifest.shards)]
    )
    assert shards.has_manifest(store, RUN, 12)
    assert not shards.has_manifest(store, RUN, 13)


def test_manifest_with_another_schema_version_is_rejected() -> None:
    data = {"schema_version": 99, "shards": []}
    with pytest.raises(ShardError, match="schema_version 99"):
        shard_format.Manifest.from_json(data)


@pytest.mark.parametrize("compression", shard_format.COMPRESSIONS)
def test_schema_3_manifests_are_read_unless_their_frames_changed(store: ObjectStore, compression: str) -> None:
    samples = make_samples(3, [4, 6])
    manifest = write(store, 3, samples, compression=compression)
    old = manifest.to_json() | {"schema_version": 3}
    if compression == "split-zstd":  # schema 3 stored Blosc frames there
        with pytest.raises(ShardError, match="schema_version 3 with compression 'split-zstd'.*re-materialize"):
            shard_format.Manifest.from_json(old)
        return
    read = list(shards.iter_samples(store, RUN, shard_format.Manifest.from_json(old)))
    for got, want in zip(read, samples, strict=True):
        assert got.sample_id == want.sample_id
        assert got.hidden.shape == want.hidden.shape


# -- validation: a bad write raises and leaves the store unchanged ---------------------------------------------


def _with_hidden(value: float) -> Callable[[list[HiddenSample]], list[HiddenSample]]:
    def corrupt(samples: list[HiddenSample]) -> list[HiddenSample]:
        hidden = samples[1].hidden.clone()
        hidden[2, 0, 3] = value
        return [samples[0], replace(samples[1], hidden=hidden), *samples[2:]]

    return corrupt


def _ids_too_long(samples: list[HiddenSample]) -> list[HiddenSample]:
    s = samples[1]
    return [samples[0], replace(s, input_ids=torch.cat([s.input_ids, s.input_ids[:1]])), *samples[2:]]


def _mask_too_short(samples: list[HiddenSample]) -> list[HiddenSample]:
    s = samples[1]
    return [samples[0], replace(s, loss_mask=s.loss_mask[:-1]), *samples[2:]]


def _wrong_hidden_size(samples: list[HiddenSample]) -> list[HiddenSample]:
    s = samples[1]
    return [samples[0], replace(s, hidden=torch.zeros(s.hidden.shape[0], 1, H * 2, dtype=torch.bfloat16)), *samples[2:]]


def _wrong_layers(samples: list[HiddenSample]) -> list[HiddenSample]:
    s = samples[1]
    return [samples[0], replace(s, hidden=s.hidden.repeat(1, 2, 1)), *samples[2:]]


def _wrong_dtype(dtype: torch.dtype) -> Callable[[list[HiddenSample]], list[HiddenSample]]:
    def corrupt(samples: list[HiddenSample]) -> list[HiddenSample]:
        s = samples[1]
        return [samples[0], replace(s, hidden=torch.zeros(s.hidden.shape, dtype=dtype)), *samples[2:]]

    return corrupt


def _duplicate_id(samples: list[HiddenSample]) -> list[HiddenSample]:
    return [*samples, replace(samples[2], sample_id=samples[0].sample_id)]


def _empty(samples: list[HiddenSample]) -> list[HiddenSample]:
    return []


BAD = functools.partial(pytest.mark.reliability, "bad_input")

BAD_INPUTS = [
    pytest.param(_with_hidden(float("nan")), "NaN or Inf", id="nan-hidden", marks=BAD("NaN hidden states")),
    pytest.param(_with_hidden(float("inf")), "NaN or Inf", id="inf-hidden", marks=BAD("Inf hidden states")),
    pytest.param(_with_hidden(float("-inf")), "NaN or Inf", id="minus-inf-hidden", marks=BAD("Inf hidden states")),
    pytest.param(_ids_too_long, "token ids.*must all agree", id="ids-hidden-length-mismatch",
                 marks=BAD("token ids and hidden states of different lengths")),
    pytest.param(_mask_too_short, "loss mask.*must all agree", id="mask-length-mismatch",
                 marks=BAD("loss mask and token ids of different lengths")),
    pytest.param(_wrong_hidden_size, f"hidden size {2 * H} differs from the target's {H}", id="hidden-size",
                 marks=BAD("hidden size different from the target's")),
    pytest.param(_wrong_layers, r"expected \(T, 1, H\)", id="layer-count"),
    pytest.param(_wrong_dtype(torch.float32), "torch.float32, expected torch.bfloat16", id="dtype-float32"),
    pytest.param(_wrong_dtype(torch.float16), "torch.float16, expected torch.bfloat16", id="dtype-float16"),
    pytest.param(_duplicate_id, "duplicate sample_id 's5-0'", id="duplicate-ids",
                 marks=BAD("duplicate sample ids (hidden states)")),
    pytest.param(_empty, "empty step", id="empty-step", marks=BAD("empty step (hidden states)")),
]


@pytest.mark.parametrize(("corrupt", "message"), BAD_INPUTS)
def test_bad_input_raises_and_writes_nothing(
    store: ObjectStore, tmp_path: Path, corrupt: Callable, message: str
) -> None:
    bad = corrupt(make_samples(5, [4, 6, 5]))
    before = snapshot(tmp_path)

    with pytest.raises(ShardError, match=message):
        write(store, 5, bad, samples_per_shard=1)

    assert snapshot(tmp_path) == before
    assert not shards.has_manifest(store, RUN, 5)
    assert not (tmp_path / "store" / hidden_states_prefix(RUN, 5)).exists() or not any(
        (tmp_path / "store" / hidden_states_prefix(RUN, 5)).iterdir()
    )


@pytest.mark.parametrize(("corrupt", "message"), BAD_INPUTS)
def test_bad_rewrite_keeps_the_previous_good_write(
    store: ObjectStore, tmp_path: Path, corrupt: Callable, message: str
) -> None:
    good = make_samples(5, [3, 4], seed=1)
    manifest = write(store, 5, good, samples_per_shard=1)
    before = snapshot(tmp_path)

    with pytest.raises(ShardError, match=message):
        write(store, 5, corrupt(make_samples(5, [4, 6, 5])), samples_per_shard=1)

    assert snapshot(tmp_path) == before
    assert shards.read_manifest(store, RUN, 5) == manifest
    for got, want in zip(shards.iter_samples(store, RUN, manifest), good, strict=True):
        assert_same_sample(got, want)


# -- rewrite ----------------------------------------------------------------------------------------------------


def test_rewrite_replaces_manifest_and_removes_old_shards(store: ObjectStore, tmp_path: Path) -> None:
    directory = tmp_path / "store" / hidden_states_prefix(RUN, 3)
    first = write(store, 3, make_samples(3, [3, 4, 5], seed=1), samples_per_shard=2)
    assert len(first.shards) == 2

    new_samples = make_samples(3, [6], seed=2)
    second = write(store, 3, new_samples)

    assert shards.read_manifest(store, RUN, 3) == second
    assert not {s.name for s in first.shards} & {s.name for s in second.shards}
    assert sorted(p.name for p in directory.iterdir()) == sorted([shard_format.MANIFEST, second.shards[0].name])
    (got,) = shards.iter_samples(store, RUN, second)
    assert_same_sample(got, new_samples[0])


def test_steps_are_independent(store: ObjectStore) -> None:
    a = write(store, 1, make_samples(1, [3], seed=1))
    b = write(store, 2, make_samples(2, [4, 5], seed=2))

    assert [s.sample_id for s in shards.iter_samples(store, RUN, a)] == ["s1-0"]
    assert [s.sample_id for s in shards.iter_samples(store, RUN, b)] == ["s2-0", "s2-1"]
    assert shards.read_manifest(store, RUN, 1) == a


def test_a_compressed_frame_is_checked_before_it_is_decoded() -> None:
    # Two and a bit chunks, every bf16 bit pattern: the last chunk is a short one.
    values = random_bf16((2, CHUNK_WORDS + 7), torch.Generator().manual_seed(3))
    frame = compress_bf16(values)
    out = torch.empty_like(values)
    decompress_bf16_into(bytearray(frame), out)
    assert torch.equal(out.view(torch.int16), values.view(torch.int16))

    words = values.numel()
    with pytest.raises(CompressionError, match=f"decodes to {2 * words} bytes; the torch.bfloat16 tensor to fill "
                                               f"holds {words}"):
        decompress_bf16_into(frame, torch.empty(words // 2, dtype=torch.bfloat16))
    with pytest.raises(CompressionError, match=f"not a whole compressed frame: {len(frame) - 1} bytes"):
        decompress_bf16_into(frame[:-1], torch.empty_like(values))
    with pytest.raises(CompressionError, match="not a split-zstd frame"):
        decompress_bf16_into(frame[:3], torch.empty_like(values))
    first_chunk = 16 + 4 + 4 * 3  # header, three chunk sizes
    garbled = bytearray(frame)
    garbled[first_chunk : first_chunk + 4] = b"nope"  # the chunk's zstd magic number
    with pytest.raises(CompressionError, match="the chunk at word 0 does not decode"):
        decompress_bf16_into(garbled, torch.empty_like(values))


# -- shards cut beforehand, written by ranks ---------------------------------------------------------------------


def test_shard_cuts_are_the_cuts_the_streaming_writer_makes(store: ObjectStore, monkeypatch) -> None:
    """Rows and bytes limits: `shard_cuts` from the lengths alone gives the shards `write_hidden_states` cuts
    while streaming, so ranks can share a step's shards before any forward."""
    lengths = [9, 2, 7, 7, 1, 12, 3, 3, 3, 8]
    monkeypatch.setattr(shards, "SHARD_TARGET_BYTES", 16 * H * 2)
    manifest = write(store, 1, make_samples(1, lengths), samples_per_shard=3)
    cuts = shards.shard_cuts(lengths, H * 2, max_rows=3, max_bytes=16 * H * 2)
    assert [len(c) for c in cuts] == [s.rows for s in manifest.shards] == [2, 3, 2, 3]


def test_a_ranked_write_of_one_rank_equals_the_streaming_write(store: ObjectStore) -> None:
    """The same samples in the same shards: byte-identical shards, the same content digest, another write id."""
    samples = make_samples(1, [6, 5, 5, 4, 3])
    streamed = write(store, 1, samples, samples_per_shard=2)
    streamed_bytes = [store.read_bytes(f"{hidden_states_prefix(RUN, 1)}/{s.name}") for s in streamed.shards]
    cuts = shards.shard_cuts([6, 5, 5, 4, 3], H * 2, max_rows=2)
    units = [shards.ShardUnit(i, lambda c=c: samples[c.start : c.stop]) for i, c in enumerate(cuts)]
    ranked = shards.write_hidden_states_ranked(store, RUN, 1, units, hidden_size=H, layer_ids=LAYER_IDS,
                                               target=TARGET)
    assert ranked.write_id != streamed.write_id
    assert ranked.content_digest() == streamed.content_digest()
    assert [store.read_bytes(f"{hidden_states_prefix(RUN, 1)}/{s.name}") for s in ranked.shards] == streamed_bytes
    other = replace(make_samples(1, [3], seed=1)[0], sample_id=samples[4].sample_id)  # other values, same id
    changed = write(store, 1, [*samples[:4], other], samples_per_shard=2)
    assert changed.content_digest() != streamed.content_digest()
