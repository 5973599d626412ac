"""Helpers for the tests of tandem's C kernels (``models/c_build.py``)."""

from __future__ import annotations


def without_a_compiler(monkeypatch, tmp_path, kernel) -> None:
    """Make ``kernel`` (a ``c_build.Kernel``) build again, from an empty cache with no C compiler:
    its ``available()`` must then say False (the callers' torch paths stay)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel, "lib", None)
    monkeypatch.setattr(kernel, "checked", False)
