"""llama.cpp's block-quantized tensor types as MLX affine quantization, bit for bit.

MLX's affine layout stores, per group of ``group_size`` consecutive weights of a row, one float32
scale ``s`` and bias ``b`` and ``bits``-bit codes ``c``: ``w = s * c + b``. Every llama.cpp type
whose blocks are ``scale * integer (+ offset)`` maps onto it exactly: the codes are the block's
integers (shifted to be unsigned), the scale and bias are what the block's own arithmetic gives
(a K-quant's super-block scale times a sub-block's 6- or 4-bit scale, computed in float32 as
llama.cpp does). Each such product ``s * c`` needs at most 24 significant bits (a float16 times
integers of at most 13 bits together), so it is exact in float32, and ``s * c + b`` rounds once,
exactly where ``gguf.quants.dequantize`` rounds: ``mx.dequantize`` of the result equals the
``gguf`` package's values bit for bit (tests/test_gguf_quants.py checks every type).

===========  ==================  ==========================================================
GGUF type    MLX layout          why
===========  ==================  ==========================================================
Q4_0, Q4_1   4-bit, groups of 32  one float16 scale (and minimum) per 32 weights
Q5_0, Q5_1   5-bit, groups of 32  the same with a fifth bit per weight
Q8_0         8-bit, groups of 32  int8 codes shifted by 128, bias ``-128 * scale``
Q4_K, Q5_K   4/5-bit, groups of   a 256-weight super-block of eight 32-weight sub-blocks, each
             32                   with its own 6-bit scale and minimum: scale ``d * sc``, bias
                                  ``-dmin * m`` per sub-block
Q6_K         6-bit, groups of 16  sixteen 16-weight sub-blocks with int8 scales: no group of 32
                                  shares one scale, so 16 is the nearest exact group; MLX
                                  dequantizes groups of 16, its matmuls do not (loading.py
                                  runs them on the native kernels or dequantizes them)
Q2_K, Q3_K   2/3-bit, groups of   16-weight sub-blocks, like Q6_K
             16
Q8_K         float32              a float32 scale times int8: ``scale * (q + 128)`` needs up to
                                  32 significant bits, so no 8-bit affine form is exact (and
                                  llama.cpp writes Q8_K for activations, not weights)
===========  ==================  ==========================================================

Other types (the IQ and ternary families, MXFP4) have no affine form: ``dense_values`` decodes
them with the ``gguf`` package. Plain numpy, no MLX.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: Weights per K-quant super-block.
QK_K = 256


@dataclass(frozen=True)
class Affine:
    """A tensor as MLX affine codes: ``w = scales * codes + biases`` per group of
    ``group_size`` along the last axis. ``codes`` is uint8 ``(..., K)`` (values below
    ``2 ** bits``), ``scales`` / ``biases`` float32 ``(..., K / group_size)``."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, widened to float32 ``(..., blocks, 1)``."""
    raw = np.ascontiguousarray(blocks[..., start:start + 2])
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(..., n)`` bytes -> ``(..., 2n)`` codes: the n low nibbles, then the n high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits_of(bytes_: np.ndarray, shifts: range | list[int], width: int) -> np.ndarray:
    """``(..., n)`` bytes -> ``(..., len(shifts), n)``: the ``width``-bit field at each shift."""
    shift = np.array(list(shifts), dtype=np.uint8).reshape(-1, 1)
    return (bytes_[..., None, :] >> shift) & np.uint8((1 << width) - 1)


def _affine(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
            group_size: int, lead: tuple[int, ...]) -> Affine:
    """Flatten per-block ``(..., blocks, groups, group_size)`` codes and ``(..., blocks,
    groups)`` scale and bias into rows of the tensor's shape ``lead + (K,)``."""
    return Affine(codes.reshape(*lead, -1).astype(np.uint8),
                  np.ascontiguousarray(scales, dtype=np.float32).reshape(*lead, -1),
                  np.ascontiguousarray(biases, dtype=np.float32).reshape(*lead, -1),
                  bits, group_size)


def _q4_0(b: np.ndarray) -> tuple:  # d, qs[16]
    d = _f16(b, 0)
    return _nibbles(b[..., 2:18]), d, d * np.float32(-8), 4, 32


def _q4_1(b: np.ndarray) -> tuple:  # d, m, qs[16]
    return _nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2), 4, 32


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of high bits -> ``(..., 32)``: bit j of the little-endian word."""
    return _bits_of(qh, range(8), 1).swapaxes(-1, -2).reshape(*qh.shape[:-1], 32)


def _q5_0(b: np.ndarray) -> tuple:  # d, qh[4], qs[16]
    d = _f16(b, 0)
    codes = _nibbles(b[..., 6:22]) | (_fifth_bits(b[..., 2:6]) << 4)
    return codes, d, d * np.float32(-16), 5, 32


def _q5_1(b: np.ndarray) -> tuple:  # d, m, qh[4], qs[16]
    codes = _nibbles(b[..., 8:24]) | (_fifth_bits(b[..., 4:8]) << 4)
    return codes, _f16(b, 0), _f16(b, 2), 5, 32


def _q8_0(b: np.ndarray) -> tuple:  # d, int8 qs[32]
    d = _f16(b, 0)
    return b[..., 2:34] ^ np.uint8(0x80), d, d * np.float32(-128), 8, 32


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit minimums."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    low = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale.astype(np.float32), low.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> eight sub-blocks of 32: chunk i's low nibbles, then its high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b: np.ndarray) -> tuple:  # d, dmin, scales[12], qs[128]
    scale, low = _k_scale_min(b[..., 4:16])
    codes = _k_low_nibbles(b[..., 16:144])
    return codes, _f16(b, 0) * scale, -(_f16(b, 2) * low), 4, 32


def _q5_k(b: np.ndarray) -> tuple:  # d, dmin, scales[12], qh[32], qs[128]
    scale, low = _k_scale_min(b[..., 4:16])
    codes = _k_low_nibbles(b[..., 48:176]) | (_bits_of(b[..., 16:48], range(8), 1) << 4)
    return codes, _f16(b, 0) * scale, -(_f16(b, 2) * low), 5, 32


def _q6_k(b: np.ndarray) -> tuple:  # ql[128], qh[64], int8 scales[16], d
    lead = b.shape[:-1]
    low = _bits_of(b[..., 0:128].reshape(*lead, 2, 64), [0, 4], 4).reshape(*lead, 16, 16)
    high = _bits_of(b[..., 128:192].reshape(*lead, 2, 32), [0, 2, 4, 6], 2)
    codes = low | (high.reshape(*lead, 16, 16) << 4)
    scale = _f16(b, 208) * b[..., 192:208].view(np.int8).astype(np.float32)
    return codes, scale, scale * np.float32(-32), 6, 16


def _q2_k(b: np.ndarray) -> tuple:  # scales[16], qs[64], d, dmin
    lead = b.shape[:-1]
    sc = b[..., 0:16]
    codes = _bits_of(b[..., 16:80].reshape(*lead, 2, 32), [0, 2, 4, 6], 2).reshape(*lead, 16, 16)
    scale = _f16(b, 80) * (sc & 0x0F).astype(np.float32)
    return codes, scale, -(_f16(b, 82) * (sc >> 4).astype(np.float32)), 2, 16


def _q3_k(b: np.ndarray) -> tuple:  # hmask[32], qs[64], scales[12], d
    lead = b.shape[:-1]
    low = _bits_of(b[..., 32:96].reshape(*lead, 2, 32), [0, 2, 4, 6], 2).reshape(*lead, 16, 16)
    high = _bits_of(b[..., 0:32], range(8), 1).reshape(*lead, 16, 16)
    packed = b[..., 96:108]
    low_s = _bits_of(packed[..., 0:8], [0, 4], 4).reshape(*lead, 16)
    high_s = _bits_of(packed[..., 8:12], [0, 2, 4, 6], 2).reshape(*lead, 16)
    signed = (low_s | (high_s << 4)).astype(np.float32) - np.float32(32)
    scale = _f16(b, 108) * signed
    # A set high bit means no offset: q = low - 4 * (1 - high) = (low + 4 * high) - 4.
    return low | (high << 2), scale, scale * np.float32(-4), 3, 16


_DECODERS: dict[str, tuple[int, int, Callable[[np.ndarray], tuple]]] = {
    # name: (weights per block, bytes per block, decoder)
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}

#: The GGUF types ``to_affine`` keeps quantized.
AFFINE_TYPES = frozenset(_DECODERS)


def to_affine(raw: np.ndarray, type_name: str) -> Affine:
    """The MLX affine form of a tensor of ``type_name`` whose raw bytes are ``raw``
    (``(..., bytes per row)``, as ``gguf.GGUFReader`` gives them). ``type_name`` must be in
    ``AFFINE_TYPES``; a row length that is not a whole number of blocks is a ``ValueError``."""
    per_block, block_bytes, decode = _DECODERS[type_name]
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim < 1 or raw.shape[-1] % block_bytes:
        raise ValueError(f"{type_name} rows of {raw.shape[-1:]} bytes are not whole blocks of "
                         f"{block_bytes}")
    lead = raw.shape[:-1]
    blocks = raw.reshape(*lead, raw.shape[-1] // block_bytes, block_bytes)
    codes, scale, bias, bits, group = decode(blocks)
    groups = per_block // group
    codes = codes.reshape(*blocks.shape[:-1], groups, group)
    scale = np.broadcast_to(scale, (*blocks.shape[:-1], groups))
    bias = np.broadcast_to(bias, (*blocks.shape[:-1], groups))
    return _affine(codes, scale, bias, bits, group, lead)


def q8_k_values(raw: np.ndarray) -> np.ndarray:
    """Q8_K (float32 d, int8 qs[256], int16 bsums[16]; 292 bytes) -> float32 ``d * q``, as
    llama.cpp's ``dequantize_row_q8_K`` computes it (the ``gguf`` package has no decoder)."""
    raw = np.asarray(raw, dtype=np.uint8)
    lead = raw.shape[:-1]
    if raw.shape[-1] % 292:
        raise ValueError(f"Q8_K rows of {raw.shape[-1]} bytes are not whole blocks of 292")
    blocks = raw.reshape(*lead, -1, 292)
    d = np.ascontiguousarray(blocks[..., 0:4]).view(np.float32)
    q = np.ascontiguousarray(blocks[..., 4:260]).view(np.int8).astype(np.float32)
    return (d * q).reshape(*lead, -1)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes ``(..., K)`` (``K * bits`` a multiple of 32) -> MLX's packed uint32
    ``(..., K * bits / 32)``: code j of a row at bits ``j * bits ..`` of the row's little-endian
    bit stream (what ``mx.quantize`` writes)."""
    *lead, k = codes.shape
    if (k * bits) % 32:
        raise ValueError(f"{k} codes of {bits} bits do not fill whole 32-bit words")
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    if 8 % bits == 0:  # whole codes per byte: byte b holds codes b*per .. (low bits first)
        per = 8 // bits
        runs = codes.reshape(*lead, k // per, per)
        packed = np.zeros(runs.shape[:-1], dtype=np.uint8)
        for j in range(per):
            packed |= runs[..., j] << np.uint8(j * bits)
        return packed.view(np.uint32)
    flat = codes.reshape(-1, k)
    out = np.empty((flat.shape[0], k * bits // 32), dtype=np.uint32)
    step = max(1, (1 << 22) // k)  # rows per pass: bounds the uint64 scratch to ~32 MiB
    for start in range(0, flat.shape[0], step):
        runs = flat[start:start + step].reshape(-1, k // 32, 32).astype(np.uint64)
        words = np.zeros((*runs.shape[:-1], bits), dtype=np.uint64)  # 32 codes: `bits` words
        for j in range(32):
            word, shift = divmod(j * bits, 32)
            value = runs[..., j] << np.uint64(shift)
            words[..., word] |= value & np.uint64(0xFFFFFFFF)
            if shift + bits > 32:  # the code straddles two words
                words[..., word + 1] |= value >> np.uint64(32)
        out[start:start + step] = words.astype(np.uint32).reshape(len(runs), -1)
    return out.reshape(*lead, k * bits // 32)
