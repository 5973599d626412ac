"""The EAGLE feature cache: the target's features of every position, kept in its KV slots.

An EAGLE head at position ``p`` reads the target's features at ``p`` (EAGLE-3: the hidden states
entering its three aux layers, concatenated; EAGLE-1: the final post-norm hidden state). Every target
forward writes the features of each query row to the row's KV slot, inside the forward — in the CUDA
graph where there is one — as it writes K and V. So a target step hands nothing to the host and does
no per-request work. The EAGLE head's first step of a proposal reads them back by its own slot
mapping (``gather``: head position ``p`` lives in the same slot as target position ``p``), inside the
head's graph too.

The rows follow the blocks' life, as the KV does: a later write at a position (a rejected draft's row
overwritten, a recompute after preemption) replaces it; the features of a prefix-cache block stay
there for the next request that hits it (the runner writes features in every forward, speculation on
or off). A position's row is valid once the target step that computed it has run: a head forward
queued after that step on the same stream reads it, so an asynchronous pipeline needs no sync.

Layout ``[num_slots + 1, width]`` in the target's dtype; the last row takes the writes of padding
tokens (slot -1). On the CPU the tensor is an anonymous memory map (``lazy_zeros``): resident only
where written, like the KV cache. Bytes per block count in the KV budget (``bytes_per_block``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.kv.kv_cache import lazy_zeros


class FeatureCache:
    def __init__(self, width: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.width = width
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        shape = (self.num_slots + 1, width)
        device = torch.device(device)
        self.rows = lazy_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        self.device = device

    @staticmethod
    def bytes_per_block(width: int, block_size: int, dtype: torch.dtype) -> int:
        return block_size * width * torch.empty((), dtype=dtype).element_size()

    def write(self, slot_mapping: torch.Tensor, features: torch.Tensor) -> None:
        """Features [T, width] of a step's query rows to their slots ([T] int64, -1: padding). No host
        work that depends on the values: safe inside a CUDA graph."""
        self.rows.index_copy_(0, self._row_index(slot_mapping), features.to(self.rows.dtype))

    def gather(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The rows of a step's slots ([T] int64, -1: padding reads the spare row): [T, width]. No
        host work: safe inside a CUDA graph (the EAGLE head's first step reads its inputs so)."""
        return self.rows.index_select(0, self._row_index(slot_mapping))

    def write_positions(self, block_ids: Sequence[int], start: int, features: torch.Tensor) -> None:
        """Features of positions ``start ..`` of one request (a host step that has no slot tensor)."""
        self.write(torch.from_numpy(self.slots(block_ids, start, start + features.shape[0])).to(self.device), features)

    def _row_index(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Slots → rows of ``rows``: padding (-1) → the spare last row."""
        return torch.where(slot_mapping < 0, self.num_slots, slot_mapping)

    def slots(self, block_ids: Sequence[int], lo: int, hi: int) -> np.ndarray:
        """The slots of positions ``lo .. hi - 1`` in a request's blocks."""
        bs = self.block_size
        pos = np.arange(lo, hi, dtype=np.int64)
        return np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs


def require_features(features: FeatureCache | None) -> FeatureCache:
    """A head runner's feature cache, for a step without hidden inputs (a proposal's first step)."""
    if features is None:
        raise ValueError("a head step without hidden inputs reads the target's features: this runner has none")
    return features
