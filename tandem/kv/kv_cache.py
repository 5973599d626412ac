"""KV cache tensors and their sizing.

Per layer, K and V are ``[num_blocks * block_size, num_kv_heads, head_dim]`` (flat slots). The number
of blocks comes from a byte budget: ``kv_cache_memory_bytes`` if given; on CUDA
``gpu_memory_utilization`` × total memory minus what is already allocated (weights); on CPU what the
configuration can use — ``max_num_seqs`` requests of ``max_model_len`` tokens (``cpu_demand``) — capped
at ``min(4 GiB, 20 % of available RAM)`` (documented in README).

On CPU the tensors are backed by anonymous memory maps: the kernel hands out zero pages on first
write, so resident memory follows the blocks actually used (a one-prompt ``tandem generate`` touches
a few MiB of a budget that may be GiBs) instead of the whole budget being written at start-up.
A draft model allocates its own tensors with the same number of blocks so both caches share block
tables; the budget is then split by bytes per block of both.
"""

from __future__ import annotations

import mmap
import os

import torch

from tandem.loader.arch import ModelArch

CPU_DEFAULT_MAX_BYTES = 4 << 30
CPU_DEFAULT_FRACTION = 0.20

KVCache = tuple[torch.Tensor, torch.Tensor]


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_budget_bytes(device: torch.device, gpu_memory_utilization: float,
                    kv_cache_memory_bytes: int | None, cpu_demand: int | None = None) -> tuple[int, str]:
    """Return (bytes for KV, a phrase saying what sized it) for logs and errors.

    ``cpu_demand``: the bytes the configuration can ever use (max_num_seqs full-length requests); the
    CPU default takes no more than that."""
    if kv_cache_memory_bytes is not None:
        return int(kv_cache_memory_bytes), "kv_cache_memory_bytes"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * gpu_memory_utilization) - used), "gpu_memory_utilization"
    avail = available_cpu_memory()
    cap = int(min(CPU_DEFAULT_MAX_BYTES, CPU_DEFAULT_FRACTION * avail))
    if cpu_demand is not None and cpu_demand < cap:
        return int(cpu_demand), "CPU default (max_num_seqs × max_model_len)"
    return cap, "CPU default (min(4 GiB, 20% of available RAM); resident as used)"


def allocate_kv_cache(arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    shape = (num_blocks * block_size, arch.num_kv_heads, arch.head_dim)
    if torch.device(device).type == "cpu":
        return [(lazy_zeros(shape, dtype), lazy_zeros(shape, dtype)) for _ in range(arch.num_layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(arch.num_layers)
    ]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages become resident only when written (anonymous mmap; the
    tensor keeps the map alive)."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=n).view(shape)
