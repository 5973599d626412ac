"""The one place in ``tandem/`` that reads environment variables.

Behaviour is configuration (``tandem/config/``); the variables below exist for debugging and A/B
benchmarks only, and each maps onto a configuration field. Read when called (never at import).

| variable | meaning |
|---|---|
| ``TANDEM_GPU_RUNNER=0`` | ``RunnerConfig.backend = "torch"`` (plain torch path on CUDA) |
| ``TANDEM_CUDA_GRAPHS=0`` | ``RunnerConfig.cuda_graphs = False`` |
| ``TANDEM_FUSED=0`` | ``RunnerConfig.fused = False`` |
| ``TANDEM_GEMV=0`` | ``RunnerConfig.skinny_rows = 0`` (cuBLAS matmuls only) |
| ``TANDEM_GEMV_ROWS=N`` | ``RunnerConfig.skinny_rows = N`` |
| ``TANDEM_GEMV_MULTIROW=dot`` | ``RunnerConfig.skinny_multirow = "dot"`` |
| ``TANDEM_GEMV_DEFER=0/1`` | ``RunnerConfig.skinny_defer`` |
| ``TANDEM_MAX_GRAPH_BATCH=N`` | ``RunnerConfig.max_graph_batch = N`` |
| ``TANDEM_KV_SPLITS=N`` | ``RunnerConfig.kv_splits = N`` |
| ``TANDEM_PDL=0`` | ``RunnerConfig.pdl = False`` |
| ``TANDEM_CPU_SCRIPT=0`` | ``RunnerConfig.cpu_script = False`` (CPU: eager batch-1 steps) |
| ``TANDEM_SCREENED_HEAD=0`` | ``RunnerConfig.screened_head = False`` (CPU: the float LM head for every row) |
| ``TANDEM_CPU_ISA=avx2`` | tandem's C kernels built for x86-64-v3 (AVX2 + FMA) instead of this CPU: an AVX2-only machine's kernels, measured on a newer CPU (``models/c_build.py``) |
| ``TANDEM_CACHE_DIR`` | where built-in models and datasets are cached (default ``~/.cache/tandem/models``) |
| ``TANDEM_API_KEY`` | ``tandem serve --api-key`` default |
| ``OPENAI_API_KEY`` | ``tandem bench serve`` sends it as the bearer token |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tandem.errors import ConfigError

_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")


def _flag(env: Mapping[str, str], name: str) -> bool | None:
    v = env.get(name, "").strip().lower()
    if v == "":
        return None
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(name, f"got {v!r}", allowed=_TRUE + _FALSE)


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name, "").strip()
    if v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(name, f"expected an integer, got {v!r}") from None


def runner_overrides(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """RunnerConfig fields set by ``TANDEM_*`` debug variables (see the table above)."""
    e = os.environ if env is None else env
    out: dict[str, Any] = {}
    if _flag(e, "TANDEM_GPU_RUNNER") is False:
        out["backend"] = "torch"
    for var, key in (("TANDEM_CUDA_GRAPHS", "cuda_graphs"), ("TANDEM_FUSED", "fused"), ("TANDEM_PDL", "pdl"),
                     ("TANDEM_GEMV_DEFER", "skinny_defer"), ("TANDEM_CPU_SCRIPT", "cpu_script"),
                     ("TANDEM_SCREENED_HEAD", "screened_head")):
        v = _flag(e, var)
        if v is not None:
            out[key] = v
    rows = _int(e, "TANDEM_GEMV_ROWS")
    if rows is not None:
        out["skinny_rows"] = rows
    if _flag(e, "TANDEM_GEMV") is False:
        out["skinny_rows"] = 0
    multirow = e.get("TANDEM_GEMV_MULTIROW", "").strip()
    if multirow:
        out["skinny_multirow"] = multirow
    for var, key in (("TANDEM_MAX_GRAPH_BATCH", "max_graph_batch"), ("TANDEM_KV_SPLITS", "kv_splits")):
        v = _int(e, var)
        if v is not None:
            out[key] = v
    return out


def cache_dir_override() -> str | None:
    """``$TANDEM_CACHE_DIR`` or None."""
    return os.environ.get("TANDEM_CACHE_DIR") or None


def api_key() -> str | None:
    """``$TANDEM_API_KEY`` (the server's default ``--api-key``) or None."""
    return os.environ.get("TANDEM_API_KEY") or None


def openai_api_key() -> str | None:
    """``$OPENAI_API_KEY`` (sent by ``tandem bench serve``) or None."""
    return os.environ.get("OPENAI_API_KEY") or None


CPU_ISAS = ("native", "avx2")


def cpu_isa() -> str:
    """``$TANDEM_CPU_ISA``: what tandem's C kernels are built for — ``native`` (default: this CPU) or
    ``avx2`` (x86-64-v3: AVX2 + FMA, what an AVX2-only laptop runs)."""
    v = os.environ.get("TANDEM_CPU_ISA", "").strip().lower() or "native"
    if v not in CPU_ISAS:
        raise ConfigError("TANDEM_CPU_ISA", f"got {v!r}", allowed=CPU_ISAS)
    return v


def c_compiler() -> str:
    """``$CC`` (the C compiler models/cpu_skinny.py builds its kernel with), else ``cc``."""
    return os.environ.get("CC") or "cc"
