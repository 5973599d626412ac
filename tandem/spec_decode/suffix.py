"""Suffix proposer (SuffixDecoding, as vLLM's ``method: "suffix"`` / Snowflake ArcticInference).

Drafts by following the most frequent continuation of the longest recent pattern, looked up in two
suffix tries: a per-request trie over the prompt and the accepted output so far, and a global trie
over the outputs of finished requests (agentic loops and code edits repeat earlier answers). No
model, no probabilities: drafts are one-hot q for the rejection sampler.

The trie holds every suffix of its sequences, truncated to ``max_depth`` tokens. A node stands for a
token string s; its ``count`` is the number of positions where s occurs (occurrences that end at a
sequence's last token included). Each node remembers its most frequent child (first to reach the
highest count wins ties). The trie is never materialised: :class:`SuffixIndex`
(``suffix_index.py``, a suffix automaton with occurrence counts) answers the same counts and most
frequent children with O(1) amortised new states per token instead of ``max_depth`` trie nodes.

Proposal (ArcticInference's ``SuffixTree.speculate`` with linear, not tree, drafts). For every match
length m = 1, 2, ... (stopping at the first suffix of the context that does not occur):

- the node of the context's last m tokens, if any, is followed along most frequent children for at
  most ``min(num_tokens, int(m * max_spec_factor))`` tokens; a step to child c of node v multiplies
  the running probability by ``count(c) / count(v)`` and the walk stops once it falls below
  ``min_token_prob``;
- the draft's score is the sum of those running probabilities (its expected accepted length under
  the counts); the best score wins, ties going to the longer match.

The per-request and the global answers are compared the same way (ties: the per-request one).

Worked example (one request, max_spec_factor = 1, min_token_prob = 0.1, k = 4)::

    tokens   1 2 3 1 2 3 1 2 4 1 2
    m = 1: "2" occurs 4 times (the last one ends the sequence), followed by 3 twice and 4 once;
           at most 1 token → [3] with prob 2/4, score 0.5
    m = 2: "1 2" occurs 4 times, followed by 3 (2), 4 (1) → 3 at 0.5; "1 2 3" occurs twice, always
           followed by 1 → 1 at 0.5 · 2/2 = 0.5; at most 2 tokens → [3, 1], score 1.0
    m = 3: "4 1 2" occurs once, at the very end: nothing follows → [], score 0
    m = 4: "2 4 1 2" likewise; m = 5 ... the longer suffixes do not occur earlier either
    → draft [3, 1]. With max_spec_factor = 2, m = 2 allows 4 tokens: [3, 1, 2, 3]
      (probabilities 0.5, 0.5, 0.5, 0.25: "1 2 3 1 2" is followed by 3 once and ends once).
      With min_token_prob = 0.6 nothing is drafted.

Lifecycle. The per-request index is created at a request's first proposal from its prompt + output
and extended with the accepted tokens at each later one (accepted tokens only ever grow; a request
whose tokens visibly do not extend what the index has seen, shorter or with another token where the
last seen one was, is rebuilt). When the request finishes the speculator calls
:meth:`SuffixProposer.forget` with its output: the per-request index is dropped and the output joins
the global one (:class:`FinishedOutputs`), which keeps the ``max_cached_requests`` most recently
finished outputs (oldest evicted first, as ArcticInference's FIFO; 0 turns the global trie off).
Unlike ArcticInference, a response joins the global trie when its request finishes, not while it is
being generated. An evicted output's counts are subtracted, but a suffix automaton keeps the states
(count 0); once the index has over 4 states per live token (+ 4096) a fresh one is built alongside,
from the cached outputs, a few per :meth:`~FinishedOutputs.add` (as many tokens as added, + 512), and
replaces the old one when complete: memory stays O(cached tokens) with no rebuild pause.

Ties. Counts and therefore scores are exactly the trie's, and the chosen continuation is always a
most frequent one. The tie rule between equally frequent continuations (first to reach the count)
is the trie's while tokens are only added, i.e. always for the per-request index. In the global
index, once an eviction leaves a pattern's most frequent continuation tied (or an index is rebuilt
from the cached outputs) the tie goes to the continuation seen first, which the trie, having seen
the evicted outputs, may order differently.

Acceptance gate. The suffix proposer declares ``drafts_on_host_for_free = False``: its drafts are
host lookups, but the gate's shadow drafts ask ``(tokens, k)`` about *earlier* prefixes of a
request, which a per-request trie already holding the later tokens would answer with the future in
view. So ``disable_by_acceptance`` stays n-gram-only.

Cost (``benchmarks/suffix_cost.py``, docs/performance.md). Per token: O(1) amortised automaton
steps plus one count update per distinct occurrence count among the last D suffixes (2-5 in text, at
most D + 1). Per proposal: the per-request index starts from the tracked end state (no matching);
the global one matches the context's last hint + 1 tokens, the hint being the last match + the
tokens accepted since (all D only when that window matches whole); then each state on the
suffix-link path is walked once for at most k tokens, skipped when it cannot beat the best so far:
no re-walks from the root, independent of the context length. Memory: at most 2 states per token
(a small int dict each, ~0.3-0.5 KB per token), against up to D trie nodes per token before.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.config.speculative import SpeculativeConfig
from tandem.errors import ConfigError
from tandem.spec_decode.base import DraftProposal, ProposalInput
from tandem.spec_decode.suffix_index import NO_DRAFT, SuffixDraft, SuffixIndex

__all__ = ["FinishedOutputs", "SuffixDraft", "SuffixIndex", "SuffixProposer"]

_SLACK_STATES = 4096  # dead states tolerated beyond 4 per live token before a rebuild starts
_MIN_REBUILD_TOKENS = 512  # rebuild work per add, beyond the tokens added


def _ints(tokens: Sequence[int]) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]


class FinishedOutputs:
    """The global index: the ``capacity`` most recently added outputs (FIFO), in a
    :class:`SuffixIndex` that is rebuilt incrementally when evictions have left it mostly dead."""

    def __init__(self, max_depth: int, capacity: int) -> None:
        self.max_depth = max_depth
        self.capacity = capacity
        self._seqs: OrderedDict[str, list[int]] = OrderedDict()  # oldest first
        self.index = SuffixIndex(max_depth)
        self._fresh: SuffixIndex | None = None  # the rebuild under way
        self._todo: deque[str] = deque()  # outputs still to copy into it
        self._copied: set[str] = set()  # outputs already in it

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    @property
    def rebuilding(self) -> bool:
        return self._fresh is not None

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float, hint: int | None = None) -> SuffixDraft:
        if not self._seqs:
            return NO_DRAFT
        return self.index.speculate(context, max_tokens, max_spec_factor, min_token_prob, hint)

    def add(self, request_id: str, tokens: Sequence[int]) -> None:
        """Cache ``tokens`` as ``request_id``'s output (an id already cached: the new output
        replaces the old, now the newest); evict the oldest beyond ``capacity``."""
        self.remove(request_id)
        if self.capacity == 0 or len(tokens) == 0:
            return
        toks = _ints(tokens)
        self._seqs[request_id] = toks
        self.index.add(toks)
        if self._fresh is not None:
            self._fresh.add(toks)
            self._copied.add(request_id)
        while len(self._seqs) > self.capacity:
            self.remove(next(iter(self._seqs)))
        self._rebuild_step(len(toks) + _MIN_REBUILD_TOKENS)

    def remove(self, request_id: str) -> None:
        toks = self._seqs.pop(request_id, None)
        if toks is None:
            return
        self.index.remove(toks)
        if request_id in self._copied:
            self._copied.discard(request_id)
            assert self._fresh is not None
            self._fresh.remove(toks)

    def _rebuild_step(self, budget: int) -> None:
        if self._fresh is None:
            if self.index.num_states <= 4 * self.index.num_tokens + _SLACK_STATES:
                return
            self._fresh, self._todo, self._copied = SuffixIndex(self.max_depth), deque(self._seqs), set()
        while budget > 0 and self._todo:
            rid = self._todo.popleft()
            toks = self._seqs.get(rid)
            if toks is None or rid in self._copied:  # evicted, or replaced (and copied) meanwhile
                continue
            self._fresh.add(toks)
            self._copied.add(rid)
            budget -= len(toks)
        if not self._todo:
            self.index, self._fresh, self._copied = self._fresh, None, set()


@dataclass
class _Request:
    index: SuffixIndex
    num_tokens: int = 0  # tokens of the request in the index
    last_token: int | None = None
    context: list[int] = field(default_factory=list)  # its last max_depth tokens
    # the longest suffix of the context found in the global index, and the request's length then:
    # a hint for the next lookup (SuffixIndex.match)
    global_match: int | None = None
    global_at: int = 0


class SuffixProposer:
    """SuffixDecoding drafts; implements :class:`tandem.spec_decode.base.Proposer`. Keeps
    per-request state: call :meth:`forget` when a request finishes."""

    drafts_on_host_for_free = False  # host lookups, but no stateless shadow drafts (module docstring)

    def __init__(self, num_speculative_tokens: int, *, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        for key, value, lo in (("num_speculative_tokens", num_speculative_tokens, 1),
                               ("suffix_decoding_max_tree_depth", max_tree_depth, 1),
                               ("suffix_decoding_max_cached_requests", max_cached_requests, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ConfigError(key, f"must be an integer >= {lo}, got {value!r}")
        if not isinstance(max_spec_factor, (int, float)) or not 0 < max_spec_factor < float("inf"):
            raise ConfigError("suffix_decoding_max_spec_factor", f"must be > 0, got {max_spec_factor!r}")
        if not isinstance(min_token_prob, (int, float)) or not 0 <= min_token_prob <= 1:
            raise ConfigError("suffix_decoding_min_token_prob",
                              f"must be between 0 and 1, got {min_token_prob!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.global_tree = FinishedOutputs(max_tree_depth, max_cached_requests)
        self._requests: dict[str, _Request] = {}

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig) -> SuffixProposer:
        if cfg.method != "suffix":
            raise ConfigError("method", f"expected method 'suffix', got {cfg.method!r}", ["suffix"])
        assert cfg.suffix_decoding_max_tree_depth is not None  # filled in by the config
        assert cfg.suffix_decoding_max_cached_requests is not None
        assert cfg.suffix_decoding_max_spec_factor is not None
        assert cfg.suffix_decoding_min_token_prob is not None
        return cls(cfg.num_speculative_tokens, max_tree_depth=cfg.suffix_decoding_max_tree_depth,
                   max_cached_requests=cfg.suffix_decoding_max_cached_requests,
                   max_spec_factor=cfg.suffix_decoding_max_spec_factor,
                   min_token_prob=cfg.suffix_decoding_min_token_prob)

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    def propose(self, requests: Sequence[ProposalInput]) -> DraftProposal:
        return DraftProposal(token_ids=[self.propose_for(r.request_id, r.token_ids, r.num_tokens)
                                        for r in requests])

    def propose_for(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts for request ``request_id`` whose accepted tokens are
        ``token_ids`` (prompt + output); updates its index with the tokens it has not seen."""
        k = min(num_tokens, self.num_speculative_tokens)
        if k <= 0:
            return []
        st = self._sync(request_id, token_ids)
        local = st.index.speculate_open(k, self.max_spec_factor, self.min_token_prob)
        g = self.global_tree
        if len(g):
            hint = None if st.global_match is None else st.global_match + st.num_tokens - st.global_at
            s, m = g.index.match(st.context, hint)
            st.global_match, st.global_at = m, st.num_tokens
            if m:
                other = g.index.draft_from(s, m, k, self.max_spec_factor, self.min_token_prob)
                if other.score > local.score:
                    return other.token_ids
        return local.token_ids

    def propose_ahead(self, request_id: str, token_ids: Sequence[int], assumed: Sequence[int],
                      num_tokens: int) -> list[int]:
        """The token expected after accepted ``token_ids`` + ``assumed`` (a chained verify's drafts,
        assumed accepted), then up to ``min(num_tokens, num_speculative_tokens)`` drafts after it
        (``base.py``). The request's index takes ``token_ids`` only: both indexes are matched against
        the context with the assumed tokens (the longest suffix of it that occurs, as in the global
        lookup), so an assumption that fails leaves nothing to rebuild. The counts then leave out the
        assumed tokens' own occurrences, which a committed lookup would include: a draft may differ
        from the one ``propose_for`` would give once they are accepted (any draft is lossless)."""
        k = min(num_tokens, self.num_speculative_tokens)
        if k <= 0:
            return []
        st = self._sync(request_id, token_ids)
        ctx = st.context + _ints(assumed)
        local = st.index.speculate(ctx, k + 1, self.max_spec_factor, self.min_token_prob)
        g = self.global_tree
        if len(g):
            other = g.speculate(ctx, k + 1, self.max_spec_factor, self.min_token_prob)
            if other.score > local.score:
                return other.token_ids
        return local.token_ids

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """Request ``request_id`` finished with ``output_token_ids``: drop its index, cache its output
        in the global one (evicting the oldest cached outputs beyond ``max_cached_requests``)."""
        self._requests.pop(request_id, None)
        self.global_tree.add(request_id, output_token_ids)

    def _sync(self, request_id: str, token_ids: Sequence[int]) -> _Request:
        st = self._requests.get(request_id)
        n = len(token_ids)
        if st is None or n < st.num_tokens or (st.num_tokens and int(token_ids[st.num_tokens - 1]) != st.last_token):
            st = self._requests[request_id] = _Request(SuffixIndex(self.max_tree_depth))
        if n > st.num_tokens:
            new = _ints(token_ids[st.num_tokens :])
            st.index.append(new)
            st.num_tokens, st.last_token = n, new[-1]
            ctx = st.context
            ctx += new
            if len(ctx) > self.max_tree_depth:
                del ctx[: len(ctx) - self.max_tree_depth]
        return st
