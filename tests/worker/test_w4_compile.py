"""The int4 MMA kernel (worker/triton_w4.py) compiles for sm_90 on any machine: Triton lowers it to
PTX and its bundled ``ptxas`` assembles the inline ``mma.sync`` / ``lop3`` blocks into a cubin, so a
syntax or register-constraint mistake in the asm fails here on the CPU-only CI rather than on the
next GPU run. Its results are checked on the GPU (tests/quant/test_gpu_w4.py)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

try:  # the NVIDIA backend ships with the Linux wheels; compiling needs no GPU or driver
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without it
    pytest.skip("Triton's NVIDIA backend is not installed", allow_module_level=True)

_POINTERS = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "b_ptr", "nw_ptr", "res_ptr", "out_ptr", "ws_ptr", "cnt_ptr")


def _compile(dt: str, k: int, group: int, norm: bool, gated: bool, res: bool, warps: int, split: int,
             tiles: int = 1, depth: int = 1):  # type: ignore[no-untyped-def]
    import torch

    from tandem.worker.triton_w4 import _mma_asm, _w4_kernel

    sig = {p: ("*fp32" if p == "ws_ptr" else "*i32" if p in ("w_ptr", "cnt_ptr") else f"*{dt}") for p in _POINTERS}
    sig.update(eps="fp32", M="i32", N="i32", stride_xm="i32", stride_sn="i32", stride_rm="i32", stride_om="i32",
               up_off="i32")
    step = max(64, group)
    mma_asm, ones_asm, fill_asm, mul_asm = _mma_asm(torch.bfloat16 if dt == "bf16" else torch.float16)
    const = dict(K=k, CHUNKS=-(-k // step) * step // 64, GROUP=group, W=warps, SPLIT=split, TILES=tiles, DEPTH=depth,
                 MMA_ASM=mma_asm, ONES_ASM=ones_asm, FILL_ASM=fill_asm, MUL_ASM=mul_asm, HAS_BIAS=False, NORM=norm,
                 GATED=gated, HAS_RES=res, PDL=False)
    sig.update({name: "constexpr" for name in const})
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in _POINTERS}  # as the JIT specializes
    src = ASTSource(fn=_w4_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))


@pytest.mark.parametrize("dt,k,group,norm,gated,res,warps,split,tiles", [
    ("bf16", 4096, 128, True, False, False, 4, 8, 1),  # an 8B qkv: fused norm, split-K
    ("bf16", 4096, 128, True, True, False, 4, 4, 1),  # gate_up: norm + silu·mul over [gate | up]
    ("bf16", 14336, 128, False, False, True, 8, 16, 1),  # down: residual add
    ("fp16", 576, 64, False, False, True, 2, 1, 1),  # SmolLM2-sized, one chunk per group, fp16 operands
    ("bf16", 160, 16, True, True, False, 4, 2, 1),  # groups of 16: a scale per 16-wide K step
    ("bf16", 4096, 128, False, False, True, 4, 8, 2),  # two tiles per warp
])
@pytest.mark.parametrize("depth", [1, 2])  # K steps of codes in flight ahead
def test_int4_kernel_assembles_for_sm90(dt, k, group, norm, gated, res, warps, split, tiles, depth):
    try:
        kernel = _compile(dt, k, group, norm, gated, res, warps, split, tiles, depth)
    except (FileNotFoundError, PermissionError) as e:  # pragma: no cover - a wheel without its ptxas
        pytest.skip(f"no usable ptxas: {e}")
    ptx = kernel.asm["ptx"]
    op = "mma.sync.aligned.m16n8k16.row.col.f32." + ("bf16.bf16" if dt == "bf16" else "f16.f16")
    assert op in ptx
    assert "lop3.b32" in ptx and "%tid.x" in ptx
    assert kernel.asm["cubin"]  # ptxas accepted the asm blocks
