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
                                         (32, 4, 96), (64, 4, 576), (16, 4, 48)])
def test_pack_unpacks_to_the_same_matrix(group, bits, k):
    qw = qweight(k=k, group=group, bits=bits)
    w = W4Weight.pack(qw, torch.float32, CPU)
    step = max(64, w.group)
    kp = -(-k // step) * step  # K padded to whole chunks of 64 codes and whole groups
    assert w.shape == qw.shape and w.qweight.dtype == torch.int32 and w.qweight.shape == (2, kp // 64, 32, 4)
    assert w.kp == kp
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


def test_layout_is_the_mma_fragments():
    """Lane 4g + τ of tile t, chunk c, word s: nibble h + NIB[kk] holds the code of row 16t + 8h + g at
    k = 64c + 16s + 4τ + kk, so nibbles j and j + 4 are the halves of A register j of
    ``mma.m16n8k16`` (rows g / g + 8 for j even / odd, K slots 2τ, 2τ + 1 for j < 2, else 2τ + 8, 2τ + 9)."""
    from tandem.models.quant.w4_weight import NIB

    assert NIB == (0, 4, 2, 6)
    n, k = 32, 192
    qw = qweight(n=n, k=k, group=64)
    words = W4Weight.pack(qw, torch.float32, CPU).qweight
    for t in range(n // 16):
        for c in range(k // 64):
            for lane in range(32):
                g, tau = divmod(lane, 4)
                for s in range(4):
                    w = int(words[t, c, lane, s]) & 0xFFFFFFFF
                    for h in (0, 1):
                        for kk in range(4):
                            code = int(qw.codes[16 * t + 8 * h + g, 64 * c + 16 * s + 4 * tau + kk])
                            assert (w >> (4 * (h + NIB[kk]))) & 15 == code, (t, c, lane, s, h, kk)
    # register j = nibbles (j, j + 4): A fragment element pairs (row, slot) of the PTX ISA's m16n8k16 layout
    for j, (h, kk0) in enumerate(((0, 0), (1, 0), (0, 2), (1, 2))):
        assert (h + NIB[kk0], h + NIB[kk0 + 1]) == (j, j + 4)


def test_rows_come_in_tiles_of_sixteen():
    assert w4_group(qweight(n=40)) is None  # N not a multiple of 16: dequantized on the GPU
    assert w4_group(qweight(n=48)) == 128


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
