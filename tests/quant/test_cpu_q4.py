"""tandem's 4-bit CPU kernel (``models/quant/cpu_q4.py``): the packed layout as documented, products
against float64, a row's bits independent of the row count and the thread count — for both variants
where this CPU runs them (AVX-512 BF16; AVX2 + FMA, also built on an AVX-512 CPU) — and the fallback
to int4pack where it cannot be built."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import kernel_variants, without_a_compiler
from tandem.models.quant import cpu_q4
from tandem.models.quant.weights import QuantizedWeight

needs_kernel = pytest.mark.skipif(not cpu_q4.available(), reason="cpu_q4 needs AVX-512 BF16 or AVX2 and a C compiler")
kernel = kernel_variants(cpu_q4)


def _qw(n: int, k: int, group: int, seed: int = 0, perm: bool = False, bits: int = 4) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    return QuantizedWeight(codes=torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8),
                           scale=torch.rand(n, k // group, generator=g) * 0.02,
                           offset=torch.randn(n, k // group, generator=g) * 0.02, group=group, bits=bits,
                           source="test", perm=torch.randperm(k, generator=g) if perm else None)


def _unpack(packed: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K], scale and offset [N, K / G] read back from the documented layout."""
    tiles, groups, _ = packed.shape
    units, ub = group // 4, 8 * bits
    if bits == 4:  # 32 bytes per 4 k: byte 2b + j holds k = 4u + j (low nibble) and 4u + 2 + j (high)
        b = packed[:, :, :units * ub].reshape(tiles, groups, units, 16, 2).long()  # [t, g, u, row, j]
        codes = torch.stack([b & 15, b >> 4], dim=4)  # [t, g, u, row, plane, j]: k = 4u + 2·plane + j
    else:  # 64 bytes per 4 k: the pair (4u, 4u + 1) as bytes 2b + j, then the pair (4u + 2, 4u + 3)
        codes = packed[:, :, :units * ub].reshape(tiles, groups, units, 2, 16, 2).long().transpose(3, 4)
    codes = codes.permute(0, 3, 1, 2, 4, 5).reshape(tiles * 16, groups * group)
    aff = packed[:, :, units * ub:].contiguous().view(torch.float32).reshape(tiles, groups, 2, 16)
    return codes, aff[:, :, 0].permute(0, 2, 1).reshape(-1, groups), aff[:, :, 1].permute(0, 2, 1).reshape(-1, groups)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_writes_the_documented_layout(bits):
    qw = _qw(48, 96, 32, bits=bits)
    codes, scale, offset = _unpack(cpu_q4.pack(qw), 32, bits)
    assert torch.equal(codes, qw.codes.long())
    assert torch.equal(scale, qw.scale) and torch.equal(offset, qw.offset)


def test_pack_refuses_what_it_cannot_hold():
    for qw in (_qw(40, 64, 32),  # N not a multiple of 16
               _qw(32, 60, 30)):  # a group not a multiple of 4
        assert not cpu_q4.fits(qw)
        with pytest.raises(ValueError, match="does not fit cpu_q4"):
            cpu_q4.pack(qw)


@pytest.mark.parametrize("n,k,group", [(16, 32, 32), (48, 576, 32), (64, 256, 128), (32, 40, 8), (80, 64, 64)])
@pytest.mark.parametrize("bits", [4, 8])
def test_product_equals_float64(n, k, group, bits, kernel):
    qw = _qw(n, k, group, seed=n + k, bits=bits)
    w = qw.dequantize().double()
    packed = cpu_q4.pack(qw)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for m in (1, 2, 3, 5, 8, 9, 20):  # the row functions, a chunk of 8 and tails
        ref = x[:m].double() @ w.T
        got = cpu_q4.mm(x[:m], packed, group, kernel=kernel)
        assert got.dtype is torch.float32 and got.shape == (m, n)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5), m


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_threads(bits, kernel):
    qw = _qw(96, 576, 32, seed=3, bits=bits)
    packed = cpu_q4.pack(qw)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.cat([cpu_q4.mm(x[i:i + 1], packed, 32, kernel=kernel) for i in range(17)])
        torch.set_num_threads(2)
        for m in range(1, 18):
            assert torch.equal(cpu_q4.mm(x[:m], packed, 32, kernel=kernel), one[:m]), m
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_module_op_and_act_order():
    from tandem.models.quant.q4_linear import Q4Linear

    qw = _qw(32, 128, 32, seed=5, perm=True)
    bias = torch.randn(32)
    module = Q4Linear(qw, bias)
    x = torch.randn(2, 3, 128)
    ref = x.to(torch.bfloat16).double() @ qw.dequantize().double().T + bias.double()
    assert torch.allclose(module(x).double(), ref, rtol=1e-5, atol=1e-5)
    h = x[0].to(torch.bfloat16).index_select(1, qw.perm)
    assert torch.equal(torch.ops.tandem.q4_mm(h, module.packed, 32), cpu_q4.mm(h, module.packed, 32))
    with pytest.raises(ValueError, match="does not match"):
        cpu_q4.mm(torch.randn(1, 64), module.packed, 32)


def test_without_a_compiler_int4pack_serves_four_bit_weights(monkeypatch, tmp_path):
    from tandem.models.quant.int4pack import Int4PackLinear
    from tandem.models.quant.kernels import make_quant_linear

    without_a_compiler(monkeypatch, tmp_path, cpu_q4.KERNEL)
    assert not cpu_q4.available()
    assert isinstance(make_quant_linear(_qw(32, 64, 32), None), Int4PackLinear)


@pytest.mark.parametrize("k", [192, 200])  # (200: the AVX2 norm's scalar tail)
def test_fused_norm_and_residual(kernel, k):
    """The RMS norm in the kernel is torch's to bf16 rounding; the residual add is torch's sum bitwise."""
    qw = _qw(64, k, 8, seed=7)
    packed = cpu_q4.pack(qw)
    g = torch.Generator().manual_seed(8)
    x, w, res = torch.randn(5, k, generator=g) * 3, torch.rand(k, generator=g) + 0.5, torch.randn(5, 64, generator=g)
    normed = torch.rms_norm(x, [k], w, 1e-5)
    fused = cpu_q4.mm(x, packed, 8, w, 1e-5, kernel=kernel)
    assert torch.allclose(fused, cpu_q4.mm(normed, packed, 8, kernel=kernel), rtol=2e-2, atol=2e-2)
    ref = (normed.to(torch.bfloat16).double() @ qw.dequantize().double().T).float()
    assert float((fused - ref).norm() / ref.norm()) < 1e-2
    h = x.to(torch.bfloat16)
    assert torch.equal(cpu_q4.mm(h, packed, 8, residual=res, kernel=kernel), res + cpu_q4.mm(h, packed, 8, kernel=kernel))
    with pytest.raises(ValueError, match="residual"):
        cpu_q4.mm(h, packed, 8, residual=res[:, :10], kernel=kernel)


def test_the_avx2_variant_is_what_an_avx2_target_builds(monkeypatch):
    """``$TANDEM_CPU_ISA=avx2`` builds tandem's kernels for x86-64-v3 (an AVX2 laptop's instructions);
    on such a build this kernel is its AVX2 variant; a bad value is one error naming the variable."""
    from tandem.errors import ConfigError
    from tandem.models import c_build

    monkeypatch.setenv("TANDEM_CPU_ISA", "avx2")
    assert c_build.target_flags(c_build.FLAGS) == tuple(
        f for flag in c_build.FLAGS for f in (("-march=x86-64-v3", "-mtune=native") if flag == "-march=native" else (flag,)))
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx9")
    with pytest.raises(ConfigError, match="TANDEM_CPU_ISA.*allowed: native, avx2"):
        c_build.target_flags(c_build.FLAGS)
    monkeypatch.delenv("TANDEM_CPU_ISA")
    assert "-march=native" in c_build.target_flags(c_build.FLAGS)
    avx2 = cpu_q4.build("avx2")
    if avx2.available():
        assert cpu_q4.variant(avx2) == "avx2"
