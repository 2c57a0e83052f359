"""Compression of bf16 hidden states for object storage.

`storage.compression: split-zstd` (lossless)
--------------------------------------------
A bf16 word's high byte is the sign and 7 of the 8 exponent bits: a residual stream uses a
few exponents, so it entropy-codes to about 3 bits. Its low byte is 1 exponent bit and 7
mantissa bits: noise to any compressor. So the low bytes are stored raw and the high bytes
are Huffman-coded by zstd, about 1.46x smaller in all.
    frame = [header][zstd frame of the high bytes of each chunk of CHUNK_WORDS words][low bytes]
    header = b"SZ16", word count (u64), chunk count (u32), each chunk's zstd frame size (u32)
A chunk's high bytes are decoded into a buffer that stays in cache and combined with the
low bytes into words (high << 8 | low: two numpy passes) straight in the caller's tensor.

Why literals only (no LZ matching): 3-bit symbols repeat in short, frequent matches that
halve zstd's decoding speed and do not pay for themselves. On the 2-core CI machine zstd
level 1 decoded high bytes at 0.6 GB/s and a ratio of 1.44; literals only at 1.05 GB/s
and 1.46. A whole compressed read (digest, decode into fresh tensors) made 0.64-1.06 GB/s
of bf16 per core with Blosc frames (byte shuffle + zstd level 1 per 512 KiB block) and
0.96-1.24 with these.

`storage.compression: fp8-e4m3` (lossy, half the bytes)
------------------------------------------------------
Each token's H values are scaled so that its largest magnitude maps to e4m3's largest
finite value (448), rounded to float8 e4m3, and stored with that per-token float32 scale,
the scheme of vLLM's fp8 hidden-state connectors: a relative error of at most 2^-4 for a
token's larger values (3 mantissa bits), more for values far below its largest.
    frame = [T float32 scales][T * H e4m3 bytes]
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import torch

try:
    import zstandard
except ImportError:  # only split-zstd needs it: raw and fp8 shards are written and read without it
    zstandard = None

# 128 KiB of high bytes per zstd frame: decoded into L2 and combined into words from there.
CHUNK_WORDS = 1 << 17
_MAGIC = b"SZ16"
_HEADER = struct.Struct("<4sQI")  # magic, words, chunks; then a u32 size per chunk
_per_thread = threading.local()  # zstd contexts are not thread-safe: one set per thread


def _zstd() -> threading.local:
    if not hasattr(_per_thread, "decoder"):
        if zstandard is None:
            raise CompressionError("split-zstd needs the zstandard package (pip install zstandard)")
        # Literals only: with a 7-byte minimum match and one probe zstd finds (almost) no matches in
        # high bytes and Huffman-codes them; the window is the chunk.
        literals_only = zstandard.ZstdCompressionParameters(
            window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, strategy=zstandard.STRATEGY_FAST
        )
        _per_thread.encoder = zstandard.ZstdCompressor(compression_params=literals_only)
        _per_thread.decoder = zstandard.ZstdDecompressor()
        _per_thread.high = np.empty(CHUNK_WORDS, np.uint8)  # one chunk's decoded high bytes
    return _per_thread


E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


class CompressionError(ValueError):
    """A frame that does not decode to the tensor it is meant to fill."""


def compress_bf16(values: torch.Tensor) -> bytes:
    """A frame holding a contiguous bf16 tensor's bytes, losslessly."""
    if values.dtype != torch.bfloat16 or not values.is_contiguous():
        raise CompressionError(f"expected a contiguous bfloat16 tensor, got {values.dtype} (contiguous: "
                               f"{values.is_contiguous()})")
    words = values.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    encoder = _zstd().encoder
    chunks = [encoder.compress((words[i : i + CHUNK_WORDS] >> 8).astype(np.uint8))
              for i in range(0, words.size, CHUNK_WORDS)]
    sizes = np.array([len(c) for c in chunks], dtype="<u4")
    low = (words & 0xFF).astype(np.uint8)
    return b"".join([_HEADER.pack(_MAGIC, words.size, len(chunks)), sizes.tobytes(), *chunks, low.tobytes()])


def decompress_bf16_into(frame: bytes | bytearray | memoryview, out: torch.Tensor) -> None:
    """Decode a frame straight into `out` (contiguous bf16 of the frame's size)."""
    # Every size is checked before decoding: nothing is written past a chunk or the tensor.
    frame = memoryview(frame).cast("B")
    if len(frame) < _HEADER.size or bytes(frame[:4]) != _MAGIC:
        raise CompressionError(f"not a split-zstd frame (starts with {bytes(frame[:4])!r})")
    _, count, chunks = _HEADER.unpack_from(frame)
    if not out.is_contiguous() or out.dtype != torch.bfloat16 or count != out.numel():
        raise CompressionError(f"frame decodes to {count * 2} bytes; the {out.dtype} tensor to fill holds "
                               f"{out.numel() * out.element_size()}")
    pos = _HEADER.size + 4 * chunks
    sizes = np.frombuffer(frame, "<u4", chunks, _HEADER.size) if pos <= len(frame) else np.zeros(0, "<u4")
    whole = pos + int(sizes.sum(dtype=np.int64)) + count
    if chunks != -(-count // CHUNK_WORDS) or whole != len(frame):
        raise CompressionError(f"not a whole compressed frame: {len(frame)} bytes, its header says {whole}")
    low = np.frombuffer(frame, np.uint8, count, len(frame) - count)
    words = out.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    zstd = _zstd()
    for start, size in zip(range(0, count, CHUNK_WORDS), sizes.tolist(), strict=True):
        n = min(CHUNK_WORDS, count - start)
        high = _decode_chunk(zstd.decoder, frame[pos : pos + size], zstd.high[:n], start)
        pos += size
        chunk = words[start : start + n]
        np.left_shift(high, 8, out=chunk, dtype=np.uint16)
        np.bitwise_or(chunk, low[start : start + n], out=chunk)


def _decode_chunk(decoder: zstandard.ZstdDecompressor, data: memoryview, high: np.ndarray, start: int) -> np.ndarray:
    """Fill `high` from one zstd frame that must decode to exactly its size. (Flipped bits inside
    a chunk may decode to other bytes: the range digest, checked before decoding, catches them.)"""
    filled = 0
    try:
        if zstandard.frame_content_size(data) != high.size:
            raise CompressionError(f"the chunk at word {start} does not decode to {high.size} bytes")
        with decoder.stream_reader(data) as reader:
            while filled < high.size and (got := reader.readinto(high[filled:])):
                filled += got
    except zstandard.ZstdError as exc:
        raise CompressionError(f"the chunk at word {start} does not decode: {exc}") from exc
    if filled != high.size:
        raise CompressionError(f"the chunk at word {start} decoded to {filled} bytes, not {high.size}")
    return high


def quantize_fp8(values: torch.Tensor) -> bytes:
    """(T, H) bf16 -> a frame of per-token float32 scales and e4m3 values."""
    amax = values.float().abs().amax(dim=1, keepdim=True)  # (T, 1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # all-zero token: any scale
    quantized = (values.float() / scale).to(torch.float8_e4m3fn)  # (T, H)
    return scale.flatten().numpy().tobytes() + quantized.view(torch.uint8).numpy().tobytes()


def dequantize_fp8_into(frame: bytes | bytearray | memoryview, out: torch.Tensor) -> None:
    """Fill `out` ((T, H) bf16) from a frame written by quantize_fp8."""
    tokens, hidden_size = out.shape
    if len(frame) != tokens * (4 + hidden_size):
        raise CompressionError(f"fp8 frame of {len(frame)} bytes; ({tokens}, {hidden_size}) takes "
                               f"{tokens * (4 + hidden_size)}")
    if memoryview(frame).readonly:  # torch views only writable memory; a local shard's map is writable
        frame = bytearray(frame)
    scale = torch.frombuffer(frame, dtype=torch.float32, count=tokens)  # (T,)
    quantized = torch.frombuffer(frame, dtype=torch.uint8, offset=tokens * 4).view(torch.float8_e4m3fn)
    out.copy_(quantized.view(tokens, hidden_size).float() * scale[:, None])
