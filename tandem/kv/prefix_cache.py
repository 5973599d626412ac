"""PrefixCache: which of a request's blocks are cached, and which cached blocks a new request can use.

The policy half of automatic prefix caching (the BlockPool holds the hash → block map and the LRU).

Rules (each one protects correctness, not just speed):

- **Only full blocks of computed tokens are registered.** Block i of a request is registered once
  ``min(num_computed_tokens, len(token_ids)) >= (i + 1) * block_size``, i.e. after the step that
  wrote its last KV slot was scheduled, output tokens included. ``num_computed_tokens`` counts
  accepted tokens only (rejected drafts were rolled back by count), so the slots of rejected drafts —
  garbage KV — are never registered. ``min(…, len(token_ids))`` covers a stop inside an accepted
  run, where tokens past the end were dropped, and a token sampled on the device but not read yet
  (a placeholder: its id is not known, so it cannot be hashed). A block whose last KV is still being
  written by a launched step (asynchronous decode) may be registered: any later step that reads it
  runs after that write on the device.
- **Lookup happens at admission** (new or preempted request, nothing computed): the longest chain of
  cached blocks over the request's tokens, capped at ``num_tokens - 1`` rounded down to a block
  boundary, so at least one token is computed and the request samples. Requests that want prompt
  logprobs skip the lookup (they need logits at every prompt position).
- **No shared writes.** The hit covers whole blocks and the first position computed (the hit length)
  starts a block the request allocates for itself; a request only writes at positions
  ``>= num_computed_tokens``, which never decreases below a registered block's end while it runs.
  So no request writes target KV into a block another request references.
- **Draft model KV.** The draft model's KV lives in the same block ids. On a hit the draft has none
  of the prefix, so the scheduler sets ``draft_num_computed = 0``: the draft recomputes its KV for
  the whole prefix and rewrites it into the shared blocks. Another request's draft may be reading
  those slots: it gets the same values (same tokens, same positions, deterministic computation; at
  worst last-bit differences between batch shapes). This touches only proposal quality, never output
  correctness — the target verifies every draft against its own KV, which nobody rewrites.

Per-request state (hashes of full blocks, number of leading blocks already registered) is kept here,
keyed by the Request object, and dropped when the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.kv.block_pool import BlockHash, BlockPool, hash_block
from tandem.request import Request


@dataclass
class _ReqState:
    hashes: list[BlockHash] = field(default_factory=list)  # of the request's full blocks, in order
    num_registered: int = 0  # leading entries of block_ids known to be cached


@dataclass
class PrefixCacheStats:
    """Token counts (vLLM semantics): queries = tokens looked up, hits = tokens found cached.
    First admissions and re-admissions after preemption are counted apart, so the hit rate of new
    prompts is not inflated by recovering preempted requests."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        self._state: dict[Request, _ReqState] = {}

    def _extra_keys(self, req: Request) -> tuple[object, ...]:
        """Extra hash keys of a request's blocks (LoRA id, multimodal hashes, cache salt): none yet."""
        return ()

    def _hashes(self, req: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first ``num_blocks`` full blocks (computed once, extended lazily:
        token_ids only ever grow)."""
        st = self._state.setdefault(req, _ReqState())
        hs, bs = st.hashes, self.block_size
        extra = self._extra_keys(req)
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(hash_block(hs[-1] if hs else None, req.token_ids[i * bs:(i + 1) * bs], extra))
        return hs[:num_blocks]

    def lookup(self, req: Request) -> list[int]:
        """Cached blocks for a waiting request's leading tokens (no references taken)."""
        if not self.enabled or req.num_computed_tokens or req.params.prompt_logprobs is not None:
            return []
        return self.pool.lookup(self._hashes(req, (len(req.token_ids) - 1) // self.block_size))

    def admitted(self, req: Request, hits: list[int]) -> None:
        """Record an admission that took ``hits`` (the first blocks of ``req.block_ids``)."""
        if not self.enabled or req.params.prompt_logprobs is not None:
            return
        self._state.setdefault(req, _ReqState()).num_registered = len(hits)
        n = len(hits) * self.block_size
        if req.num_preemptions == 0:
            self.stats.queries += req.num_tokens
            self.stats.hits += n
            req.num_cached_tokens = n
        else:
            self.stats.preempted_queries += req.num_tokens
            self.stats.preempted_hits += n

    def register(self, req: Request) -> None:
        """Register the request's blocks that became full of computed KV since the last call."""
        if not self.enabled:
            return
        st = self._state.get(req)
        if st is None:
            st = self._state[req] = _ReqState()
        num_full = min(req.num_computed_tokens, len(req.token_ids)) // self.block_size
        num_full = min(num_full, len(req.block_ids))
        if num_full <= st.num_registered:
            return
        hashes = self._hashes(req, num_full)
        for i in range(st.num_registered, num_full):
            # False when another block already holds this hash (computed twice concurrently): this
            # copy just stays unhashed and returns to the free list when released.
            self.pool.cache_block(req.block_ids[i], hashes[i])
        st.num_registered = num_full

    def released(self, req: Request, finished: bool) -> None:
        """The request's blocks were freed (finished, aborted or preempted)."""
        if finished:
            self._state.pop(req, None)
        elif req in self._state:
            self._state[req].num_registered = 0  # hashes stay valid: its tokens do not change
