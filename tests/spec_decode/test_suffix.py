"""SuffixProposer / SuffixIndex: worked examples, counts against brute force, drafts against the
depth-capped trie the index replaced (a reference copy below), the two-index choice, the global
index's lifecycle (finished outputs, eviction, bounded under a long stream, incremental rebuild),
incremental per-request updates."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from tandem.config.speculative import SpeculativeConfig
from tandem.errors import ConfigError
from tandem.spec_decode.base import ProposalInput, Proposer
from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.suffix import FinishedOutputs, SuffixProposer
from tandem.spec_decode.suffix_index import SuffixDraft, SuffixIndex

DOC = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]  # the module docstring's example


def tree(*seqs: Sequence[int], depth: int = 24) -> SuffixIndex:
    """An index over ``seqs``: the first one open (appended), the others added whole."""
    t = SuffixIndex(depth)
    for i, s in enumerate(seqs):
        t.add(s) if i else t.append(s)
    return t


def spec(t: SuffixIndex, ctx: Sequence[int], k: int = 4, factor: float = 1.0, min_prob: float = 0.1):
    return t.speculate(ctx, k, factor, min_prob)


class ReferenceTrie:
    """The depth-capped suffix trie (suffix.py before the index): one node per pattern, counts and
    most frequent child (first to reach the count) updated per appended token, drafts re-walked."""

    def __init__(self, depth: int) -> None:
        self.depth, self.root, self.open = depth, self._node(), {}

    @staticmethod
    def _node() -> list:
        return [0, {}, None]  # count, children, best

    def append(self, seq: int, token: int) -> None:
        grown = []
        for node in [self.root, *self.open.get(seq, [])]:
            child = node[1].get(token)
            if child is None:
                child = node[1][token] = self._node()
            child[0] += 1
            if node[2] is None or (node[2] != token and child[0] > node[1][node[2]][0]):
                node[2] = token
            grown.append(child)
        self.root[0] += 1
        self.open[seq] = grown[: self.depth - 1]

    def speculate(self, ctx: Sequence[int], k: int, factor: float, min_prob: float) -> SuffixDraft:
        best = SuffixDraft([])
        for m in range(1, min(len(ctx), self.depth) + 1):
            node = self.root
            for t in ctx[len(ctx) - m :]:
                node = node[1].get(t)
                if node is None:
                    return best
            tokens, total, prob = [], 0.0, 1.0
            while len(tokens) < min(k, int(m * factor + 1e-6)) and node[2] is not None:
                child = node[1][node[2]]
                prob *= child[0] / node[0]
                if prob < min_prob:
                    break
                tokens.append(node[2])
                total += prob
                node = child
            if tokens and total >= best.score:
                best = SuffixDraft(tokens, total, m)
        return best


def test_docstring_example() -> None:
    t = tree(DOC)
    d = spec(t, DOC)
    assert (d.token_ids, d.score, d.match_len) == ([3, 1], 1.0, 2)
    assert t.speculate_open(4, 1.0, 0.1) == d
    d = spec(t, DOC, factor=2.0)
    assert (d.token_ids, d.score) == ([3, 1, 2, 3], 1.75)
    assert spec(t, DOC, min_prob=0.6).token_ids == []
    p = SuffixProposer(4)
    assert p.propose([ProposalInput("r", DOC, 4)]).token_ids == [[3, 1]]


def test_counts() -> None:
    t = tree(DOC)
    assert t.count([]) == t.num_tokens == len(DOC)
    assert t.count([1, 2]) == 4
    assert t.next_counts([1, 2]) == {3: 2, 4: 1}
    assert t.best_next([1, 2]) == 3
    assert t.count([4, 1, 2]) == 1 and t.next_counts([4, 1, 2]) == {} and t.best_next([4, 1, 2]) is None
    assert t.count([2, 1]) == 0 and t.next_counts([2, 1]) == {}


def test_depth_cap() -> None:
    t = tree([1, 2, 3, 4, 5, 6], depth=3)
    assert t.count([1, 2, 3]) == 1 and t.next_counts([1, 2, 3]) == {}  # depth 3: no children
    assert t.count([1, 2, 3, 4]) == 0 and t.best_next([1, 2, 3]) is None
    assert len(index_counts(t)) == 3 + 3 + 3 + 3 + 2 + 1  # patterns of at most 3 tokens from each start
    assert t.num_states <= 2 * 6  # a suffix automaton: at most 2 states per token (here 1 + 6)


def brute_counts(seqs: Sequence[Sequence[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                key = tuple(s[i:j])
                counts[key] = counts.get(key, 0) + 1
    return counts


def index_counts(t: SuffixIndex) -> dict[tuple[int, ...], int]:
    """Every pattern the index says occurs (the trie's nodes), with its count; checks that each
    pattern's most frequent next token has the highest count."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[int, ...]] = [()]
    while stack:
        path = stack.pop()
        children = t.next_counts(path)
        if children:
            assert children[t.best_next(path)] == max(children.values())
        else:
            assert t.best_next(path) is None
        for tok, c in children.items():
            assert c == t.count(path + (tok,))
            out[path + (tok,)] = c
            stack.append(path + (tok,))
    return out


def test_counts_and_removal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        depth = rng.randint(1, 6)
        vocab = rng.choice([2, 3, 5])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 15))] for _ in range(4)]
        t = SuffixIndex(depth)
        for s in seqs:
            t.add(s)
        assert index_counts(t) == brute_counts(seqs, depth)
        gone = rng.sample(range(4), 2)
        for i in gone:
            t.remove(seqs[i])
        kept = [s for i, s in enumerate(seqs) if i not in gone]
        assert index_counts(t) == brute_counts(kept, depth)
        assert t.num_tokens == sum(map(len, kept))
        t.add(seqs[gone[0]])  # counts come back (states with count 0 are reused)
        assert index_counts(t) == brute_counts([*kept, seqs[gone[0]]], depth)


def test_drafts_equal_the_reference_trie() -> None:
    """Append-only (the per-request index, and the global one before any eviction): the same drafts,
    scores and match lengths as the trie, ties between equally frequent continuations included."""
    rng = random.Random(1)
    for _ in range(300):
        depth, vocab = rng.randint(1, 8), rng.choice([2, 3, 4, 6])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 3))]
        ref, t = ReferenceTrie(depth), tree(*seqs, depth=depth)
        for i, s in enumerate(seqs):
            for tok in s:
                ref.append(i, tok)
        for tok in [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]:  # the open one grows
            ref.append(0, tok)
            t.append([tok])
            seqs[0].append(tok)
        for _ in range(6):
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
            args = (rng.randint(1, 6), rng.choice([0.5, 1.0, 2.0, 3.5]), rng.choice([0.0, 0.1, 0.3, 0.6]))
            assert t.speculate(ctx, *args) == ref.speculate(ctx, *args)
            assert t.speculate_open(*args) == ref.speculate(seqs[0][-depth:], *args)
            found = t.match(ctx)
            assert all(t.match(ctx, hint) == found for hint in range(10))  # a hint only saves work


def test_longest_pattern_wins_when_it_scores_higher() -> None:
    toks = [7, 1, 2, 9, 8, 1, 2, 5, 8, 1, 2, 5, 7, 1, 2]
    t = tree(toks)
    # "2" and "1 2" are mostly followed by 5, but "7 1 2" was followed by 9 8 1.
    # one token: "2", "1 2" → 5 and "7 1 2" → 9 all score 1/2; the tie goes to the longest
    assert spec(t, toks, k=1).token_ids == [9]
    d = spec(t, toks, k=3)
    assert (d.token_ids, d.match_len, d.score) == ([9, 8, 1], 3, 1.5)


def test_ties_go_to_the_longer_match() -> None:
    t = tree([1, 2, 3, 9, 2, 3, 9])
    d = spec(t, [5, 2, 3], k=1)  # "3" and "2 3" both continue with 9 at probability 1
    assert (d.token_ids, d.match_len) == ([9], 2)


def test_most_frequent_continuation_and_min_prob() -> None:
    toks = [4, 5, 4, 5, 4, 6, 4, 5, 4, 7, 4]
    t = tree(toks)
    # "4" occurs 6 times: followed by 5 three times, 6 once, 7 once (one occurrence ends the text).
    assert spec(t, toks, k=1).token_ids == [5]
    assert spec(t, toks, k=1, min_prob=0.5).token_ids == [5]  # 3/6 = 0.5 is not below 0.5
    assert spec(t, toks, k=1, min_prob=0.51).token_ids == []
    # the running probability multiplies: 4 → 5 (1/2) → 4 (1/2 · 3/3)
    assert spec(t, toks, k=2, factor=2.0).token_ids == [5, 4]


def test_max_spec_factor_and_caps() -> None:
    loop = [3, 8] * 10
    t = tree(loop)
    assert spec(t, [0, 8], k=8).token_ids == [3]  # match length 1: at most int(1 · 1.0) tokens
    assert spec(t, [0, 8], k=8, factor=3.0).token_ids == [3, 8, 3]
    assert spec(t, [0, 8], k=8, factor=0.5).token_ids == []  # int(0.5) = 0
    assert spec(t, loop, k=4).token_ids == [3, 8, 3, 8]  # long match: k caps
    p = SuffixProposer(3)
    assert p.propose([ProposalInput("r", loop, 8)]).token_ids == [[3, 8, 3]]  # num_speculative_tokens caps
    assert p.propose([ProposalInput("r", loop, 2)]).token_ids == [[3, 8]]
    assert p.propose([ProposalInput("r", loop, 0)]).token_ids == [[]]


def test_depth_limits_match_plus_draft() -> None:
    loop = [3, 8] * 10
    p = SuffixProposer(10, max_tree_depth=4, max_spec_factor=10.0)
    # a match of length m leaves depth - m tokens to follow: best is m = 1 (3 tokens)
    assert p.propose([ProposalInput("r", loop, 10)]).token_ids == [[3, 8, 3]]


def test_global_tree_from_finished_requests() -> None:
    p = SuffixProposer(4)
    assert p.propose([ProposalInput("a", [1, 2, 3, 10, 11, 12, 13], 4)]).token_ids == [[]]
    assert p.num_active_requests == 1
    p.forget("a", [10, 11, 12, 13])
    assert p.num_active_requests == 0 and len(p.global_tree) == 1
    # another request reaches "10 11": the cached output continues it
    assert p.propose([ProposalInput("b", [9, 9, 10, 11], 4)]).token_ids == [[12, 13]]
    # the higher score wins: "10 11" once in the request, 20 21 at 1/2 each (score 1), loses to
    # the cached 12 13 (score 2) ...
    assert p.propose([ProposalInput("c", [10, 11, 20, 21, 5, 10, 11], 4)]).token_ids == [[12, 13]]
    # ... while "20 21 10 11" three times in the request (4 tokens at 2/3) beats it
    own = [10, 11, 20, 21] * 3 + [10, 11]
    assert p.propose([ProposalInput("d", own, 4)]).token_ids == [[20, 21, 10, 11]]


def test_eviction_oldest_first_and_reused_ids() -> None:
    p = SuffixProposer(4, max_cached_requests=2)
    for rid, out in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        p.forget(rid, out)
    assert "a" not in p.global_tree and "b" in p.global_tree and "c" in p.global_tree
    assert p.propose([ProposalInput("x", [0, 1, 2], 4)]).token_ids == [[]]  # evicted
    assert p.propose([ProposalInput("y", [0, 4, 5], 4)]).token_ids == [[6]]
    p.forget("b", [5, 7, 7])  # same id again: replaces the old output, now the newest
    assert p.propose([ProposalInput("z", [0, 4, 5], 4)]).token_ids == [[7]]
    p.forget("d", [1])  # evicts c, the oldest
    assert "c" not in p.global_tree and "b" in p.global_tree
    index = p.global_tree.index
    assert index_counts(index) == brute_counts([[5, 7, 7], [1]], 24)
    for rid in ("b", "d"):
        p.global_tree.remove(rid)
    assert len(p.global_tree) == 0 and index.num_tokens == 0 and index_counts(index) == {}


def test_no_global_tree_when_cache_is_zero() -> None:
    p = SuffixProposer(4, max_cached_requests=0)
    p.forget("a", [10, 11, 12, 13])
    assert len(p.global_tree) == 0
    assert p.propose([ProposalInput("b", [10, 11], 4)]).token_ids == [[]]


def test_global_index_stays_bounded_under_a_long_stream() -> None:
    """10k finished requests through a cache of 50: at most 50 outputs, and the automaton (which
    keeps evicted outputs' states with count 0) is rebuilt alongside, so its size stays within a
    constant factor of the live tokens; the counts are always exactly the live outputs'."""
    rng = random.Random(5)
    cache = FinishedOutputs(max_depth=8, capacity=50)
    pool = [[rng.randrange(2000) for _ in range(rng.randint(1, 60))] for _ in range(300)]
    indexes, peak, rebuilding = set(), 0, 0
    for i in range(10_000):
        out = pool[rng.randrange(300)][: rng.randint(1, 60)] + [rng.randrange(2000)]  # old + new text
        cache.add(f"r{i % 7000}", out)  # ids come back after 7000 requests: replaced, not duplicated
        assert len(cache) <= 50
        index = cache.index
        indexes.add(id(index))
        rebuilding += cache.rebuilding
        assert index.num_tokens == sum(map(len, cache._seqs.values()))
        peak = max(peak, index.num_states - 6 * index.num_tokens)
        if i % 2500 == 0:
            assert index_counts(index) == brute_counts(list(cache._seqs.values()), 8)
    assert len(indexes) > 5 and rebuilding > 0  # it was rebuilt, several times
    print("peak states - 6 x live tokens", peak)
    assert peak <= 4096 + 2 * 61  # O(live tokens), never the 10k outputs' 300k tokens
    assert index_counts(cache.index) == brute_counts(list(cache._seqs.values()), 8)


def test_rebuild_keeps_exact_counts_while_outputs_come_and_go(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.spec_decode.suffix as suffix_module

    # rebuild early and slowly: a rebuild spans several adds, which replace and evict outputs
    monkeypatch.setattr(suffix_module, "_SLACK_STATES", 8)
    monkeypatch.setattr(suffix_module, "_MIN_REBUILD_TOKENS", 1)
    rng = random.Random(9)
    cache = FinishedOutputs(max_depth=5, capacity=6)
    live: dict[str, list[int]] = {}
    swaps, during = 0, 0
    for i in range(400):
        before = cache.index
        rid = f"r{rng.randrange(10)}"  # reused ids: replaced outputs during a rebuild too
        out = [rng.randrange(4) for _ in range(rng.randint(0, 20))]
        cache.add(rid, out)
        live.pop(rid, None)
        if out:
            live[rid] = out
        while len(live) > 6:
            live.pop(next(iter(live)))
        assert list(cache._seqs) == list(live)
        if cache.rebuilding:  # both indexes, the fresh one partially filled, are exact
            during += 1
            fresh = cache._fresh
            assert fresh is not None and cache._copied <= set(live)
            assert index_counts(fresh) == brute_counts([live[r] for r in cache._copied], 5)
        swaps += cache.index is not before
        assert index_counts(cache.index) == brute_counts(list(live.values()), 5)
    assert swaps > 10 and during > 30


def test_incremental_updates_equal_a_fresh_tree() -> None:
    rng = random.Random(3)
    p = SuffixProposer(5, max_tree_depth=6, max_spec_factor=2.0)
    toks: list[int] = []
    for step in range(150):
        toks += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        arg = np.array(toks, dtype=np.int32) if step % 3 == 0 else list(toks)
        got = p.propose([ProposalInput("r", arg, 5)]).token_ids[0]
        want = tree(toks, depth=6).speculate(toks[-6:], 5, 2.0, 0.1).token_ids
        assert got == want and all(type(t) is int for t in got)
    assert index_counts(p._requests["r"].index) == brute_counts([toks], 6)


def test_tokens_that_do_not_extend_rebuild_the_request_tree() -> None:
    p = SuffixProposer(4)
    assert p.propose([ProposalInput("r", [1, 2, 3, 1, 2], 4)]).token_ids == [[3, 1]]
    # same id, a history that does not extend the one seen (checked on the last token seen and on
    # the length; the engine's accepted tokens only grow): the old tree must not leak in
    assert p.propose([ProposalInput("r", [1, 2, 7, 1, 9, 1, 2], 4)]).token_ids == [[7, 1]]
    assert p.propose([ProposalInput("r", [1, 2], 4)]).token_ids == [[]]


def test_is_a_proposer_and_batch_order() -> None:
    p = SuffixProposer(3)
    assert isinstance(p, Proposer) and isinstance(NgramProposer(1, 2, 3), Proposer)
    assert not p.drafts_on_host_for_free  # no stateless shadow drafts for the gate
    out = p.propose([ProposalInput("a", [1, 2, 1], 3), ProposalInput("b", [5, 6], 3),
                     ProposalInput("c", [4, 4, 4, 4], 2)])
    assert out.token_ids == [[2], [], [4, 4]] and out.probs is None
    assert p.propose([]).token_ids == []


def test_from_config() -> None:
    c = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 6,
                                     "suffix_decoding_max_tree_depth": 12,
                                     "suffix_decoding_max_cached_requests": 5,
                                     "suffix_decoding_max_spec_factor": 2,
                                     "suffix_decoding_min_token_prob": 0.2})
    p = SuffixProposer.from_config(c)
    assert (p.num_speculative_tokens, p.max_tree_depth, p.max_cached_requests, p.max_spec_factor,
            p.min_token_prob) == (6, 12, 5, 2.0, 0.2)
    with pytest.raises(ConfigError):
        SuffixProposer.from_config(SpeculativeConfig.from_dict({"method": "ngram",
                                                                "num_speculative_tokens": 3}))


@pytest.mark.parametrize("kw,key", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"max_spec_factor": 0.0}, "suffix_decoding_max_spec_factor"),
    ({"min_token_prob": 2.0}, "suffix_decoding_min_token_prob"),
])
def test_constructor_errors(kw: dict, key: str) -> None:
    args = {"num_speculative_tokens": 3, **kw}
    k = args.pop("num_speculative_tokens")
    with pytest.raises(ConfigError) as info:
        SuffixProposer(k, **args)
    assert info.value.key == key


def test_drafts_ahead_of_assumed_tokens_leave_the_request_index_alone() -> None:
    """``propose_ahead``: the token expected after the accepted tokens + the assumed ones (a chained
    verify's drafts), then up to k drafts — k + 1 tokens whatever ``num_speculative_tokens`` caps —
    from both indexes matched against that context; the request's index takes the accepted tokens
    only, so a failed assumption costs no rebuild, and its drafts equal a lookup in an index of the
    accepted tokens alone (and of the finished outputs)."""
    rng = random.Random(5)
    p = SuffixProposer(4, max_tree_depth=8, max_spec_factor=2.0)
    p.forget("old", [9, 1, 2, 3, 4, 5, 6, 7, 8])
    toks: list[int] = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    got = p.propose_ahead("r", toks, [2, 3], 4)
    assert got == [4, 5, 6, 7, 8]  # the expected token, then the full k
    index = p._requests["r"].index
    assert p._requests["r"].num_tokens == len(toks)
    for _ in range(60):
        assumed = [rng.randrange(10) for _ in range(rng.randint(0, 4))]
        ctx = toks + assumed
        local = tree(toks, depth=8).speculate(ctx[-8:], 5, 2.0, 0.1)
        other = p.global_tree.speculate(ctx, 5, 2.0, 0.1)
        want = (other if other.score > local.score else local).token_ids
        assert p.propose_ahead("r", toks, assumed, 4) == want
        toks += [rng.randrange(10) for _ in range(rng.randint(1, 3))]  # the tokens that really came
        p.propose([ProposalInput("r", toks, 4)])
        assert p._requests["r"].index is index  # extended, never rebuilt
    assert p.propose_ahead("r", toks, [1], 0) == []
