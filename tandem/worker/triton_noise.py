"""Keyed noise rows in one launch: row i is Exp(1) (or U[0, 1)) values drawn by Philox from key i.

A seeded request draws the randomness of output position n from a stream keyed by (seed, n,
purpose) (sample/seeded.py), so its tokens do not depend on the batch or on what earlier steps drew.
With a torch generator per row that is a reseed and a launch per seeded row: 64 of each per step at
batch 64. Here every seeded row of a step is one kernel launch: program (i, b) writes columns
b·BLOCK.. of row i from Philox(key_i, column), a function of the key alone (tests/worker/test_gpu.py
checks that a row is the same whatever the other rows are, and the values' laws).

Exp(1) is −log(u) for u ~ U[0, 1): values near 0 (the draws that decide an exponential race) come
from u near 1, and u = 0 or 1 (after float32 rounding) are clamped, as torch's draws are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _keyed_noise_kernel(key_ptr, out_ptr, width, BLOCK: tl.constexpr, EXPONENTIAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(key_ptr + row)
    u = tl.rand(key, offs)  # [BLOCK] float32 in [0, 1]
    if EXPONENTIAL:
        u = tl.maximum(-tl.log(tl.maximum(u, 1.1754943508222875e-38)), 1.1754943508222875e-38)
    tl.store(out_ptr + row * width + offs, u, mask=offs < width)


def keyed_noise(keys: torch.Tensor, width: int, exponential: bool) -> torch.Tensor:
    """[len(keys), width] float32 on keys' (CUDA) device: Exp(1) values (``exponential``) or U[0, 1),
    row i a function of keys[i] (int64, < 2**63) only."""
    n = keys.numel()
    out = torch.empty((n, width), dtype=torch.float32, device=keys.device)
    if n:
        _keyed_noise_kernel[(n, triton.cdiv(width, BLOCK))](keys, out, width, BLOCK=BLOCK, EXPONENTIAL=exponential,
                                                              num_warps=4)
    return out


def compile_keyed_noise(vocab: int, device: torch.device) -> None:
    """Compile both variants a step can use (the race's rows of ``vocab`` values, acceptance
    uniforms), so no seeded request compiles one mid-serving."""
    keys = torch.zeros(1, dtype=torch.int64, device=device)
    keyed_noise(keys, vocab, True)
    keyed_noise(keys, 1, False)


__all__ = ["keyed_noise", "compile_keyed_noise"]
