"""W4Weight, the GPU's int4 layout (models/quant/w4_weight.py), on CPU: packing any ≤ 4-bit format
gives back the same matrix, which formats fit, and how the kernel module is chosen per device. The
kernel itself: tests/worker/test_triton_interpret.py (interpreter) and tests/quant/test_gpu_w4.py."""

from __future__ import annotations

import pytest
import torch

from tandem.models.quant.kernels import make_quant_linear
from tandem.models.quant.w4_weight import W4Weight, w4_group
from tandem.models.quant.weights import QuantizedWeight, quantize_float

CPU = torch.device("cpu")


def qweight(n=32, k=256, group=128, bits=4, perm=None, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    return QuantizedWeight(codes=torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g),
                           scale=torch.rand(n, k // group, generator=g) * 0.01 + 1e-3,
                           offset=torch.randn(n, k // group, generator=g) * 0.02, group=group, bits=bits,
                           source="test", perm=perm)


@pytest.mark.parametrize("group,bits,k", [(128, 4, 512), (32, 4, 512), (256, 4, 512), (64, 3, 512), (96, 4, 384),
                                         (32, 4, 96), (64, 4, 576)])
def test_pack_unpacks_to_the_same_matrix(group, bits, k):
    qw = qweight(k=k, group=group, bits=bits)
    w = W4Weight.pack(qw, torch.float32, CPU)
    kp = -(-k // 128) * 128  # K padded to runs of 128 codes
    assert w.shape == qw.shape and w.qweight.dtype == torch.int32 and w.qweight.shape == (32, kp // 8)
    assert w.group == {96: 32, 256: 128}.get(group, group)  # replicated down to a power of two <= 128
    assert torch.equal(w.codes(), qw.codes)
    assert torch.equal(w.dequantize(), qw.dequantize())
    # bf16: scale and offset rounded once, the product rounded once
    b = W4Weight.pack(qw, torch.bfloat16, CPU)
    want = (qw.codes.float().view(32, k // w.group, w.group) * b.scale.float()[:, :k // w.group, None]
            + b.offset.float()[:, :k // w.group, None]).view(32, k).to(torch.bfloat16)
    assert torch.equal(b.dequantize(), want)
    assert b.nbytes() == 32 * kp // 2 + 2 * 2 * 32 * (kp // w.group)
    # the padding is zero weights: codes, scales and offsets
    assert not b.scale[:, k // w.group:].any() and not b.offset[:, k // w.group:].any()


def test_layout_is_runs_of_sixteen_codes_per_nibble():
    """Word j of a run of 128 codes holds codes 16 i + j, code i in nibble NIBBLE[i]: even i in the
    low half-word, odd i in the high one, so nibbles t and t + 4 hold codes 2t and 2t + 1 of the same
    j (the kernel's contract: one shift and mask give two codes of one group)."""
    from tandem.models.quant.w4_weight import NIBBLE

    assert NIBBLE == (0, 4, 1, 5, 2, 6, 3, 7)
    codes = torch.arange(128, dtype=torch.uint8).remainder(16).view(1, 128)
    codes = (codes + torch.arange(128).div(16, rounding_mode="floor").view(1, 128)).remainder(16).to(torch.uint8)
    qw = QuantizedWeight(codes=codes, scale=torch.ones(1, 1), offset=torch.zeros(1, 1), group=128, bits=4,
                         source="t")
    words = W4Weight.pack(qw, torch.float32, CPU).qweight[0].tolist()
    for j in range(16):
        for t in range(4):
            assert (words[j] >> (4 * t)) & 15 == int(codes[0, 16 * (2 * t) + j]), (t, j)
            assert (words[j] >> (16 + 4 * t)) & 15 == int(codes[0, 16 * (2 * t + 1) + j]), (t, j)


def test_rows_are_tiled():
    """Rows in tiles of 16 (fewer when N is not a multiple): [N / T, runs, T, 16] words."""
    from tandem.models.quant.w4_weight import tile_rows

    assert (tile_rows(4096), tile_rows(40), tile_rows(6), tile_rows(7)) == (16, 8, 2, 1)
    qw = qweight(n=48, k=256)
    w = W4Weight.pack(qw, torch.float32, CPU)
    one = torch.cat([W4Weight.pack(QuantizedWeight(codes=qw.codes[i:i + 1], scale=qw.scale[i:i + 1],
                                                   offset=qw.offset[i:i + 1], group=128, bits=4, source="t"),
                                   torch.float32, CPU).qweight for i in range(48)])  # [48, 32]: row by row
    tiled = w.qweight.view(3, 2, 16, 16)  # [tile, run, row in tile, word]
    for n in range(48):
        for b in range(2):
            assert torch.equal(tiled[n // 16, b, n % 16], one[n, 16 * b:16 * b + 16]), (n, b)


def test_what_fits():
    assert w4_group(qweight()) == 128
    assert w4_group(qweight(bits=8)) is None  # 8-bit codes: dequantized on the GPU
    assert w4_group(qweight(perm=torch.randperm(256))) is None  # act-order: groups are not contiguous
    assert w4_group(qweight(k=24, group=24)) is None  # no power-of-two group ≥ 16 divides it
    assert w4_group(qweight(k=512, group=256)) == 128
    with pytest.raises(ValueError, match="does not fit W4"):
        W4Weight.pack(qweight(bits=8), torch.bfloat16, CPU)


def test_kernel_module_follows_the_device():
    qw = quantize_float(torch.randn(64, 256), 4, 128, False, "int4")
    cpu = {"int4pack", "cpu_q4"}  # cpu_q4 where its kernel builds (AVX-512 BF16)
    assert make_quant_linear(qw, None).kernel in cpu  # no device given: the CPU
    assert make_quant_linear(qw, None, torch.empty(1)).kernel in cpu
