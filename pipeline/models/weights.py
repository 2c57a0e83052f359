"""The layout of a transformers safetensors checkpoint, read from headers only.

A checkpoint holds its tensors in `model.safetensors` or in shards named by
`model.safetensors.index.json`. Everything here reads the 8-byte header length and the JSON
header of each file (never tensor data), so a checkpoint can be checked against the model
its config implies before a byte of weights is allocated. The checkpoint is written by an
untrusted trainer: every length, offset and name is bounded and cross-checked.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import IO

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# A header lists names, dtypes, shapes and offsets: megabytes at most, even for thousands of tensors.
MAX_HEADER_BYTES = 100 * 2**20
MAX_INDEX_BYTES = 64 * 2**20
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


class TargetCheckpointError(ValueError):
    """A policy checkpoint that is refused; the message names the checkpoint and what is wrong."""


class WeightsLayoutError(TargetCheckpointError):
    """A weights file or index that is empty, truncated or malformed."""


class PickledWeightsError(TargetCheckpointError):
    """Weights only as pickles (pytorch_model.bin, ...): loading them would run code from the file."""


class MissingWeightsError(TargetCheckpointError):
    """No safetensors weights at all."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str  # the file name inside the checkpoint directory
    dtype: str  # safetensors dtype code: BF16, F32, ...
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WeightsLayout:
    files: tuple[str, ...]  # weight files, in the index's order
    tensors: dict[str, TensorEntry]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def layout_file(names: list[str], where: str) -> str:
    """The file a directory listing's layout starts from: INDEX_FILE for shards, else SINGLE_FILE;
    pickles only, or nothing, are refused by name."""
    if INDEX_FILE in names:
        return INDEX_FILE
    if SINGLE_FILE in names:
        return SINGLE_FILE
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise PickledWeightsError(
            f"{where}: weights only as {', '.join(pickles)} (pickle, which can run code when loaded); "
            f"the policy must be saved as safetensors ({SINGLE_FILE} or {INDEX_FILE} + shards, "
            "e.g. save_pretrained(..., safe_serialization=True))"
        )
    raise MissingWeightsError(f"{where}: no {SINGLE_FILE} and no {INDEX_FILE}")


def parse_index(raw: bytes, where: str) -> dict[str, str]:
    """weight_map of an index: tensor name -> shard file name (a plain name in the same directory)."""
    if len(raw) > MAX_INDEX_BYTES:
        raise WeightsLayoutError(f"{where}/{INDEX_FILE}: {len(raw)} bytes, more than an index can need")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsLayoutError(f"{where}/{INDEX_FILE}: not JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsLayoutError(f"{where}/{INDEX_FILE}: no weight_map")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors") or "/" in file or "\\" in file \
                or file.startswith("."):
            raise WeightsLayoutError(
                f"{where}/{INDEX_FILE}: tensor {name!r} maps to {file!r}, not a .safetensors file in the directory"
            )
    return weight_map


def read_header(f: IO[bytes], size: int, where: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file of `size` bytes, checked to tile its data exactly."""
    if size < 8:
        raise WeightsLayoutError(f"{where}: {size} bytes, not a safetensors file (empty or truncated)")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise WeightsLayoutError(f"{where}: header of {length} bytes in a file of {size}")
    try:
        header = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsLayoutError(f"{where}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightsLayoutError(f"{where}: header is not a mapping")
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    file = where.rsplit("/", 1)[-1]
    entries, spans = {}, []
    for name, info in header.items():
        entries[name] = _entry(name, info, file, where, spans, 8 + length)
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise WeightsLayoutError(f"{where}: tensor {name} starts at byte {begin}, expected {end} (gap or overlap)")
        end = stop
    if end != data_size:
        raise WeightsLayoutError(f"{where}: tensors end at byte {end} of {data_size} data bytes (truncated or padded)")
    return entries


def _entry(name: str, info: object, file: str, where: str, spans: list, base: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise WeightsLayoutError(f"{where}: tensor {name}: entry is not a mapping")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise WeightsLayoutError(f"{where}: tensor {name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise WeightsLayoutError(f"{where}: tensor {name}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise WeightsLayoutError(f"{where}: tensor {name}: data_offsets {offsets!r} malformed")
    entry = TensorEntry(name, file, dtype, tuple(shape), base + offsets[0])
    if offsets[1] - offsets[0] != entry.nbytes:
        raise WeightsLayoutError(
            f"{where}: tensor {name}: {offsets[1] - offsets[0]} bytes for shape {tuple(shape)} of {dtype}"
        )
    spans.append((offsets[0], offsets[1], name))
    return entry


def join_shards(weight_map: dict[str, str], shards: dict[str, dict[str, TensorEntry]], where: str) -> WeightsLayout:
    """One layout from the index and each shard's header: every tensor in exactly the shard the index names."""
    tensors: dict[str, TensorEntry] = {}
    for file, entries in shards.items():
        for name, entry in entries.items():
            if name in tensors:
                raise WeightsLayoutError(f"{where}: tensor {name} is in both {tensors[name].file} and {file}")
            if weight_map.get(name) != file:
                raise WeightsLayoutError(
                    f"{where}/{file}: holds tensor {name}, which {INDEX_FILE} places in {weight_map.get(name)}"
                )
            tensors[name] = entry
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise WeightsLayoutError(
            f"{where}: {INDEX_FILE} lists tensor {absent[0]} in {weight_map[absent[0]]}, which does not hold it"
            + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else "")
        )
    return WeightsLayout(tuple(shards), tensors)
