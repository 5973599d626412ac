"""GGUF (llama.cpp) quant blocks → :class:`QuantizedWeight`, without dequantizing.

Block layouts are ggml-common.h's (the same as ``gguf.quants``, which the tests use as the reference
dequantizer). Every block type here maps exactly onto ``scale · code + offset`` per 32 columns:

====== ====== ============================================== =====================================
type   bits   block                                          scale / offset per 32
====== ====== ============================================== =====================================
Q4_0   4      fp16 d, 16 B nibbles (q[j] low, q[j+16] high)   d / −8·d
Q4_1   4      fp16 d, fp16 m, 16 B nibbles                    d / m
Q5_0   5      fp16 d, u32 high bits, 16 B nibbles             d / −16·d
Q5_1   5      fp16 d, fp16 m, u32 high bits, 16 B nibbles     d / m
Q8_0   8      fp16 d, 32 × int8                               d / −128·d (code = q + 128)
Q4_K   4      256-wide: fp16 d, dmin, 12 B 6-bit (sc, m)×8,   d·sc_j / −dmin·m_j (sub-blocks of 32)
              128 B nibbles (low: sub-block 2i, high: 2i+1)
Q5_K   5      as Q4_K plus 32 B of high bits (bit i: sb i)    d·sc_j / −dmin·m_j
Q6_K   6      256-wide: 128 B low nibbles, 64 B high 2-bit    per 16: d·sc_j / −32·d·sc_j
              pairs, 16 × int8 sc, fp16 d (groups of 16)
====== ====== ============================================== =====================================

Q6_K's groups are 16 wide: only ``cpu_q4``'s byte layout holds them (elsewhere the loader dequantizes
the weight, as it does Q2_K / Q3_K, which are not read natively; docs/quantization.md).
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.models.quant.weights import QuantizedWeight

# ggml type name -> (bytes per block, elements per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
    "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256),
}
NATIVE_TYPES: tuple[str, ...] = tuple(BLOCKS)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: byte j holds element j (low) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks [rows, nb, 210] -> codes [rows, nb, 256] (q + 32, 0..63) and the 16 scales d·sc
    per block (ggml's dequantize_row_q6_K: per half of 128, element 32k + l takes ql[l + 32 (k & 1)]'s
    low (k < 2) or high nibble and bits 2k, 2k + 1 of qh[l])."""
    ql, qh = b[..., 0:128].reshape(*b.shape[:-1], 2, 64), b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-2)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [rows, nb, 2, 4, 32]
    codes = (low | (high << 4)).reshape(*b.shape[:-1], 256)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    return codes, _f16(b[..., 208:210])[..., None] * sc


def parse_blocks(raw: np.ndarray, qtype: str, rows: int, cols: int) -> QuantizedWeight:
    """Raw blocks of a ``[rows, cols]`` tensor (torch order) -> QuantizedWeight (group 32; Q6_K 16)."""
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF type {qtype} has no native layout")
    size, per = BLOCKS[qtype]
    if cols % per:
        raise ValueError(f"{qtype}: {cols} columns are not a multiple of {per}")
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // per, size)
    if qtype == "Q6_K":
        codes, scale = _q6_k(b)
        to16 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(rows, cols // 16))  # noqa: E731
        return QuantizedWeight(codes=torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols)),
                               scale=to16(scale), offset=to16(-32.0 * scale), group=16, bits=6,
                               source=f"gguf {qtype}")
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b[..., 0:2])
        has_m = qtype in ("Q4_1", "Q5_1")
        p = 4 if has_m else 2
        m = _f16(b[..., 2:4]) if has_m else None
        if qtype == "Q8_0":
            codes = b[..., 2:34] ^ np.uint8(0x80)  # int8 q -> q + 128 (two's complement), one copy
            offset, bits = -128.0 * d, 8
        elif qtype in ("Q4_0", "Q4_1"):
            codes = _nibbles(b[..., p:p + 16])
            offset, bits = (m if m is not None else -8.0 * d), 4
        else:
            qh = np.ascontiguousarray(b[..., p:p + 4]).view(np.uint32)  # [rows, nb, 1]
            high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            codes = _nibbles(b[..., p + 4:p + 20]) | (high << 4)
            offset, bits = (m if m is not None else -16.0 * d), 5
        scale = d
    else:  # Q4_K / Q5_K: 8 sub-blocks of 32 per 256
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(rows, cols // per, 4, 32)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols // per, 8, 32)
        bits = 4
        if qtype == "Q5_K":
            qh = b[..., 16:48]  # [rows, nb, 32]
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [rows, nb, 8, 32]
            codes = codes | (high << 4)
            bits = 5
        scale = d[..., None] * sc
        offset = -(dmin[..., None] * mn)
    n_groups = cols // 32
    to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(rows, n_groups))  # noqa: E731
    return QuantizedWeight(
        codes=torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8).reshape(rows, cols)),
        scale=to_t(scale), offset=to_t(offset), group=32, bits=bits, source=f"gguf {qtype}")
