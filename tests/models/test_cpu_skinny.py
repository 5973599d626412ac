"""The float32 CPU kernel for 2-8 rows (models/cpu_skinny.py): built where a C compiler and
AVX2/AVX-512 are, the product of every row count and odd shapes equal to a float64 reference, a row's
bits independent of the other rows, used by ``layers.linear`` for float32 steps of 2-8 rows (never
under autograd), and torch's paths kept where it cannot be built."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from kernel_utils import without_a_compiler
from tandem.models import cpu_skinny, layers


def _buildable() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return (platform.machine() in ("x86_64", "AMD64") and shutil.which("cc") is not None
            and (" avx512f" in flags or (" avx2" in flags and " fma" in flags)))


needs_kernel = pytest.mark.skipif(not _buildable(), reason="no C compiler or no AVX2 / AVX-512 here")


@needs_kernel
def test_it_builds_where_a_compiler_and_simd_are():
    assert cpu_skinny.available()


@needs_kernel
@pytest.mark.parametrize("k", [1, 7, 16, 17, 40, 576])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 13])
def test_products_equal_a_float64_reference(k, n):
    g = torch.Generator().manual_seed(k * 100 + n)
    w = torch.randn(n, k, generator=g)
    for m in range(1, cpu_skinny.MAX_ROWS + 1):
        x = torch.randn(m, k, generator=g)
        want = (x.double() @ w.double().T).float()
        torch.testing.assert_close(cpu_skinny.mm(x, w), want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("k", [1, 7, 16, 17, 40, 576])
def test_a_bf16_weight_gives_its_float32_copys_bits(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(13, k, generator=g).bfloat16()
    for m in range(1, cpu_skinny.MAX_ROWS + 1):
        x = torch.randn(m, k, generator=g)
        assert torch.equal(cpu_skinny.mm(x, w), cpu_skinny.mm(x, w.float()))


@needs_kernel
def test_a_rows_bits_do_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(301, 576, generator=g)
    x = torch.randn(cpu_skinny.MAX_ROWS, 576, generator=g)
    alone = torch.cat([cpu_skinny.mm(x[i:i + 1], w) for i in range(len(x))])
    for m in range(2, cpu_skinny.MAX_ROWS + 1):
        assert torch.equal(cpu_skinny.mm(x[:m], w), alone[:m])


@needs_kernel
def test_bad_shapes_are_refused():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError):
        cpu_skinny.mm(torch.randn(9, 16), w)  # too many rows
    with pytest.raises(ValueError):
        cpu_skinny.mm(torch.randn(2, 15), w)  # K mismatch
    with pytest.raises(ValueError):
        cpu_skinny.mm(torch.randn(2, 8), w.t())  # not contiguous
    with pytest.raises(ValueError):
        cpu_skinny.mm(torch.randn(2, 16, dtype=torch.float64), w.double())


@needs_kernel
def test_a_speculating_targets_linears_take_it_for_two_to_eight_rows(monkeypatch):
    from tandem.models.onednn_linear import OneDnnLinear, available

    if not available():
        pytest.skip("no oneDNN")
    seen: list[int] = []
    real = cpu_skinny.mm
    monkeypatch.setattr(cpu_skinny, "mm", lambda x, w, out=None: seen.append(x.shape[0]) or real(x, w, out))
    w, b = torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(64))
    lin = OneDnnLinear(w, b)
    with torch.inference_mode():
        for rows in (1, 2, 4, 8, 9):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(lin(x), x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert seen == [2, 4, 8]


@needs_kernel
def test_every_float32_linear_takes_it_for_two_to_eight_rows(monkeypatch, tmp_path):
    """Not only a speculating target's: a plain engine's batched decode (2-8 rows) too — on BLAS a
    batch-8 float32 SmolLM2 step cost 2.4x its cpu_skinny time (docs/performance.md §49). One row
    keeps the split GEMV, more than 8 rows and autograd keep torch's paths."""
    from tiny_models import write_tiny_hf_checkpoint
    from tandem import LLM, SamplingParams

    seen: list[int] = []
    real = cpu_skinny.mm
    monkeypatch.setattr(cpu_skinny, "mm", lambda x, w, out=None: seen.append(x.shape[0]) or real(x, w, out))
    w, b = torch.randn(64, 32), torch.randn(64)
    with torch.inference_mode():
        for rows in (1, 2, 5, 8, 9, 40):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(layers.linear(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert seen == [2, 5, 8]
    x = torch.randn(4, 32, requires_grad=True)
    layers.linear(x, w).sum().backward()  # autograd: torch's path, with a gradient
    assert seen == [2, 5, 8] and x.grad is not None
    path = write_tiny_hf_checkpoint(tmp_path, "llama")
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 24)  # no speculation
    seen.clear()
    llm.generate([[5, 9, 17], [7, 8], [3, 4, 5, 6]], SamplingParams(max_tokens=4, temperature=0))
    assert 3 in seen  # the three requests' decode steps


def test_without_a_compiler_torchs_paths_stay(monkeypatch, tmp_path):
    without_a_compiler(monkeypatch, tmp_path, cpu_skinny.KERNEL)
    assert not cpu_skinny.available()
    x, w = torch.randn(4, 32), torch.randn(64, 32)
    with torch.inference_mode():
        torch.testing.assert_close(layers.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
