"""The index behind the suffix proposer: a suffix automaton with occurrence counts, read up to a depth.

:class:`SuffixIndex` answers what the depth-capped suffix trie of ``suffix.py``'s docstring answers
(the count of every pattern of at most ``max_depth`` tokens, its most frequent next token, the best
draft for a context) without materialising the trie. It is a suffix automaton (the minimal DFA of all
substrings, Blumer et al. 1985) over any number of sequences: a state stands for a class of
patterns that occur at exactly the same end positions (the same "endpos"), so the trie's nodes for
those patterns share one state, one ``count`` (their number of occurrences) and one set of next
tokens with the same counts. A sequence of n tokens adds at most 2n states, each an O(1) amortised
step (Ukkonen-style online construction, generalised to many sequences), instead of the trie's
``max_depth`` nodes per token.

Counts. When a token ends a sequence's prefix at position i, every pattern ending there of at most
``max_depth`` tokens gains an occurrence: those patterns are the prefix's suffixes of length
1..min(D, i + 1), which lie in the states on the suffix-link path from the state of the length
min(D, i + 1) suffix (the sequence's "capped end", tracked per token) down to the root. Each of
those states' ``count`` goes up by one, so counts are exact for every state holding a pattern of at
most D tokens; states whose patterns are all longer never get counts and are never read. The path
has one state per distinct occurrence count among the last D suffixes: typically 2-5, at most D + 1
(a run like ``a b a b ...``). Removing a sequence walks the same paths down again.

Most frequent next token (``best``): the trie's rule, kept exactly while tokens are only added: when
pattern v's child v + x gains an occurrence, x becomes v's best if it now occurs more often than the
best so far (ties: the first to reach the count). The parents of the states whose counts went up are
the previous capped end's path (v + x lies in the state of v's transition on x). Each state also
keeps a bound on its other next tokens' counts (``_second``), so a removal that costs the best an
occurrence keeps it while it stays above the bound, and otherwise marks it stale; a stale best is
recomputed when read (highest count, ties to the first seen; additions leave it stale). The root's
best is never kept (no draft starts from the empty pattern). Patterns with no occurrences left keep
their states and transitions (a suffix automaton cannot drop states), with count 0, which reads as
"does not occur"; the owner of a removable index rebuilds it when too much of it is dead
(``suffix.py``'s finished-output cache).

Proposal. The states on the path from the context's longest occurring suffix (at most D tokens) down
to the root hold its suffixes of every length m; per state the greedy walk along ``best`` is the same
for all its m (same counts), so it is walked once, for the longest draft any of its m allows
(``min(k, int(m · max_spec_factor), D - m)``), and each m reads its score from the running sums.
Cost: (path states) × (draft length) dictionary reads, independent of the context's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

_NONE = -1  # a state without a next token (best)
_STALE = -2  # a state whose best lost an occurrence: rescan when read


@dataclass(frozen=True)
class SuffixDraft:
    token_ids: list[int]
    score: float = 0.0  # sum of the running probabilities: expected accepted tokens
    match_len: int = 0


NO_DRAFT = SuffixDraft([])


class SuffixIndex:
    """Suffix automaton over token sequences with exact occurrence counts for patterns of at most
    ``max_depth`` tokens. One sequence may be open (:meth:`append` grows it token by token); whole
    sequences are added with :meth:`add` and taken out with :meth:`remove`."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        # per state: transitions (token -> state), suffix link, longest pattern's length, occurrence
        # count, most frequent next token (_NONE / _STALE)
        self._next: list[dict[int, int]] = [{}]
        self._link: list[int] = [-1]
        self._len: list[int] = [0]
        self._count: list[int] = [0]
        self._best: list[int] = [_STALE]  # the root's: never kept up to date
        self._second: list[int] = [0]  # at least the count of every next token but the best
        self._open = [0, 0, 0]  # the open sequence: its whole prefix's state, capped end, length
        self._limits: dict[tuple[int, float], tuple[list[int], int]] = {}

    @property
    def num_states(self) -> int:
        return len(self._len)

    @property
    def num_tokens(self) -> int:
        """Tokens in the index (all sequences, removed ones not counted)."""
        return self._count[0]

    # ---- building ---------------------------------------------------------------------------------

    def append(self, tokens: Sequence[int]) -> None:
        """Grow the open sequence by ``tokens``."""
        self._open = self._extend(self._open, tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """One more whole sequence (the open one, if any, stays open)."""
        self._extend([0, 0, 0], tokens)

    def _extend(self, state: list[int], tokens: Sequence[int]) -> list[int]:
        nxt, link, length, count, best = self._next, self._link, self._len, self._count, self._best
        second = self._second
        cap = self.max_depth - 1
        last, end, n = state
        ell = min(n, cap)  # the previous suffix's length that the parents start from
        for x in tokens:
            # 1. the automaton: the state of the whole prefix + x (a new one, or an existing one
            #    when another sequence had this prefix already), splitting a state where needed
            t = nxt[last]
            q = t.get(x)
            if q is not None:
                last = q if length[q] == length[last] + 1 else self._split(last, q, x)
            else:
                cur = len(length)
                length.append(length[last] + 1)
                link.append(0)
                nxt.append({})
                count.append(0)
                best.append(_NONE)
                second.append(0)
                p = last
                while p != -1 and x not in t:
                    t[x] = cur
                    p = link[p]
                    if p != -1:
                        t = nxt[p]
                if p != -1:
                    q = t[x]
                    link[cur] = q if length[p] + 1 == length[q] else self._split(p, q, x)
                last = cur
            # 2. the previous suffix of min(D - 1, n) tokens: its state and those of the shorter
            #    ones (the suffix-link path) are the parents of the patterns ending here
            s = end
            while s and length[link[s]] >= ell:
                s = link[s]
            # 3. each pattern of at most D tokens ending here (parent + x) gains an occurrence (once
            #    per state: consecutive parents may share a child), and its parent may have a new
            #    most frequent next token
            end = seen = nxt[s][x]
            count[seen] += 1
            while s:  # the root's best is never kept (_STALE: read by rescanning)
                t = nxt[s]
                child = t[x]
                if child != seen:
                    count[child] += 1
                    seen = child
                b = best[s]
                if b != x and b != _STALE:  # a stale one stays stale: rescanned when read
                    if b == _NONE:
                        best[s] = x
                    else:
                        c, top = count[child], count[t[b]]
                        if c > top:
                            best[s], second[s] = x, top
                        elif c > second[s]:
                            second[s] = c
                s = link[s]
            if nxt[0][x] != seen:
                count[nxt[0][x]] += 1
            count[0] += 1
            n += 1
            if ell < cap:
                ell += 1
        return [last, end, n]

    def _split(self, p: int, q: int, x: int) -> int:
        """Clone ``q`` for the patterns of ``p`` + x and shorter (standard suffix-automaton split)."""
        nxt, link, length = self._next, self._link, self._len
        clone = len(length)
        length.append(length[p] + 1)
        link.append(link[q])
        nxt.append(dict(nxt[q]))
        self._count.append(self._count[q])
        self._best.append(self._best[q])
        self._second.append(self._second[q])
        link[q] = clone
        while p != -1 and nxt[p].get(x) == q:
            nxt[p][x] = clone
            p = link[p]
        return clone

    def remove(self, tokens: Sequence[int]) -> None:
        """Take out a sequence added earlier with :meth:`add` (exactly these tokens)."""
        nxt, link, length, count, best = self._next, self._link, self._len, self._count, self._best
        second = self._second
        cap = self.max_depth - 1
        end = 0
        for n, x in enumerate(tokens):
            ell = min(n, cap)
            s = end
            while s and length[link[s]] >= ell:
                s = link[s]
            end = seen = nxt[s][x]
            count[seen] -= 1
            while s:
                child = nxt[s][x]
                if child != seen:
                    count[child] -= 1
                    seen = child
                if best[s] == x and count[child] <= second[s]:  # it may no longer be the only top
                    best[s] = _STALE
                s = link[s]
            if nxt[0][x] != seen:
                count[nxt[0][x]] -= 1
            count[0] -= 1

    def _rescan(self, s: int) -> int:
        """Recompute ``s``'s most frequent next token: the highest count, ties to the first seen."""
        t = self._next[s]
        counts = list(map(self._count.__getitem__, t.values()))  # C loops: states may have 1000s
        top = max(counts, default=0)
        if top <= 0:
            b = _NONE
        else:
            i = counts.index(top)
            b = next(islice(t, i, None))
            counts[i] = 0
            self._second[s] = max(counts)
        if s:  # the root's stays _STALE
            self._best[s] = b
        return b

    # ---- reading ----------------------------------------------------------------------------------

    def _state(self, pattern: Sequence[int]) -> int | None:
        s = 0
        for t in pattern:
            child = self._next[s].get(int(t))
            if child is None or self._count[child] <= 0:
                return None
            s = child
        return s

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (0 if it is longer than ``max_depth``); ``[]``: all tokens."""
        s = self._state(pattern) if len(pattern) <= self.max_depth else None
        return 0 if s is None else self._count[s]

    def next_counts(self, pattern: Sequence[int]) -> dict[int, int]:
        """The trie node's children: next token -> occurrences of ``pattern`` + it."""
        s = self._state(pattern) if len(pattern) < self.max_depth else None
        if s is None:
            return {}
        return {t: self._count[c] for t, c in self._next[s].items() if self._count[c] > 0}

    def best_next(self, pattern: Sequence[int]) -> int | None:
        """The most frequent next token after ``pattern`` (None: nothing follows within the depth)."""
        s = self._state(pattern) if len(pattern) < self.max_depth else None
        if s is None:
            return None
        b = self._rescan(s) if self._best[s] == _STALE else self._best[s]
        return None if b == _NONE else b

    def match(self, context: Sequence[int], hint: int | None = None) -> tuple[int, int]:
        """The state and length of the longest suffix of ``context`` (at most ``max_depth`` tokens)
        that occurs. ``hint``: a guess at that length (e.g. the last answer + the tokens appended
        since); only the last hint + 1 tokens are matched, unless all of them match."""
        d = min(len(context), self.max_depth)
        if hint is not None and hint + 1 < d:
            s, m = self._match(context[len(context) - hint - 1 :])
            if m <= hint:  # the longest match is shorter than the window: exact
                return s, m
        return self._match(context[len(context) - d :])

    def _match(self, tokens: Sequence[int]) -> tuple[int, int]:
        nxt, link, length, count = self._next, self._link, self._len, self._count
        s = m = 0
        for x in tokens:
            child = nxt[s].get(x)
            if child is not None and count[child] > 0:
                s, m = child, m + 1
                continue
            while s:
                s = link[s]
                child = nxt[s].get(x)
                if child is not None and count[child] > 0:
                    break
            if child is not None and count[child] > 0:
                m = length[s] + 1
                s = child
            else:
                m = 0
        return s, m

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float, hint: int | None = None) -> SuffixDraft:
        """The best chain draft after ``context`` (``suffix.py``'s docstring): from its longest
        suffix of at most ``max_depth`` tokens that occurs in the index."""
        if max_tokens <= 0 or not self._count[0]:
            return NO_DRAFT
        s, m = self.match(context, hint)
        return self.draft_from(s, m, max_tokens, max_spec_factor, min_token_prob)

    def speculate_open(self, max_tokens: int, max_spec_factor: float,
                       min_token_prob: float) -> SuffixDraft:
        """:meth:`speculate` after the open sequence's last tokens (all of its suffixes occur: in it)."""
        if max_tokens <= 0:
            return NO_DRAFT
        s, hi = self._open[1], min(self._open[2], self.max_depth)
        while s and self._len[self._link[s]] >= hi:  # split since (by an added sequence)
            s = self._link[s]
        return self.draft_from(s, hi, max_tokens, max_spec_factor, min_token_prob)

    def draft_from(self, s: int, hi: int, k: int, factor: float, min_prob: float) -> SuffixDraft:
        """Best draft over the matches of length 1..hi, the longest in state ``s``."""
        key = (k, factor)
        got_lim = self._limits.get(key)
        if got_lim is None:  # per match length m: the longest draft it allows (up, then down)
            d = self.max_depth
            lim_ = [min(k, int(m * factor + 1e-6), d - m) for m in range(d + 1)]
            got_lim = self._limits[key] = (lim_, lim_.index(max(lim_)))
        lim, peak = got_lim
        nxt, link, length, count, best = self._next, self._link, self._len, self._count, self._best
        top_score, top_tokens, top_m = 0.0, None, 0
        while s > 0:
            lo = length[link[s]] + 1
            want = lim[hi] if hi <= peak else lim[lo] if lo >= peak else lim[peak]
            if want > top_score:  # a draft of `want` tokens scores at most `want`
                tokens: list[int] = []
                sums: list[float] = []
                prob, total = 1.0, 0.0
                v = s
                while len(tokens) < want:
                    b = best[v]
                    if b < 0:
                        if b == _NONE:
                            break
                        b = self._rescan(v)
                        if b < 0:
                            break
                    child = nxt[v][b]
                    prob *= count[child] / count[v]
                    if prob < min_prob:
                        break
                    tokens.append(b)
                    total += prob
                    sums.append(total)
                    v = child
                if tokens:
                    got = min(want, len(tokens))
                    if sums[got - 1] > top_score:  # the longest m of this state allowing `got`
                        m = hi
                        while lim[m] < got:
                            m -= 1
                        top_score, top_tokens, top_m = sums[got - 1], tokens[:got], m
            hi = lo - 1
            s = link[s]
        return NO_DRAFT if top_tokens is None else SuffixDraft(top_tokens, top_score, top_m)
