"""The skinny-matmul Triton kernel's logic on CPU, through Triton's interpreter (float32).

The interpreter is chosen when a kernel is defined, so the checks run in a subprocess with
``TRITON_INTERPRET=1``. Bit-level bf16 behaviour and speed are covered on the GPU (tests/test_gpu.py,
benchmarks/gpu_gemv.py); this catches indexing, masking and fusion mistakes on the CI machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")


def _run_interpreted(script: str, *args: str) -> None:
    """Run ``script`` in a subprocess under Triton's interpreter; it must print "ok" last."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")

_SCRIPT = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    import functools, sys
    from tandem.worker.triton_gemv import gemv
    gemv = functools.partial(gemv, defer=sys.argv[1] == "1")

    torch.manual_seed(0)
    n, k = 40, 72  # not multiples of the block sizes below
    # one program per row (BLOCK_N, BLOCK_K, warps); tensor cores (BLOCK_N, BLOCK_K, warps, stages, SPLIT):
    # split-K with a short last split, and none
    cases = ((1, False, (16, 32, 4)), (3, False, (16, 32, 4)), (5, False, (16, 32, 4)),
             (3, True, (16, 32, 4, 1, 2)), (18, True, (32, 16, 4, 1, 1)), (5, True, (16, 16, 4, 1, 4)))
    for m, dot, cfg in cases:
        w = torch.randn(n, k) / k ** 0.5
        x = torch.randn(m, k)
        b = torch.randn(n)
        nw = torch.rand(k) + 0.5
        res = torch.randn(m, n)

        def check(got, want, what):
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-5, (what, m, dot, err)

        check(gemv(x, w, b, config=cfg, dot=dot), x @ w.T + b, "bias")
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
        check(gemv(x, w, norm_weight=nw, eps=1e-5, config=cfg, dot=dot), h @ w.T, "norm")
        w2 = torch.randn(2 * n, k) / k ** 0.5
        check(gemv(x, w2, b.repeat(2), norm_weight=nw, eps=1e-5, gated=True, config=cfg, dot=dot),
              F.silu(h @ w2[:n].T + b) * (h @ w2[n:].T + b), "norm + gated")
        r = res.clone()
        out = gemv(x, w, residual=r, config=cfg, dot=dot)
        assert out.data_ptr() == r.data_ptr()
        check(r, res + x @ w.T, "residual")
        if m > 1:  # each row exactly as a 1-row product (tensor cores: in batch-invariant mode)
            assert torch.equal(gemv(x, w, norm_weight=nw, eps=1e-5, config=cfg, dot=dot, invariant=dot)[m - 1],
                               gemv(x[m - 1:], w, norm_weight=nw, eps=1e-5, config=cfg, dot=dot, invariant=dot)[0])
        check(gemv(x, w2, norm_weight=nw, eps=1e-5, gated=True, dot=dot), F.silu(h @ w2[:n].T) * (h @ w2[n:].T),
              "norm + gated, default config")
    # shapes with a tuned config (triton_gemv.SHAPE_CONFIGS: SmolLM2's qkv, o, gate_up)
    from tandem.worker.triton_gemv import SHAPE_CONFIGS
    for sn, sk, fusion in SHAPE_CONFIGS:
        sx = torch.randn(1, sk)
        sw = torch.randn(sn, sk) / sk ** 0.5
        snw = torch.rand(sk) + 0.5
        sh = sx * torch.rsqrt(sx.pow(2).mean(-1, keepdim=True) + 1e-5) * snw
        if fusion == "norm":
            got, want = gemv(sx, sw, norm_weight=snw, eps=1e-5), sh @ sw.T
        elif fusion == "norm+gated":
            half = sn // 2
            got, want = gemv(sx, sw, norm_weight=snw, eps=1e-5, gated=True), F.silu(sh @ sw[:half].T) * (sh @ sw[half:].T)
        else:
            sr = torch.randn(1, sn)
            got, want = gemv(sx, sw, residual=sr.clone()), sr + sx @ sw.T
        assert ((got - want).norm() / want.norm()).item() < 1e-5, fusion
    try:
        gemv(torch.randn(17, k), torch.randn(n, k))
    except ValueError as e:
        assert "at most 16 rows" in str(e)
    else:
        raise AssertionError("17 rows accepted")
    # tensor cores: any row count, in tiles of 16 (the last one partial); split-K launches of at most
    # splitk.CHUNK_ROWS rows (150 rows: three)
    w = torch.randn(n, k) / k ** 0.5
    for rows, cfg in ((37, None), (150, (16, 16, 4, 1, 2))):
        x = torch.randn(rows, k)
        r = torch.randn(rows, n)
        got = gemv(x, w, residual=r.clone(), dot=True, config=cfg)
        assert ((got - (r + x @ w.T)).norm() / got.norm()).item() < 1e-5
        got = gemv(x, w, norm_weight=nw, eps=1e-5, dot=True, config=cfg)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
        assert ((got - h @ w.T).norm() / got.norm()).item() < 1e-5
    print("ok")
''')


@pytest.mark.parametrize("defer", ["0", "1"])  # per-tile and deferred reductions
def test_gemv_kernel_under_interpreter(defer: str) -> None:
    _run_interpreted(_SCRIPT, defer)


def test_pdl_is_off_on_cpu_and_follows_its_switch() -> None:
    import torch

    from tandem.worker import pdl

    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(False) == {} and pdl.launch_kwargs(True) == {"launch_pdl": True}
    try:
        pdl.set_pdl(False)
        assert pdl._SWITCH[0] is False
        pdl.set_pdl(True)
        assert pdl._SWITCH[0] is True
    finally:
        pdl.set_pdl(True)


_ARGMAX_SCRIPT = textwrap.dedent('''
    import torch
    from tandem.worker.triton_argmax import CHUNK, argmax_rows

    torch.manual_seed(0)
    for rows, v in [(1, 10000), (3, 4096), (5, 12289), (2, 7)]:
        x = torch.randn(rows, v)
        if v > 2 * CHUNK and rows > 1:
            x[0, 5000] = x[0, 9000] = 100.0  # equal maxima in different pieces: the first wins
            x[1, 4100] = x[1, 4101] = 50.0  # equal maxima inside a piece
        if rows == 3:
            x[-1] = float("-inf")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), (rows, v)
        y = x[:, 1:]  # row stride != vocab
        assert torch.equal(argmax_rows(y), y.argmax(dim=-1)), (rows, v)
    print("ok")
''')


def test_argmax_kernel_under_interpreter() -> None:
    """The two-pass greedy argmax: same ids as torch.argmax, lowest id on ties (within and across pieces)."""
    _run_interpreted(_ARGMAX_SCRIPT)


_W4_SCRIPT = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from tandem.models.quant.w4_weight import W4Weight
    from tandem.models.quant.weights import QuantizedWeight
    from tandem.worker.triton_gemv import gemv

    torch.manual_seed(0)

    def w4(n, k, group, dtype=torch.float32):
        qw = QuantizedWeight(codes=torch.randint(0, 16, (n, k), dtype=torch.uint8),
                             scale=torch.rand(n, k // group) * 0.02 + 0.001, offset=torch.randn(n, k // group) * 0.05,
                             group=group, bits=4, source="test")
        packed = W4Weight.pack(qw, dtype, torch.device("cpu"))
        # the float32 weight the kernel computes with: codes, scales and offsets exact, never rounded
        ref = (qw.codes.float().view(n, k // group, group) * packed.scale[:, :k // group, None].float()
               + packed.offset[:, :k // group, None].float()).view(n, k)
        return packed, ref

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # without a 16-bit MMA (float32, CPU) the product runs on the dequantized weight through the float
    # kernel, with every fusion; K = 160: a padded tail chunk; every group size; one row and several
    n = 48
    cases = ((1, (160, 16)), (3, (416, 32)), (17, (576, 64)), (2, (640, 128)), (5, (384, 128)))
    for m, (k, group) in cases:
        w, wf = w4(n, k, group)
        x = torch.randn(m, k)
        b = torch.randn(n)
        nw = torch.rand(k) + 0.5
        assert rel(gemv(x, w, b), x @ wf.T + b) < 1e-5, (m, group)
        got = gemv(x, w, norm_weight=nw, eps=1e-5)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
        assert rel(got, h @ wf.T) < 1e-5, ("norm", m, group)
        w2, wf2 = w4(2 * n, k, group)
        got = gemv(x, w2, norm_weight=nw, eps=1e-5, gated=True)
        assert rel(got, F.silu(h @ wf2[:n].T) * (h @ wf2[n:].T)) < 1e-5, ("gated", m, group)
        res = torch.randn(m, n)
        r = res.clone()
        gemv(x, w, residual=r)
        assert rel(r, res + x @ wf.T) < 1e-5, ("residual", m, group)
        if m > 1:  # each row exactly as that row alone
            assert torch.equal(gemv(x, w)[m - 1], gemv(x[m - 1:], w)[0])
    # fp16 (the interpreter's float kernel in fp16)
    for group, k in ((32, 160), (64, 576)):
        w, wf = w4(n, k, group, torch.float16)
        for m in (1, 5):
            x = torch.randn(m, k).half()
            assert rel(gemv(x, w), x.float() @ wf.T) < 2e-3, ("fp16", group, m)
    # the module: the int4 kernel up to 256 rows, dequantize + matmul above; bias; any leading shape
    from tandem.models.quant.cuda_w4 import W4Linear
    qw = QuantizedWeight(codes=torch.randint(0, 16, (n, 96), dtype=torch.uint8), scale=torch.rand(n, 3) * 0.02,
                         offset=torch.randn(n, 3) * 0.05, group=32, bits=4, source="test")
    b = torch.randn(n)
    lin = W4Linear(qw, b, torch.float32, torch.device("cpu"))
    for shape in ((1, 96), (2, 3, 96), (20, 96), (300, 96)):
        x = torch.randn(*shape)
        want = x @ qw.dequantize().T + b
        got = lin(x)
        assert got.shape == want.shape and rel(got, want) < 1e-5, shape
    print("ok")
''')


def test_w4_gemv_under_interpreter() -> None:
    """The int4 skinny matmul's CPU / float32 path (worker/triton_w4.py): the product with the float32
    weight the codes, scales and offsets describe, with every fusion, tail chunks, every group size."""
    _run_interpreted(_W4_SCRIPT)


_INVARIANT_SCRIPT = textwrap.dedent('''
    import torch
    from tandem.models.quant.w4_weight import W4Weight
    from tandem.models.quant.weights import quantize_float
    from tandem.worker.triton_attention import paged_attention_triton
    from tandem.worker.triton_gemv import gemv

    torch.manual_seed(0)
    # matmuls: with invariant=True each row of an M-row product is its 1-row product, bit for bit
    n, k = 40, 96
    w = torch.randn(n, k) / k ** 0.5
    w2 = torch.randn(2 * n, k) / k ** 0.5
    w4 = W4Weight.pack(quantize_float(torch.randn(48, k), 4, 32, False, "t"), torch.float32, torch.device("cpu"))
    nw = torch.rand(k) + 0.5
    for m in (3, 16, 37):
        x = torch.randn(m, k)
        res = torch.randn(m, n)
        variants = {
            "plain": lambda x, r: gemv(x, w, dot=True, invariant=True),
            "fp32 out": lambda x, r: gemv(x, w, dot=True, invariant=True, out_dtype=torch.float32),
            "norm": lambda x, r: gemv(x, w, norm_weight=nw, eps=1e-5, dot=True, invariant=True),
            "gated": lambda x, r: gemv(x, w2, norm_weight=nw, eps=1e-5, gated=True, dot=True, invariant=True),
            "residual": lambda x, r: gemv(x, w, residual=r, dot=True, invariant=True),
            "w4": lambda x, r: gemv(x, w4, dot=True, invariant=True),
        }
        for name, f in variants.items():
            whole = f(x, res.clone())
            for i in (0, m // 2, m - 1):
                assert torch.equal(whole[i], f(x[i:i + 1], res[i:i + 1].clone())[0]), (name, m, i)
        ref = x @ w.T
        assert ((variants["plain"](x, None) - ref).norm() / ref.norm()).item() < 1e-5

    # attention with fixed tiles and one split: a prefill chunk's rows, a verify's rows and decodes
    # of the same positions give the same bits
    heads, kvh, d, page, L = 6, 2, 32, 4, 23
    nblocks = 8
    kc = torch.randn(nblocks * page, kvh, d)
    vc = torch.randn(nblocks * page, kvh, d)
    bt = torch.tensor([[3, 0, 6, 1, 7, 2]], dtype=torch.int32)
    q = torch.randn(L, heads, d)

    def attend(rows, start):  # query rows start..start+len(rows)-1 of the sequence, context to the last
        n_q = len(rows)
        return paged_attention_triton(
            q[rows].contiguous(), kc, vc, bt, torch.tensor([start + n_q]), torch.tensor([0, n_q]),
            torch.tensor([n_q]), page, d ** -0.5, n_q, 1, fixed_tiles=True)

    prefill = attend(list(range(L)), 0)
    verify = attend(list(range(L - 5, L)), L - 5)
    for p in range(L):
        dec = attend([p], p)
        assert torch.equal(dec[0], prefill[p]), p
        if p >= L - 5:
            assert torch.equal(verify[p - (L - 5)], prefill[p]), p
    print("ok")
''')


def test_batch_invariant_kernels_under_interpreter() -> None:
    """Batch-invariant mode's kernels: matmul rows (every fusion, int4, float32 logits) and attention
    rows (prefill, verify, decode of one position) do not depend on the step's other rows."""
    _run_interpreted(_INVARIANT_SCRIPT)


_CHAIN_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    import torch
    sys.path.insert(0, sys.argv[1])
    from test_chain import _case
    import random
    from tandem.worker.batch import FedTokens
    from tandem.worker.chain import HEAD, chain_fixup, chain_select, chain_width, pack_chain
    from tandem.worker.input_packer import feed_rows, pack, pack_fed
    import tandem.worker.triton_feed as tf
    from tandem.worker.triton_chain import chain_fixup_cuda, chain_select_cuda
    from tandem.worker.triton_feed import feed_rows_cuda

    moved = fed_rows = 0
    for seed in range(24):
        tf.FEED_BLOCK = 64 if seed < 12 else 4  # (a feeding program's loop: one block, then several)
        bs, n, _, assumed, qlens, chain, _ = _case(seed % 12)
        w, q = max(len(c.block_ids) for c in assumed), max(qlens)
        # rows fed from the device (a verify's EAGLE drafts): some of each chunk's rows after its first,
        # more than one feeding block's worth where the step has them
        rng = random.Random(seed)
        rows = [i * q + j for i, ql in enumerate(qlens) for j in range(1, ql) if rng.random() < 0.7]
        values = torch.randint(0, 1000, (len(rows) + 5,))
        fed = FedTokens(values, tuple(rng.sample(range(len(values)), len(rows))), tuple(rows)) if rows else None
        fed_rows = max(fed_rows, len(rows))
        buf = np.zeros(8192, dtype=np.int64)
        length, t, _, _ = pack(bs, buf, assumed, qlens, n, q, w, None)
        end = pack_fed(buf, length, fed, rows)
        _, off = pack_chain(buf, end, chain, qlens, q)
        for f in (None, fed):
            ref, got = torch.from_numpy(buf.copy()), torch.from_numpy(buf.copy())
            chain_fixup(ref, t, n, w, bs, off, n, chain_width(chain), chain.row_tokens, q, f, length)
            chain_fixup_cuda(got, t, n, w, bs, off, n, chain_width(chain), HEAD, chain.row_tokens, q, f, length)
            assert torch.equal(got, ref), seed
        ref, got = torch.from_numpy(buf.copy()), torch.from_numpy(buf.copy())
        feed_rows(ref, t, length, fed)
        if fed is not None:
            feed_rows_cuda(got, values, length, len(rows))
        assert torch.equal(got, ref), seed
        # an EAGLE head's chained catch-up: selected rows moved back by the rejected count, fed rows fed
        end = off + n * chain_width(chain)
        buf[end:end + n] = np.arange(n) * 7 + 9
        for f in (None, fed):
            ref, got = torch.from_numpy(buf.copy()), torch.from_numpy(buf.copy())
            chain_select(ref, end, off, n, chain_width(chain), chain.row_tokens, t, f, length)
            chain_select_cuda(got, end, off, n, chain_width(chain), HEAD, chain.row_tokens, f, length)
            assert torch.equal(got, ref), seed
        moved += int((ref != torch.from_numpy(buf)).sum())
    assert moved > 0 and fed_rows > 8  # (some request rejected drafts; a step fed more than two blocks of 4)
    print("ok")
''')


def test_chain_fixup_kernel_under_interpreter() -> None:
    """A chained step's one-launch fix-up (worker/triton_chain.py) writes what the torch reference
    writes: first ids, positions, KV slots, context lengths (worker/chain.py); so does an EAGLE
    head's chained catch-up's row selection (``chain_select``)."""
    import pathlib

    _run_interpreted(_CHAIN_SCRIPT, str(pathlib.Path(__file__).parent))


_PROPOSAL_SCRIPT = textwrap.dedent('''
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from test_proposal_graph import proposal_case
    from tandem.worker.input_packer import advance_one
    from tandem.worker.triton_proposal import advance_one_cuda, chain_entry_cuda

    for seed in range(16):
        runner, c = proposal_case(seed)
        b, q, w, bs, tok, fb = c["b"], c["q"], c["w"], c["bs"], c["tok"], c["fb"]
        dst, hidden = runner._chain_in.clone(), runner._hidden_in.clone()
        want = runner._derive_chain(b, q, tok, fb)  # (the torch ops off CUDA)
        got = chain_entry_cuda(runner._static, dst, tok, fb, hidden, b, q, w, bs)
        assert torch.equal(got, want), seed
        assert torch.equal(dst, runner._chain_in), seed
        assert torch.equal(hidden, runner._hidden_in), seed
        # each later chain step: fed the step before's drafts and feedback, one position further
        for _ in range(3):
            nxt, nfb = torch.randint(0, 1000, (b,)), torch.randn(b, fb.shape[1])
            ref_buf, ref_h = dst.clone(), hidden.clone()
            ref_h[:b].copy_(nfb)
            ref_buf[:b].copy_(nxt)
            advance_one(ref_buf, b, w, bs)
            advance_one_cuda(dst, nxt, nfb, hidden[:b], b, w, bs)
            assert torch.equal(dst, ref_buf) and torch.equal(hidden, ref_h), seed
    print("ok")
''')


def test_proposal_kernels_under_interpreter() -> None:
    """An EAGLE proposal graph's entry step and chain-step advance in one launch each
    (worker/triton_proposal.py) write what ``GpuHeadRunner._derive_chain`` and ``advance_one`` (with
    the fed ids and hidden rows) write, byte for byte, over random padded and ragged first steps."""
    import pathlib

    _run_interpreted(_PROPOSAL_SCRIPT, str(pathlib.Path(__file__).parent))
