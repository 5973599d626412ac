"""tandem's CPU attention for one request's short query (``worker/cpu_attention.py``): every row over
exactly its causal context, against float64; a row's bits do not depend on the other rows, on the
thread count or on whether the context is a slot range or a gather; bad shapes are refused — for
both variants where this CPU runs them (AVX-512; AVX2 + FMA, also built on an AVX-512 CPU)."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import kernel_variants, without_a_compiler
from tandem.worker import cpu_attention

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="needs AVX-512 or AVX2 and a C compiler")
kernel = kernel_variants(cpu_attention)


def _case(h: int, kvh: int, d: int, slots_n: int = 400, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(slots_n, kvh, d, generator=g)
    vc = torch.randn(slots_n, kvh, d, generator=g)
    return kc, vc, torch.randn(8, h, d, generator=g) * 2, torch.randperm(slots_n, generator=g)


@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (2, 2, 16)])
@pytest.mark.parametrize("gather", [False, True])
def test_rows_equal_float64_causal_attention(h, kvh, d, gather, kernel):
    kc, vc, q, perm = _case(h, kvh, d)
    slots = perm if gather else None
    for t, n in ((1, 1), (1, 17), (5, 200), (8, 333)):
        got = cpu_attention.attend(q[:t], kc, vc, 11, slots, n, d ** -0.5, kernel)
        ref = cpu_attention.reference(q[:t], kc, vc, 11, slots, n, d ** -0.5)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6), (t, n)


def test_a_rows_bits_are_the_decodes_at_its_position(kernel):
    kc, vc, q, perm = _case(9, 3, 64, seed=1)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        decodes = torch.cat([cpu_attention.attend(q[r:r + 1], kc, vc, 0, perm, 150 + r, 0.125, kernel)
                             for r in range(8)])
        torch.set_num_threads(2)
        for t in (2, 5, 8):  # a verify of t rows ending at position 149 + t
            got = cpu_attention.attend(q[:t], kc, vc, 0, perm, 150 + t - 1, 0.125, kernel)
            assert torch.equal(got, decodes[:t]), t
        # a consecutive context as a range or as the same slots gathered: the same bits
        assert torch.equal(cpu_attention.attend(q[:3], kc, vc, 40, None, 90, 0.125, kernel),
                           cpu_attention.attend(q[:3], kc, vc, 0, torch.arange(40, 400), 90, 0.125, kernel))
    finally:
        torch.set_num_threads(old)


def test_rows_of_several_requests_are_each_requests_lone_rows(kernel):
    """``attend_rows``: a verify, a decode and a second verify of three requests (different contexts,
    gathered slots) in one call — each row bitwise what ``attend`` gives its request alone; rows not
    listed are left as they were; a row seeing more positions than ``cmax`` is refused."""
    kc, vc, q, perm = _case(9, 3, 64)
    ctxs = [perm[:150], perm[150:190], perm[190:390]]
    plan = cpu_attention.RowPlan([(0, ctxs[0], 3), (3, ctxs[1], 1), (5, ctxs[2], 2)])
    out = torch.full_like(q, 5.0)
    cpu_attention.attend_rows(q, kc, vc, plan, 0.125, out, kernel)
    assert torch.equal(out[0:3], cpu_attention.attend(q[0:3], kc, vc, 0, ctxs[0], 150, 0.125, kernel))
    assert torch.equal(out[3:4], cpu_attention.attend(q[3:4], kc, vc, 0, ctxs[1], 40, 0.125, kernel))
    assert torch.equal(out[5:7], cpu_attention.attend(q[5:7], kc, vc, 0, ctxs[2], 200, 0.125, kernel))
    assert bool((out[4] == 5).all()) and bool((out[7] == 5).all())
    plan.cmax = 100  # row 5..6 see 199 / 200 positions
    with pytest.raises(RuntimeError):
        cpu_attention.attend_rows(q, kc, vc, plan, 0.125, out, kernel)
    with pytest.raises(ValueError):
        cpu_attention.attend_rows(q, kc, vc, plan, 0.125, out[:, :, :32])


@needs_kernel
def test_bad_shapes_are_refused():
    kc, vc, q, _ = _case(4, 2, 24)  # head_dim not a multiple of 16
    with pytest.raises(ValueError):
        cpu_attention.attend(q[:1], kc, vc, 0, None, 5, 0.2)
    kc, vc, q, _ = _case(4, 2, 32)
    with pytest.raises(ValueError):
        cpu_attention.attend(q[:4], kc, vc, 0, None, 3, 0.2)  # fewer context positions than rows
    with pytest.raises(ValueError):
        cpu_attention.attend(q[:1].double(), kc, vc, 0, None, 3, 0.2)


def test_without_a_compiler_torchs_attention_stays(monkeypatch, tmp_path):
    without_a_compiler(monkeypatch, tmp_path, cpu_attention.KERNEL)
    assert not cpu_attention.available()


@pytest.mark.parametrize("gather", [False, True])
def test_rope_attend_is_torchs_rope_and_kv_write_then_attend(gather, kernel):
    """The scripted step's block: rope bitwise as torch computes it, k / v written where ``write_kv``
    writes them, then ``attend`` on the rotated q."""
    h, kvh, d, t, n = 9, 3, 64, 3, 40
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    ang = torch.rand(t, d, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    sin_signed = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), dim=-1)
    kc, vc = torch.randn(64, kvh, d, generator=g), torch.randn(64, kvh, d, generator=g)
    write = torch.tensor([50, 7, 33]) if gather else None
    slots = torch.randperm(64, generator=g)[:n] if gather else None
    if gather:
        slots[n - t:] = write
    ref_k, ref_v = kc.clone(), vc.clone()
    qk = qkv[:, :(h + kvh) * d].reshape(t, h + kvh, d)
    qk = qk * cos[:, None] + torch.roll(qk, d // 2, dims=-1) * sin_signed[:, None]
    rows = write if gather else torch.arange(20 + n - t, 20 + n)
    ref_k[rows] = qk[:, h:]
    ref_v[rows] = qkv[:, (h + kvh) * d:].reshape(t, kvh, d)
    ref = cpu_attention.attend(qk[:, :h], ref_k, ref_v, 20, slots, n, 0.125, kernel)
    got = cpu_attention.rope_attend(qkv, cos, sin_signed, kc, vc, h, 20 + n - t, write, 20, slots, n, 0.125, kernel)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    assert torch.equal(got, ref)
