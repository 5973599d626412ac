"""Give freed heap memory back to the OS after a load.

glibc keeps freed blocks in its heap (and raises its mmap threshold after large frees), so the
temporaries of a load — parsed GGUF metadata, unpacked codes, dequantized tensors — would stay in the
process's RSS. ``malloc_trim(0)`` returns them. A no-op where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_free_memory() -> None:
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)
