"""BlockPool: fixed-size KV blocks, their reference counts, and the prefix cache's hash → block map.

A block id indexes ``block_size`` consecutive slots in every layer's KV tensors (and in a draft
model's, which shares block tables). Pure Python, no tensors: testable without weights.

Every block is in exactly one of three states (``check_invariants`` asserts it):

- **free**: ref count 0, no hash, in ``_free`` (FIFO: allocated in the order it was freed);
- **evictable**: ref count 0, still hashed (its KV is a cached full block), in the LRU
  ``_evictable`` (oldest first) and in ``_cached`` (hash → block);
- **held**: ref count > 0 (one per request whose block table lists it), hashed or not. A hashed
  held block may be shared by several requests: its KV is complete and nobody writes it again.

Allocation takes free blocks first and only then the LRU's oldest evictable block, dropping its hash
(its KV is about to be overwritten). ``free`` of the last reference sends a hashed block to the LRU's
tail (most recently used), an unhashed one to the free list. Requests free their blocks tail first,
so a request's last blocks are evicted before its prefix, which other requests are likelier to share.
Evictable blocks count as free for ``usage`` (vLLM's ``kv_cache_usage_perc``) and ``can_allocate``.

Block hash = sha256(parent hash ‖ token ids of the block ‖ extra keys), a chain: equal hashes mean
equal tokens from position 0 to the block's end (extra keys — LoRA id, multimodal hashes, cache salt —
are an empty slot for now). sha256, not Python's ``hash``: a collision would silently serve another
prompt's KV (vLLM switched to sha256 for the same reason). One block per hash: a second block with
the same contents (two requests computed the same prefix at once) stays unhashed.

Thread safety: every public method holds one lock, so ``reset_prefix_cache`` may run on a server
thread while the engine thread schedules. ``reset_prefix_cache`` only ever turns evictable blocks
into free ones (contents unchanged), so the scheduler's lookup → ``take`` sequence stays correct
if a reset slips in between: ``take`` accepts a looked-up block that has lost its hash meanwhile.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

BlockHash = bytes
ROOT_HASH: BlockHash = hashlib.sha256(b"tandem prefix cache root").digest()

F = TypeVar("F", bound=Callable[..., Any])


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] = ()) -> BlockHash:
    """Chained hash of one full block: sha256(parent ‖ int64 token ids ‖ len-prefixed extra keys)."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        extra = repr(extra_keys).encode()
        h.update(len(extra).to_bytes(8, "little"))
        h.update(extra)
    return h.digest()


def _locked(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: BlockPool, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class ResetResult:
    """What ``reset_prefix_cache`` did: ``complete`` iff no block was held (vLLM's success)."""

    evicted_blocks: int  # evictable blocks whose hash was dropped
    held_blocks: int  # blocks referenced by requests (their hashes, if any, are kept)
    held_cached_blocks: int  # of those, hashed ones still in the cache

    @property
    def complete(self) -> bool:
        return self.held_blocks == 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.RLock()
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse their memory

    # ---- counts --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free + evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash (held or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1] (vLLM's kv_cache_usage_perc: evictable
        cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    # ---- allocation ----------------------------------------------------------------------------
    @_locked
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b, _ = self._free.popitem(last=False)
            else:
                b, _ = self._evictable.popitem(last=False)  # LRU's oldest
                del self._cached[self._hash[b]]  # type: ignore[index]
                self._hash[b] = None
                self.num_evictions += 1
            self.ref_counts[b] = 1
            out.append(b)
        return out

    @_locked
    def take(self, cached: Sequence[int], num_new: int) -> list[int] | None:
        """Atomically take a reference on ``cached`` blocks (a prefix-cache hit) and allocate
        ``num_new`` more; ``cached + new``, or None (nothing changed) if memory is short.

        Hit blocks that are evictable stop being allocatable once taken, so they count against the
        room for the new ones.
        """
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        if num_new + revived > self.num_free_blocks:
            return None
        self.touch(cached)
        return list(cached) + self.allocate(num_new)

    @_locked
    def touch(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block (cache hits): evictable ones leave the LRU."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                if b in self._evictable:
                    del self._evictable[b]
                else:  # hash dropped by a reset since the lookup: the KV is still there, take it
                    del self._free[b]
            self.ref_counts[b] += 1

    @_locked
    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; tail first, so a request's prefix is evicted last."""
        for b in reversed(blocks):
            rc = self.ref_counts[b]
            if rc <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] = rc - 1
            if rc == 1:
                if self._hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free[b] = None

    # ---- prefix cache --------------------------------------------------------------------------
    @_locked
    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks of the longest prefix of ``hashes`` that is cached (held or evictable)."""
        out: list[int] = []
        if not self.enable_caching:
            return out
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    @_locked
    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held block whose KV is complete under ``block_hash``. False (and no change)
        if caching is off, the block already has a hash, or another block holds this hash."""
        if not self.enable_caching or self._hash[block_id] is not None or block_hash in self._cached:
            return False
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"caching KV block {block_id}, which no request holds")
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    @_locked
    def reset_prefix_cache(self) -> ResetResult:
        """Drop the hash of every evictable block (they become plain free blocks). Held blocks keep
        theirs: the requests holding them never write them again, so they stay valid."""
        evicted = len(self._evictable)
        for b in self._evictable:
            del self._cached[self._hash[b]]  # type: ignore[index]
            self._hash[b] = None
            self._free[b] = None
        self._evictable.clear()
        held = sum(1 for rc in self.ref_counts if rc > 0)
        return ResetResult(evicted_blocks=evicted, held_blocks=held, held_cached_blocks=len(self._cached))

    # ---- checks --------------------------------------------------------------------------------
    def all_free(self) -> bool:
        """No block is held (evictable cached blocks count as free)."""
        return self.num_free_blocks == self.num_blocks and not any(self.ref_counts)

    @_locked
    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one state (tests call this)."""
        assert not set(self._free) & set(self._evictable), "block both free and evictable"
        for b in range(self.num_blocks):
            rc, h = self.ref_counts[b], self._hash[b]
            assert rc >= 0, f"block {b}: negative ref count"
            if rc == 0:
                assert (b in self._free) == (h is None) and (b in self._evictable) == (h is not None), \
                    f"block {b}: ref 0 but in the wrong list"
            else:
                assert b not in self._free and b not in self._evictable, f"held block {b} in a free list"
            if h is not None:
                assert self._cached.get(h) == b, f"block {b}: hash not mapped back"
        assert len(self._cached) == sum(h is not None for h in self._hash)
