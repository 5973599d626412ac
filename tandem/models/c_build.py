"""Build and load a CPU kernel written in C: compiled on first use, cached, loaded with ctypes.

The kernels (``models/cpu_skinny.py``, ``models/quant/cpu_q4.py``) carry their C source as a string.
:func:`load` compiles it with the system's C compiler (``$CC`` or ``cc``: gcc or clang with OpenMP)
into ``<cache>/.kernels/<name>-<hash>.so``, the hash covering the source, the flags, the compiler and
its version, the host and the CPU's feature flags (a build for another CPU type is never loaded), and
returns the ``ctypes.CDLL``. ctypes releases the GIL during a call. OpenMP links against the
``libgomp`` torch has loaded, so the kernels share torch's thread pool. Any failure (no x86-64, no
compiler, a failed compile) raises; callers turn that into ``available() == False`` and keep their
torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# ``-march=native`` becomes this where the kernels are built for AVX2 (``$TANDEM_CPU_ISA=avx2``, or a
# caller's ``isa="avx2"``): x86-64-v3 is AVX2, FMA, F16C, BMI2 — an AVX2-only laptop's instructions
MARCH = {"native": ("-march=native",), "avx2": ("-march=x86-64-v3", "-mtune=native")}

# C the kernels' AVX2 branches share (spliced into their sources): the sum of an 8-float vector's lanes,
# in a fixed order
HSUM256 = r"""static inline float hsum256(__m256 v) {
""" + """    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
"""


def target_flags(flags: tuple[str, ...], isa: str | None = None) -> tuple[str, ...]:
    """``flags`` with ``-march=native`` replaced by ``isa``'s target (None: ``$TANDEM_CPU_ISA``)."""
    if isa is None:
        from tandem.config.env import cpu_isa

        isa = cpu_isa()
    return tuple(f for flag in flags for f in (MARCH[isa] if flag == "-march=native" else (flag,)))


def load(name: str, source: str, flags: tuple[str, ...] = FLAGS, isa: str | None = None) -> ctypes.CDLL:
    """The compiled ``source`` (built into the cache on first use) for ``isa`` (``target_flags``), loaded."""
    flags = target_flags(flags, isa)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"no x86-64 SIMD on {platform.machine()}")
    if "-march=x86-64-v3" in flags and not {"avx2", "fma"} <= set(_cpu_flags().split()):
        raise RuntimeError("built for AVX2 + FMA, which this CPU lacks")
    from tandem.config.env import c_compiler

    cc = shutil.which(c_compiler())
    if cc is None:
        raise RuntimeError("no C compiler ($CC or cc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = "|".join((source, " ".join(flags), cc, version, platform.node(), _cpu_flags()))
    path = _kernel_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if not path.is_file():
        _compile(cc, name, source, flags, path)
    return ctypes.CDLL(str(path))


class Kernel:
    """One C kernel, built and checked on the first ``available()`` call. Its source defines
    ``int <isa>(void)`` (0 where the machine lacks the instructions it needs: ``needs`` says which)
    and the functions of ``functions`` (name → argument ctypes, each returning an int status);
    ``check()`` is the module's self-check through ``self.lib``. Any failure leaves ``lib`` None for
    good (logged once, with ``fallback`` saying what is used instead)."""

    def __init__(self, name: str, source: str, isa: str, needs: str, functions: dict[str, list[type]],
                 check: Callable[[], None], fallback: str, flags: tuple[str, ...] = FLAGS,
                 target: str | None = None) -> None:
        self.name, self.source, self.isa, self.needs, self.flags = name, source, isa, needs, flags
        self.target = target  # the instruction set built for (None: ``$TANDEM_CPU_ISA``, else native)
        self.functions, self.check, self.fallback = functions, check, fallback
        self.lib: ctypes.CDLL | None = None
        self.checked = False

    def available(self) -> bool:
        if not self.checked:
            self.checked = True
            try:
                lib = load(self.name, self.source, self.flags, self.target)
                getattr(lib, self.isa).restype = ctypes.c_int
                for fn, args in self.functions.items():
                    getattr(lib, fn).restype = ctypes.c_int
                    getattr(lib, fn).argtypes = args
                if getattr(lib, self.isa)() == 0:
                    raise RuntimeError(f"this CPU lacks {self.needs}")
                self.lib = lib
                self.check()
            except Exception as e:  # noqa: BLE001 - no compiler, no ISA, a failed check: the fallback stays
                logger.info("CPU kernel %s unavailable (%s); %s", self.name, e, self.fallback)
                self.lib = None
        return self.lib is not None


def _compile(cc: str, name: str, source: str, flags: tuple[str, ...], path: Path) -> None:
    """Compile into a temporary file and rename it into place (another process may race us)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        done = subprocess.run([cc, *flags, str(src), "-o", str(lib)], capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-300:]}")
        os.replace(lib, path)


def _kernel_dir() -> Path:
    from tandem.loader.registry import cache_dir

    return cache_dir() / ".kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (a cached build from another CPU type must not be loaded)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
