"""Programmatic dependent launch (PDL, Hopper and later) for the fast path's Triton kernels.

Inside a CUDA graph a batch-1 decode step is ~230 back-to-back kernels of 2–60 µs. Each one pays a
ramp (launch, CTAs dispatched, first loads in flight) and a tail (the last CTAs finishing while most
SMs idle) of ~1–2 µs. With PDL a kernel is launched while its predecessor is still running: its
programs start, may do work that does not depend on the predecessor (attention reads its block
table, rope its cos/sin rows), and then block in ``griddepcontrol.wait`` until the
predecessor has finished and its writes are visible.

Contract for a kernel launched with ``launch_kwargs(...)``: it calls ``pdl_prologue`` (under its
``PDL`` constexpr) before it reads anything an earlier kernel wrote and before it writes anything;
only reads of data no kernel in the step writes (step metadata uploaded before the step's first
kernel, constant tables) may come first. Every kernel in the chain waits, so "predecessor finished"
is transitive; a kernel launched without PDL (cuBLAS, torch) waits for everything before it as usual.

``RunnerConfig.pdl = False`` (or ``TANDEM_PDL=0``) turns it off (A/B runs); it is on by default on CUDA devices of compute capability
9.0+ when the installed Triton supports it. Measured on an H200 (docs/gpu_notes.md): 8B-shape decode
replay 4.43 -> 4.27 ms, 1B 0.91 -> 0.82 ms. Prefetching the matmuls' first weight tiles into L2
before the wait, triggering the next launch halfway or at the end of the K loop, and an evict-first
hint on the streamed weights were all tried and lost.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4 with its NVIDIA backend
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _TRITON_HAS_PDL = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
except Exception:  # noqa: BLE001 - older Triton, or no NVIDIA backend: never launched with PDL
    _TRITON_HAS_PDL = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


@triton.jit
def pdl_prologue():
    """Let the next kernel launch now, then wait until the previous kernel has finished."""
    gdc_launch_dependents()
    gdc_wait()


_CAPABLE: dict[int, bool] = {}


_SWITCH = [True]  # RunnerConfig.pdl of the last CUDA runner built (process-wide: kernels have no config)


def set_pdl(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for every kernel launched from now on."""
    _SWITCH[0] = bool(enabled)


def pdl_enabled(device: torch.device) -> bool:
    """Launch the fast path's kernels with programmatic dependent launch on this device?"""
    if device.type != "cuda" or not _TRITON_HAS_PDL or not _SWITCH[0]:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _CAPABLE[idx]


def launch_kwargs(pdl: bool) -> dict[str, bool]:
    """Extra launch arguments for a kernel whose ``PDL`` constexpr is ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


__all__ = ["pdl_prologue", "pdl_enabled", "launch_kwargs", "set_pdl"]
