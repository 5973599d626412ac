"""NgramProposer: worked examples, a brute-force reference, and a cost check."""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Sequence

import numpy as np
import pytest

from tandem.errors import ConfigError
from tandem.spec_decode.base import DraftProposal, ProposalInput, Proposer
from tandem.config.speculative import SpeculativeConfig
from tandem.spec_decode.ngram import NgramProposer, find_ngram_draft


def propose(tokens: Sequence[int], lo: int, hi: int, k: int, num_tokens: int | None = None,
            match: str = "recent") -> list[int]:
    p = NgramProposer(lo, hi, k, match=match)
    out = p.propose([ProposalInput("r", tokens, k if num_tokens is None else num_tokens)])
    assert isinstance(out, DraftProposal) and out.probs is None and len(out.token_ids) == 1
    return out.token_ids[0]


def reference(tokens: Sequence[int], lo: int, hi: int, k: int, match: str = "recent") -> list[int]:
    """Brute force: try n = hi..lo, list every earlier occurrence, pick per ``match``."""
    t = list(tokens)
    size = len(t)
    if k <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        if n >= size:
            continue
        suffix = t[size - n:]
        ends = [e for e in range(n, size) if t[e - n:e] == suffix]
        if not ends:
            continue
        if match == "first":
            end = ends[0]
        else:
            full = [e for e in ends if size - e >= k]
            end = full[-1] if full else ends[0]
        return t[end:end + k]
    return []


def test_is_a_proposer() -> None:
    assert isinstance(NgramProposer(1, 3, 4), Proposer)


def test_docstring_example() -> None:
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 2, 6, 7]
    assert propose(tokens, 1, 3, 3) == [2, 6, 7]
    assert propose(tokens, 1, 3, 3, match="first") == [8, 9, 5]  # vLLM's choice


def test_longest_match_preferred() -> None:
    # [3] alone recurs right before "9"; the 2-gram [2, 3] recurs before "7".
    tokens = [1, 2, 3, 7, 3, 9, 4, 2, 3]
    assert propose(tokens, 1, 3, 1) == [7]
    # Capping max at 1 falls back to the most recent single-token match.
    assert propose(tokens, 1, 1, 1) == [9]


def test_min_honoured() -> None:
    tokens = [1, 2, 3, 7, 3, 9, 4, 2, 3]  # the longest recurring suffix has length 2
    assert propose(tokens, 2, 4, 2) == [7, 3]
    assert propose(tokens, 3, 4, 2) == []


def test_max_honoured() -> None:
    # Suffix [1, 2, 3, 4] recurs once (→ 50); the shorter [3, 4] recurs more recently (→ 60).
    tokens = [1, 2, 3, 4, 50, 9, 3, 4, 60, 8, 1, 2, 3, 4]
    assert propose(tokens, 1, 4, 1) == [50]
    assert propose(tokens, 1, 2, 1) == [60]


def test_most_recent_occurrence() -> None:
    tokens = [4, 5, 10, 4, 5, 20, 4, 5, 30, 0, 4, 5]
    assert propose(tokens, 2, 2, 1) == [30]
    assert propose(tokens, 2, 2, 1, match="first") == [10]


def test_recent_needs_room_for_k_else_earliest() -> None:
    tokens = [4, 5, 10, 11, 12, 4, 5, 20, 4, 5]
    # k = 2: the most recent occurrence (→ 20, 4, 5) has room.
    assert propose(tokens, 2, 2, 2) == [20, 4]
    # k = 4: only the earliest occurrence has 4 tokens after it.
    assert propose(tokens, 2, 2, 4) == [10, 11, 12, 4]


def test_short_period_loop_drafts_k_tokens() -> None:
    assert propose([7] * 10, 1, 3, 4) == [7, 7, 7, 7]
    assert propose([1, 2] * 6, 1, 3, 5) == [1, 2, 1, 2, 1]


def test_proposes_fewer_at_end() -> None:
    tokens = [1, 2, 3, 4, 1, 2]
    assert propose(tokens, 1, 2, 5) == [3, 4, 1, 2]
    assert propose([8, 9, 8], 1, 2, 4) == [9, 8]


def test_no_match_is_empty() -> None:
    assert propose([1, 2, 3, 4, 5], 1, 3, 4) == []
    assert propose([], 1, 3, 4) == []
    assert propose([1], 1, 3, 4) == []


def test_num_tokens_zero_or_capped() -> None:
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert propose(tokens, 1, 3, 4, num_tokens=0) == []
    assert propose(tokens, 1, 3, 4, num_tokens=2) == [3, 4]
    # num_tokens above the configured k is capped at k.
    assert propose(tokens, 1, 3, 2, num_tokens=5) == [3, 4]


def test_batch_keeps_order_and_accepts_numpy() -> None:
    p = NgramProposer(1, 3, 3)
    reqs = [
        ProposalInput("a", [1, 2, 3, 1, 2], 3),
        ProposalInput("b", [9, 8, 7], 3),
        ProposalInput("c", np.array([5, 6, 5, 6], dtype=np.int32), 2),
        ProposalInput("d", (4, 4, 4), 0),
    ]
    out = p.propose(reqs)
    assert out.token_ids == [[3, 1, 2], [], [5, 6], []]
    assert all(type(t) is int for row in out.token_ids for t in row)
    assert out.num_draft_tokens == 5
    assert p.propose([]).token_ids == []


def test_from_config() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    p = NgramProposer.from_config(c)
    assert (p.prompt_lookup_min, p.prompt_lookup_max, p.num_speculative_tokens) == (2, 4, 3)
    with pytest.raises(ConfigError):
        NgramProposer.from_config(SpeculativeConfig.from_dict({"model": "d",
                                                               "num_speculative_tokens": 3}))


@pytest.mark.parametrize(
    "args,key",
    [((0, 2, 3), "prompt_lookup_min"), ((3, 2, 3), "prompt_lookup_min"),
     ((1, 2, 0), "num_speculative_tokens"), ((1, True, 3), "prompt_lookup_max")],
)
def test_constructor_errors(args: tuple[int, int, int], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        NgramProposer(*args)
    assert info.value.key == key


def test_bad_match_choice() -> None:
    with pytest.raises(ConfigError) as info:
        NgramProposer(1, 2, 3, match="last")
    assert info.value.key == "match"


@pytest.mark.parametrize("match", ["recent", "first"])
def test_random_against_reference(match: str) -> None:
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        size = rng.randint(0, 40)
        tokens = [rng.randrange(vocab) for _ in range(size)]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        num_tokens = rng.randint(0, 7)
        want = reference(tokens, lo, hi, min(k, num_tokens), match)
        got = propose(tokens, lo, hi, k, num_tokens=num_tokens, match=match)
        assert got == want, (tokens, lo, hi, k, num_tokens)


def test_find_ngram_draft_returns_view() -> None:
    tokens = np.array([1, 2, 3, 1, 2], dtype=np.int64)
    draft = find_ngram_draft(tokens, 1, 3, 2)
    assert draft.tolist() == [3, 1] and np.shares_memory(draft, tokens)


def test_cost_16_requests_4096_tokens() -> None:
    rng = np.random.default_rng(0)
    # Natural-ish text: mostly random ids with repeated spans so matches exist.
    requests = []
    for i in range(16):
        base = rng.integers(0, 32000, size=4096)
        base[2048:2548] = base[100:600]
        base[-3:] = base[200:203]
        requests.append(ProposalInput(f"r{i}", base.tolist(), 5))
    p = NgramProposer(1, 5, 5)
    p.propose(requests)  # warm-up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        out = p.propose(requests)
        best = min(best, time.perf_counter() - start)
    print(f"\nngram propose: 16 requests x 4096 tokens (python lists) in {best * 1e3:.2f} ms")
    assert all(len(t) == 5 for t in out.token_ids)
    assert best < 0.020


def test_propose_ahead_asks_one_token_more_than_k() -> None:
    """``propose_ahead``: the token expected after tokens + assumed drafts, then up to k drafts —
    one lookup of k + 1 tokens over the concatenation, past ``num_speculative_tokens``' cap."""
    p = NgramProposer(1, 3, 4)
    toks = np.array([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 9, 1], dtype=np.int64)
    assert p.propose_ahead("r", toks, [2, 5], 4) == [6, 7, 8, 9, 1]
    assert p.propose_ahead("r", list(toks), [2, 5], 2) == [6, 7, 8]
    assert p.propose_ahead("r", toks, [], 9) == find_ngram_draft(toks, 1, 3, 5).tolist()
    assert p.propose_ahead("r", toks, [3], 0) == []


@pytest.mark.parametrize("match", ["recent", "first"])
def test_list_and_array_lookups_agree(match: str) -> None:
    """The two implementations (numpy arrays: a vectorised comparison; lists: ``list.index`` scans)
    give the same draft on random sequences, and a tuple or any other sequence takes the list path."""
    from tandem.spec_decode.ngram import find_ngram_draft_list

    rng = random.Random(1)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randint(0, 60))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        n = rng.randint(0, 7)
        want = find_ngram_draft(np.array(tokens, dtype=np.int64), lo, hi, n, match).tolist()
        assert find_ngram_draft_list(tokens, lo, hi, n, match) == want
        assert find_ngram_draft_list(tuple(tokens), lo, hi, n, match) == want
    p = NgramProposer(1, 3, 4, match=match)
    toks = [5, 6, 7, 8, 5, 6]
    want = p.propose_one(np.array(toks), 4)
    assert want == [7, 8, 5, 6]
    assert p.propose_one(toks, 4) == p.propose_one(tuple(toks), 4) == p.propose_one(collections.deque(toks), 4) == want
