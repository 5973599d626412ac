"""SuffixProposer / SuffixTree: worked examples, counts against brute force, the two-tree choice,
the global tree's lifecycle (finished outputs, eviction), incremental per-request updates."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from tandem.config.speculative import SpeculativeConfig
from tandem.errors import ConfigError
from tandem.spec_decode.base import ProposalInput, Proposer
from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.suffix import SuffixProposer, SuffixTree, _Node

DOC = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]  # the module docstring's example


def tree(*seqs: Sequence[int], depth: int = 24) -> SuffixTree:
    t = SuffixTree(depth)
    for i, s in enumerate(seqs):
        t.extend(i, s)
    return t


def spec(t: SuffixTree, ctx: Sequence[int], k: int = 4, factor: float = 1.0, min_prob: float = 0.1):
    return t.speculate(ctx, k, factor, min_prob)


def test_docstring_example() -> None:
    t = tree(DOC)
    d = spec(t, DOC)
    assert (d.token_ids, d.score, d.match_len) == ([3, 1], 1.0, 2)
    d = spec(t, DOC, factor=2.0)
    assert (d.token_ids, d.score) == ([3, 1, 2, 3], 1.75)
    assert spec(t, DOC, min_prob=0.6).token_ids == []
    p = SuffixProposer(4)
    assert p.propose([ProposalInput("r", DOC, 4)]).token_ids == [[3, 1]]


def test_counts() -> None:
    t = tree(DOC)
    assert t.root.count == len(DOC)
    n12 = t.match([1, 2])
    assert n12 is not None and n12.count == 4
    assert {tok: c.count for tok, c in n12.children.items()} == {3: 2, 4: 1}
    assert n12.best == 3
    assert t.match([4, 1, 2]).count == 1 and t.match([4, 1, 2]).children == {}
    assert t.match([2, 1]) is None


def test_depth_cap() -> None:
    t = tree([1, 2, 3, 4, 5, 6], depth=3)
    assert t.match([1, 2, 3]) is not None and t.match([1, 2, 3]).children == {}
    assert t.match([1, 2, 3, 4]) is None
    assert t.num_nodes == 3 + 3 + 3 + 3 + 2 + 1  # paths of at most 3 tokens from each start


def brute_counts(seqs: Sequence[Sequence[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                key = tuple(s[i:j])
                counts[key] = counts.get(key, 0) + 1
    return counts


def tree_counts(t: SuffixTree) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}

    def walk(node: _Node, path: tuple[int, ...]) -> None:
        if node.children:
            top = max(c.count for c in node.children.values())
            assert node.best is not None and node.children[node.best].count == top
        else:
            assert node.best is None
        for tok, child in node.children.items():
            out[path + (tok,)] = child.count
            walk(child, path + (tok,))

    walk(t.root, ())
    assert len(out) == t.num_nodes
    return out


def test_counts_and_removal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        depth = rng.randint(1, 6)
        vocab = rng.choice([2, 3, 5])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 15))] for _ in range(4)]
        t = tree(*seqs, depth=depth)
        assert tree_counts(t) == brute_counts(seqs, depth)
        gone = rng.sample(range(4), 2)
        for i in gone:
            t.remove(i)
        kept = [s for i, s in enumerate(seqs) if i not in gone]
        assert tree_counts(t) == brute_counts(kept, depth)
        assert t.root.count == sum(map(len, kept)) and len(t) == sum(1 for s in kept if s)


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
    empty_nodes = p.global_tree.num_nodes
    for rid, out in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        p.forget(rid, out)
    assert "a" not in p.global_tree and "b" in p.global_tree and "c" in p.global_tree
    assert p.propose([ProposalInput("x", [0, 1, 2], 4)]).token_ids == [[]]  # evicted
    assert p.propose([ProposalInput("y", [0, 4, 5], 4)]).token_ids == [[6]]
    p.forget("b", [5, 7, 7])  # same id again: replaces the old output, now the newest
    assert p.propose([ProposalInput("z", [0, 4, 5], 4)]).token_ids == [[7]]
    p.forget("d", [1])  # evicts c, the oldest
    assert "c" not in p.global_tree and "b" in p.global_tree
    for rid in ("b", "d"):
        p.global_tree.remove(rid)
    assert p.global_tree.num_nodes == empty_nodes and p.global_tree.root.children == {}


def test_no_global_tree_when_cache_is_zero() -> None:
    p = SuffixProposer(4, max_cached_requests=0)
    p.forget("a", [10, 11, 12, 13])
    assert len(p.global_tree) == 0
    assert p.propose([ProposalInput("b", [10, 11], 4)]).token_ids == [[]]


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
    assert tree_counts(p._requests["r"].tree) == brute_counts([toks], 6)


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
