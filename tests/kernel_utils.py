"""Helpers for the tests of tandem's C kernels (``models/c_build.py``)."""

from __future__ import annotations

import pytest


def without_a_compiler(monkeypatch, tmp_path, kernel) -> None:
    """Make ``kernel`` (a ``c_build.Kernel``) build again, from an empty cache with no C compiler:
    its ``available()`` must then say False (the callers' torch paths stay)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel, "lib", None)
    monkeypatch.setattr(kernel, "checked", False)


def kernel_variants(module):
    """A pytest fixture giving each build of ``module``'s C kernel this machine can run: this CPU's
    (``module.KERNEL``) and the AVX2 + FMA one (``module.build("avx2")``, also built on a CPU that has
    AVX-512, so both variants are tested there); one that cannot be built or run here is skipped."""
    variants = {"native": module.KERNEL, "avx2": module.build("avx2")}  # (built on first use)

    @pytest.fixture(params=sorted(variants))
    def kernel(request):
        k = variants[request.param]
        if not k.available():
            pytest.skip(f"{module.__name__} ({request.param}) cannot be built or run here")
        return k

    return kernel


def use_avx2_kernels(monkeypatch) -> bool:
    """Make the models run ``cpu_q4`` and the C attention as built for AVX2 + FMA (what an AVX2-only
    machine runs), also on a CPU with AVX-512; False (nothing changed) where they cannot be built."""
    from tandem.models.quant import cpu_q4
    from tandem.worker import cpu_attention

    q4, attn = cpu_q4.build("avx2"), cpu_attention.build("avx2")
    if not (q4.available() and attn.available()):
        return False
    monkeypatch.setattr(cpu_q4, "KERNEL", q4)
    monkeypatch.setattr(cpu_attention, "KERNEL", attn)
    return True
