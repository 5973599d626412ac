"""BlockPool: the free list of fixed-size KV blocks and their reference counts.

A block id indexes ``block_size`` consecutive slots in every layer's KV tensors (and in a draft
model's, which shares block tables). Blocks are handed out in FIFO order of freeing. Pure Python,
no tensors: testable without weights.

Invariant: every block is either free (ref_count 0, in the free list) or held (ref_count > 0).
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        # Free in reverse so a request's tail blocks are reused last-in-first-out-ish.
        for b in reversed(blocks):
            rc = self.ref_counts[b]
            if rc <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] = rc - 1
            if rc == 1:
                self._free.append(b)

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks and not any(self.ref_counts)
