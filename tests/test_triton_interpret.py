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

_SCRIPT = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from tandem.worker.triton_gemv import gemv

    torch.manual_seed(0)
    n, k = 40, 72  # not multiples of the block sizes below
    for m in (1, 3):
        w = torch.randn(n, k) / k ** 0.5
        x = torch.randn(m, k)
        b = torch.randn(n)
        nw = torch.rand(k) + 0.5
        res = torch.randn(m, n)
        cfg = (16, 32, 4)

        def check(got, want, what):
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-5, (what, m, err)

        check(gemv(x, w, b, config=cfg), x @ w.T + b, "bias")
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
        check(gemv(x, w, norm_weight=nw, eps=1e-5, config=cfg), h @ w.T, "norm")
        w2 = torch.randn(2 * n, k) / k ** 0.5
        check(gemv(x, w2, b.repeat(2), norm_weight=nw, eps=1e-5, gated=True, config=cfg),
              F.silu(h @ w2[:n].T + b) * (h @ w2[n:].T + b), "norm + gated")
        r = res.clone()
        out = gemv(x, w, residual=r, config=cfg)
        assert out.data_ptr() == r.data_ptr()
        check(r, res + x @ w.T, "residual")
    try:
        gemv(torch.randn(17, k), torch.randn(n, k))
    except ValueError as e:
        assert "at most 16 rows" in str(e)
    else:
        raise AssertionError("17 rows accepted")
    print("ok")
''')


@pytest.mark.parametrize("defer", ["0", "1"])  # per-tile and deferred reductions
def test_gemv_kernel_under_interpreter(defer: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", TANDEM_GEMV_DEFER=defer)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
