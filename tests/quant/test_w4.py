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


@pytest.mark.parametrize("group,bits", [(128, 4), (32, 4), (256, 4), (64, 3), (96, 4)])
def test_pack_unpacks_to_the_same_matrix(group, bits):
    k = 384 if group == 96 else 512
    qw = qweight(k=k, group=group, bits=bits)
    w = W4Weight.pack(qw, torch.float32, CPU)
    assert w.shape == qw.shape and w.qweight.dtype == torch.uint8 and w.qweight.shape == (32, k // 2)
    assert w.group == {96: 32}.get(group, group)  # a group that is no power of two is replicated down
    assert torch.equal(w.dequantize(), qw.dequantize())
    # bf16: scale and offset rounded once, the product rounded once (what the kernel computes)
    b = W4Weight.pack(qw, torch.bfloat16, CPU)
    want = (qw.codes.float().view(32, k // w.group, w.group) * b.scale.float()[:, :, None]
            + b.offset.float()[:, :, None]).view(32, k).to(torch.bfloat16)
    assert torch.equal(b.dequantize(), want)
    assert b.nbytes() == 32 * k // 2 + 2 * 2 * 32 * (k // w.group)


def test_what_fits():
    assert w4_group(qweight()) == 128
    assert w4_group(qweight(bits=8)) is None  # 8-bit codes: dequantized on the GPU
    assert w4_group(qweight(perm=torch.randperm(256))) is None  # act-order: groups are not contiguous
    assert w4_group(qweight(k=24, group=24)) is None  # no power-of-two group ≥ 16 divides it
    with pytest.raises(ValueError, match="does not fit W4"):
        W4Weight.pack(qweight(bits=8), torch.bfloat16, CPU)


def test_kernel_module_follows_the_device():
    qw = quantize_float(torch.randn(64, 256), 4, 128, False, "int4")
    assert make_quant_linear(qw, None).kernel == "int4pack"  # no device given: the CPU
    assert make_quant_linear(qw, None, torch.empty(1)).kernel == "int4pack"
