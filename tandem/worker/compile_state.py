"""Which Triton kernel variants this process has compiled: a difference across a stretch of serving
is a compile mid-serving (issue #19: there must be none). CPU-importable (reads only the caches
Triton's jitted functions expose, when it has them)."""

from __future__ import annotations

import sys


def compiled_variants() -> dict[str, set[str]]:
    """Every Triton kernel of tandem's loaded modules → the keys of its variants compiled so far
    (specialisation: dtypes, pointer alignment, constexprs)."""
    out: dict[str, set[str]] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("tandem."):
            continue
        for attr, obj in vars(mod).items():
            caches = getattr(obj, "device_caches", None)
            if isinstance(caches, dict):
                out[f"{name}.{attr}"] = {str(k) for c in caches.values() for k in c[0]}
    return out
