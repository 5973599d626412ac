"""Every format's public packing unpacks to the reference weights, and every CPU kernel multiplies
like the dequantized float matrix (within its stated bf16 tolerance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from quant_checkpoints import awq_tensors, ct_tensors, gptq_tensors, k_quant_blocks, reference, rtn
from tandem.models.quant.gguf_blocks import parse_blocks
from tandem.models.quant import cpu_q4
from tandem.models.quant.hf_formats import HFQuantScheme, awq_weight, compressed_tensors_weight, gptq_weight
from tandem.models.quant.int4pack import Int4PackLinear, kernel_group
from tandem.models.quant.int8pack import Int8PackLinear
from tandem.models.quant.kernels import make_quant_linear
from tandem.models.quant.q4_linear import Q4Linear
from tandem.models.quant.weights import concat_rows, quantize_float

# Product tolerance of the packed kernels: bf16 scales/zeros (8 mantissa bits) and bf16 activations.
# Measured on these random matrices: 2e-3 .. 6e-3 relative (Frobenius); 2e-2 leaves a margin.
KERNEL_RTOL = 2e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def four_bit(qw, module_type):
    """What serves ``qw`` where ``module_type`` is expected: ``Q4Linear`` replaces ``Int4PackLinear`` for
    ≤ 4-bit weights on machines with its kernel (AVX-512 BF16)."""
    if module_type is Int4PackLinear and cpu_q4.fits(qw) and cpu_q4.available():
        return Q4Linear
    return module_type


def check_kernel(qw, module_type) -> None:
    """The chosen module is ``module_type`` (see ``four_bit``) and multiplies like the dequantized
    matrix; a weight served by ``Q4Linear`` is checked on ``Int4PackLinear`` too (still the kernel of
    machines without AVX-512 BF16)."""
    w = qw.dequantize()
    module = make_quant_linear(qw, None)
    assert isinstance(module, four_bit(qw, module_type))
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
    also = isinstance(module, Q4Linear) and kernel_group(qw) is not None
    for m in [module] + ([Int4PackLinear(qw, None)] if also else []):
        for rows in (1, 5):  # decode and a k+1 verify
            assert rel_err(m(x[:rows]), x[:rows] @ w.t()) < KERNEL_RTOL


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_unpack_exactly_and_run_packed(qtype):
    rows, cols = 64, 512
    t = getattr(Q, qtype)
    if qtype.endswith("_K"):
        raw = k_quant_blocks(rows, cols, t)
    else:
        w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
        raw = quantize(w, t)
    qw = parse_blocks(raw, qtype, rows, cols)
    ref = dequantize(raw, t).reshape(rows, cols)  # gguf's reference dequantizer
    np.testing.assert_array_equal(qw.dequantize().numpy(), ref)
    if qtype == "Q6_K" and not cpu_q4.available():  # groups of 16: only cpu_q4's byte layout holds them
        assert make_quant_linear(qw, None) is None
        return
    check_kernel(qw, Int4PackLinear)
    module = make_quant_linear(qw, None)
    assert isinstance(module, Q4Linear) or module.planes == (1 if qw.bits <= 4 else 2)


def test_sixteen_wide_groups_fit_only_cpu_q4():
    """Q6_K's 16-wide sub-blocks fit no 32-wide int4pack group: where cpu_q4 does not build, the
    loader dequantizes such a weight."""
    qw = quantize_float(torch.randn(32, 64), 6, 16, False, "16-wide")
    assert kernel_group(qw) is None
    module = make_quant_linear(qw, None)
    assert module is None if not cpu_q4.available() else isinstance(module, Q4Linear)


def _w(n=256, k=256, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05


@pytest.mark.parametrize("bits,group,sym,act_order,v1", [
    (4, 128, False, False, True), (4, 128, True, False, True), (4, 128, False, True, True),
    (4, 128, True, True, False), (4, -1, False, False, False), (4, 32, False, True, True), (8, 128, True, False, True),
])
def test_gptq_unpacks_to_reference(bits, group, sym, act_order, v1):
    w = _w()
    k = w.shape[1]
    g = k if group == -1 else group
    g_idx = np.arange(k) // g
    if act_order:
        g_idx = np.argsort(np.random.default_rng(1).permutation(k)) // g
    q, scale, zero = rtn(w, bits, g_idx, sym)
    parts = gptq_tensors(q, scale, zero, g_idx, bits, v1)
    scheme = HFQuantScheme.from_config({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                        "desc_act": act_order, "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    qw = gptq_weight(parts, scheme)
    np.testing.assert_allclose(qw.dequantize().numpy(), reference(q, scale, zero, g_idx), rtol=0, atol=1e-6)
    assert (qw.perm is not None) == act_order
    check_kernel(qw, Int4PackLinear)


def test_gptq_irregular_act_order_groups_fall_back_to_float():
    w = _w()
    g_idx = np.random.default_rng(2).integers(0, 2, 256)  # two groups of unequal size
    q, scale, zero = rtn(w, 4, g_idx, False)
    scheme = HFQuantScheme.from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})
    qw = gptq_weight(gptq_tensors(q, scale, zero, g_idx, 4, True), scheme)
    np.testing.assert_allclose(qw.dequantize().numpy(), reference(q, scale, zero, g_idx), rtol=0, atol=1e-6)
    assert make_quant_linear(qw, None) is None


@pytest.mark.parametrize("group", [128, 64])
def test_awq_gemm_unpacks_to_reference(group):
    w = _w(seed=3)
    g_idx = np.arange(256) // group
    q, scale, zero = rtn(w, 4, g_idx, False)
    parts = awq_tensors(q, scale, zero)
    qw = awq_weight(parts, HFQuantScheme.from_config({"quant_method": "awq", "bits": 4, "group_size": group,
                                                     "version": "GEMM", "zero_point": True}))
    np.testing.assert_allclose(qw.dequantize().numpy(), reference(q, scale, zero, g_idx), rtol=0, atol=1e-6)
    check_kernel(qw, Int4PackLinear)


def test_awq_order_is_interleaved():
    """Column 1 lives in nibble 4 of the first word (not nibble 1): the [0,2,4,6,1,3,5,7] order."""
    q = np.zeros((16, 8), np.int64)
    q[1, 0] = 5  # output column 1, input row 0
    parts = awq_tensors(q, np.ones((16, 1), np.float32), np.zeros((16, 1), np.int64))
    assert int(parts["qweight"][0, 0]) == 5 << 16


@pytest.mark.parametrize("bits,strategy,kernel", [(4, "group", Int4PackLinear), (4, "channel", Int4PackLinear),
                                                  (8, "channel", Int8PackLinear), (8, "group", Int4PackLinear)])
def test_compressed_tensors_unpacks_to_reference(bits, strategy, kernel):
    w = _w(seed=4)
    g = 256 if strategy == "channel" else 128
    g_idx = np.arange(256) // g
    q, scale, zero = rtn(w, bits, g_idx, True)
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": bits, "type": "int", "symmetric": True,
                                           "strategy": strategy, "group_size": g if strategy == "group" else None}}}}
    qw = compressed_tensors_weight(ct_tensors(q, scale, zero, bits), HFQuantScheme.from_config(qc))
    np.testing.assert_allclose(qw.dequantize().numpy(), reference(q, scale, zero, g_idx), rtol=0, atol=1e-6)
    check_kernel(qw, kernel)


def test_stacked_shards_equal_each_shard():
    """q/k/v of different bit widths and groups stack into one matmul exactly."""
    a = quantize_float(torch.randn(32, 128), 4, 32, False, "a")
    b = quantize_float(torch.randn(16, 128), 8, 128, True, "b")
    s = concat_rows([a, b])
    assert s.bits == 8 and s.group == 32
    torch.testing.assert_close(s.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("method,kernel,tol", [("int8", Int8PackLinear, 1e-2), ("int4", Int4PackLinear, 0.15)])
def test_on_the_fly_quantization_error(method, kernel, tol):
    """Round-to-nearest int8 (per channel) / int4 (groups of 32) of a float matrix: product error."""
    from tandem.models.quant.attach import ON_THE_FLY

    bits, group, sym = ON_THE_FLY[method]
    w = torch.randn(64, 256)
    qw = quantize_float(w, bits, group, sym, method)
    module = make_quant_linear(qw, None)
    assert isinstance(module, four_bit(qw, kernel))
    x = torch.randn(3, 256)
    assert rel_err(module(x), x @ w.t()) < tol
