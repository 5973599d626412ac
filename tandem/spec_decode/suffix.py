"""Suffix proposer (SuffixDecoding, as vLLM's ``method: "suffix"`` / Snowflake ArcticInference).

Drafts by following the most frequent continuation of the longest recent pattern, looked up in two
suffix tries: a per-request trie over the prompt and the accepted output so far, and a global trie
over the outputs of finished requests (agentic loops and code edits repeat earlier answers). No
model, no probabilities: drafts are one-hot q for the rejection sampler.

The trie (:class:`SuffixTree`) holds every suffix of its sequences, truncated to ``max_depth``
tokens. A node stands for a token string s; its ``count`` is the number of positions where s occurs
(occurrences that end at a sequence's last token included). Appending a token to a sequence extends
its (at most ``max_depth``) open suffixes by one node each: O(max_depth) per token, never a rebuild.
Each node remembers its most frequent child (first to reach the highest count wins ties).

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

Lifecycle. The per-request trie is created at a request's first proposal from its prompt + output
and extended with the accepted tokens at each later one (accepted tokens only ever grow; a request
whose tokens visibly do not extend what the trie has seen, shorter or with another token where the
last seen one was, is rebuilt). When the request finishes the speculator calls
:meth:`SuffixProposer.forget` with its output: the per-request trie is dropped and the output joins the global trie, which keeps the ``max_cached_requests`` most recently finished
outputs (oldest evicted first, as ArcticInference's FIFO; 0 turns the global trie off). Unlike
ArcticInference, a response joins the global trie when its request finishes, not while it is being
generated.

Acceptance gate. The suffix proposer declares ``drafts_on_host_for_free = False``: its drafts are
host lookups, but the gate's shadow drafts ask ``(tokens, k)`` about *earlier* prefixes of a
request, which a per-request trie already holding the later tokens would answer with the future in
view. So ``disable_by_acceptance`` stays n-gram-only.

Cost. Insertion is O(max_depth) dictionary operations per token (a prompt of n tokens: O(n · D)
nodes at most, there is no path compression). A proposal tries at most D match lengths of O(D) each
per trie: O(D²) per request per step, independent of the context length. Measured (pure Python,
2-core CPU, D = 24): a 4096-token prompt of mostly distinct ids takes ~230 ms and ~86k nodes to
insert at the request's first proposal; each later step (one new token + a proposal) ~75 µs. Path
compression (ArcticInference's O(n) nodes) is not implemented, so a large global cache of long
outputs costs O(total tokens · D) nodes of memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from tandem.config.speculative import SpeculativeConfig
from tandem.errors import ConfigError
from tandem.spec_decode.base import DraftProposal, ProposalInput


class _Node:
    __slots__ = ("count", "children", "best")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.best: int | None = None  # token of the most frequent child


@dataclass(frozen=True)
class SuffixDraft:
    token_ids: list[int]
    score: float = 0.0  # sum of the running probabilities: expected accepted tokens
    match_len: int = 0


_NO_DRAFT = SuffixDraft([])


class SuffixTree:
    """Suffix trie, depth-capped at ``max_depth``, over any number of token sequences."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self._open: dict[Hashable, list[_Node]] = {}  # per sequence: its open suffixes, shallowest first
        self._seqs: dict[Hashable, list[int]] = {}  # per sequence: its tokens (for remove)
        self.num_nodes = 0

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(seq_id, t)

    def append(self, seq_id: Hashable, token: int) -> None:
        """One more token of sequence ``seq_id``: every open suffix grows by it (O(max_depth))."""
        token = int(token)
        seq = self._seqs.setdefault(seq_id, [])
        seq.append(token)
        nodes = self._open.get(seq_id, [])
        self.root.count += 1
        grown: list[_Node] = []
        for node in [self.root, *nodes]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            best = node.best
            if best is None or (best != token and child.count > node.children[best].count):
                node.best = token
            grown.append(child)
        self._open[seq_id] = grown[: self.max_depth - 1]  # grown[i] is at depth i + 1

    def close(self, seq_id: Hashable) -> None:
        """No more tokens for ``seq_id`` (it stays in the trie): frees its open-suffix list."""
        self._open.pop(seq_id, None)

    def remove(self, seq_id: Hashable) -> None:
        """Take sequence ``seq_id`` out: every count it added is subtracted, emptied nodes deleted."""
        seq = self._seqs.pop(seq_id, None)
        self._open.pop(seq_id, None)
        if seq is None:
            return
        for start in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for token in seq[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:  # its whole subtree counted only this occurrence
                    del node.children[token]
                    self.num_nodes -= _size(child)
                if node.best == token:
                    node.best = max(node.children, key=lambda t: node.children[t].count, default=None)
                if child.count == 0:
                    break
                node = child

    def match(self, pattern: Sequence[int]) -> _Node | None:
        """The node of ``pattern`` (None if it never occurs)."""
        node: _Node | None = self.root
        for t in pattern:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> SuffixDraft:
        """The best chain draft for what follows ``context`` (see the module docstring)."""
        best = _NO_DRAFT
        if max_tokens <= 0:
            return best
        for m in range(1, min(len(context), self.max_depth) + 1):
            node = self.match(context[len(context) - m :])
            if node is None:
                break
            limit = min(max_tokens, int(m * max_spec_factor + 1e-6))
            draft = _follow(node, limit, min_token_prob)
            if draft and sum(draft[1]) >= best.score:
                best = SuffixDraft(draft[0], sum(draft[1]), m)
        return best


def _follow(node: _Node, limit: int, min_token_prob: float) -> tuple[list[int], list[float]] | None:
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(tokens) < limit and node.best is not None:
        child = node.children[node.best]
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        tokens.append(node.best)
        probs.append(prob)
        node = child
    return (tokens, probs) if tokens else None


def _size(node: _Node) -> int:
    stack, n = [node], 0
    while stack:
        cur = stack.pop()
        n += 1
        stack.extend(cur.children.values())
    return n


@dataclass
class _Request:
    tree: SuffixTree
    num_tokens: int = 0  # tokens of the request in the trie
    last_token: int | None = None
    context: list[int] = field(default_factory=list)  # its last max_depth tokens


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
        self.global_tree = SuffixTree(max_tree_depth)
        self._cached: OrderedDict[str, None] = OrderedDict()  # global trie's requests, oldest first
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
        ``token_ids`` (prompt + output); updates its trie with the tokens it has not seen."""
        k = min(num_tokens, self.num_speculative_tokens)
        if k <= 0:
            return []
        st = self._sync(request_id, token_ids)
        args = (st.context, k, self.max_spec_factor, self.min_token_prob)
        local = st.tree.speculate(*args)
        if len(self.global_tree):
            other = self.global_tree.speculate(*args)
            if other.score > local.score:
                return other.token_ids
        return local.token_ids

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """Request ``request_id`` finished with ``output_token_ids``: drop its trie, cache its output
        in the global trie (evicting the oldest cached outputs beyond ``max_cached_requests``)."""
        self._requests.pop(request_id, None)
        if self.max_cached_requests == 0:
            return
        if request_id in self._cached:  # an id used again: the newer output replaces the older
            self.global_tree.remove(request_id)
            del self._cached[request_id]
        if len(output_token_ids) == 0:
            return
        self.global_tree.extend(request_id, output_token_ids)
        self.global_tree.close(request_id)
        self._cached[request_id] = None
        while len(self._cached) > self.max_cached_requests:
            oldest, _ = self._cached.popitem(last=False)
            self.global_tree.remove(oldest)

    def _sync(self, request_id: str, token_ids: Sequence[int]) -> _Request:
        st = self._requests.get(request_id)
        n = len(token_ids)
        if st is None or n < st.num_tokens or (st.num_tokens and int(token_ids[st.num_tokens - 1]) != st.last_token):
            st = self._requests[request_id] = _Request(SuffixTree(self.max_tree_depth))
        if n > st.num_tokens:
            new = token_ids[st.num_tokens :]
            new = new.tolist() if hasattr(new, "tolist") else [int(t) for t in new]
            st.tree.extend(request_id, new)
            st.num_tokens, st.last_token = n, new[-1]
            st.context = (st.context + new)[-self.max_tree_depth :]
        return st
