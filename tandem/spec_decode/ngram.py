"""N-gram (prompt-lookup) proposer: draft by copying what followed the same n-gram earlier.

No model, no probabilities (the rejection sampler treats each draft as one-hot q). For each request:

1. Take the sequence's last n tokens (its suffix) for n = ``prompt_lookup_max`` down to
   ``prompt_lookup_min`` and keep the longest n that also occurs earlier in the sequence (an
   earlier occurrence may overlap the suffix, but is never the suffix itself).
2. Among the earlier occurrences of that n-gram pick one (see "Which occurrence" below).
3. Propose the tokens that followed it, at most ``min(num_tokens, num_speculative_tokens)``; fewer
   when the sequence ends first; none when no n-gram of length >= ``prompt_lookup_min`` recurs.

Worked example (min = 1, max = 3, k = 3)::

    position  0  1  2  3  4  5  6  7  8  9 10
    token     5  6  7  8  9  5  6  7  2  6  7

    suffix of length 3: [2, 6, 7]  → never occurred earlier
    suffix of length 2: [6, 7]     → occurs ending at positions 2 and 7 (exclusive ends 3 and 8)
    → n = 2; the most recent occurrence with 3 tokens after it is the one ending at 7:
      tokens 8..10 = [2, 6, 7] → draft [2, 6, 7]
    (vLLM's choice, the earliest occurrence, would draft [8, 9, 5].)

Which occurrence. vLLM (``vllm/v1/spec_decode/ngram_proposer.py``) takes the *earliest* occurrence
of the longest n-gram. tandem's default, ``match="recent"``, takes the *most recent* occurrence that
still has ``k`` tokens after it, and falls back to the earliest (which has the most tokens after it)
when none has: recent context predicts the continuation better (edited code, a list being
rewritten), and the "k tokens after it" rule keeps short-period loops (``a a a a``, where the most
recent occurrence is one token back) drafting k tokens instead of 1. ``match="first"`` reproduces
vLLM's choice for like-for-like comparisons.

Cost. Candidate end positions are the earlier occurrences of the last token; each longer n only
filters the surviving candidates (O(max_n · matches)). Two implementations of the same lookup, by
input type: a numpy array goes through one vectorised comparison (``find_ngram_draft``, a view, no
copy), a Python list — what the engine holds — through ``list.index`` scans in C
(``find_ngram_draft_list``), which skips the list → array conversion that dominated the numpy path
(SmolLM2 code tokens, 2-core VM: 2.5 / 4.5 / 12 / 36 µs at 100 / 300 / 1k / 3k tokens against
9 / 12 / 24 / 56 µs) and, inside the decode loop, numpy's per-call cost after a forward has run
(a 92-token shadow lookup 12–14 µs against 67–90 µs; docs/performance.md §38).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from tandem.errors import ConfigError
from tandem.spec_decode.base import DraftProposal, ProposalInput
from tandem.config.speculative import SpeculativeConfig

MATCH_CHOICES: tuple[str, ...] = ("recent", "first")

_EMPTY = np.empty(0, dtype=np.int64)


def find_ngram_draft(
    tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int, match: str = "recent"
) -> np.ndarray:
    """Draft tokens for one sequence ``tokens`` ([seq_len] int array); see the module docstring.

    Returns a view into ``tokens`` of length <= ``num_tokens`` (empty when nothing matches).
    """
    seq_len = tokens.shape[0]
    if num_tokens <= 0 or seq_len < min_n + 1:
        return _EMPTY
    # ends: exclusive end positions e of earlier occurrences of the current length-n suffix, i.e.
    # tokens[e - n:e] == tokens[seq_len - n:]. e <= seq_len - 1 excludes the suffix itself and
    # guarantees at least one token after every occurrence.
    ends = np.flatnonzero(tokens[: seq_len - 1] == tokens[seq_len - 1]) + 1  # n = 1
    best = ends if min_n <= 1 else _EMPTY
    for n in range(2, max_n + 1):
        if ends.size == 0:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[seq_len - n]]
        if n >= min_n and ends.size:
            best = ends
    if best.size == 0:
        return _EMPTY
    if match == "first":
        end = int(best[0])
    else:
        # best is ascending: the last end leaving num_tokens tokens after it, else the earliest.
        idx = int(np.searchsorted(best, seq_len - num_tokens, side="right")) - 1
        end = int(best[idx]) if idx >= 0 else int(best[0])
    return tokens[end : end + num_tokens]


def find_ngram_draft_list(
    tokens: Sequence[int], min_n: int, max_n: int, num_tokens: int, match: str = "recent"
) -> list[int]:
    """``find_ngram_draft`` for a Python list (or tuple) of token ids: the same draft, as a list."""
    seq_len = len(tokens)
    if num_tokens <= 0 or seq_len < min_n + 1:
        return []
    last, index, stop = tokens[-1], tokens.index, seq_len - 1
    ends: list[int] = []  # as in find_ngram_draft: exclusive ends of earlier occurrences, ascending
    i = -1
    try:
        while True:
            i = index(last, i + 1, stop)
            ends.append(i + 1)
    except ValueError:
        pass
    best = ends if min_n <= 1 else []
    for n in range(2, max_n + 1):
        if not ends:
            break
        want = tokens[seq_len - n]
        ends = [e for e in ends if e >= n and tokens[e - n] == want]
        if n >= min_n and ends:
            best = ends
    if not best:
        return []
    if match == "first":
        end = best[0]
    else:
        idx = bisect_right(best, seq_len - num_tokens) - 1
        end = best[idx] if idx >= 0 else best[0]
    return list(tokens[end : end + num_tokens])


def _lookup(token_ids: Sequence[int], min_n: int, max_n: int, num_tokens: int, match: str) -> list[int]:
    """The draft as a list, by the implementation that fits the input (module docstring, "Cost")."""
    if isinstance(token_ids, np.ndarray):
        return find_ngram_draft(_as_array(token_ids), min_n, max_n, num_tokens, match).tolist()
    if not isinstance(token_ids, (list, tuple)):
        token_ids = list(token_ids)
    return find_ngram_draft_list(token_ids, min_n, max_n, num_tokens, match)


def _as_array(token_ids: Sequence[int]) -> np.ndarray:
    if isinstance(token_ids, np.ndarray):
        return token_ids if token_ids.ndim == 1 else token_ids.reshape(-1)
    return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))


class NgramProposer:
    """Prompt-lookup drafts; implements :class:`tandem.spec_decode.base.Proposer`. Stateless."""

    drafts_on_host_for_free = True  # a vectorised lookup over the request's tokens

    def __init__(
        self,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        num_speculative_tokens: int,
        *,
        match: str = "recent",
    ) -> None:
        for key, value in (
            ("prompt_lookup_min", prompt_lookup_min),
            ("prompt_lookup_max", prompt_lookup_max),
            ("num_speculative_tokens", num_speculative_tokens),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(key, f"must be an integer >= 1, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ConfigError(
                "prompt_lookup_min",
                f"prompt_lookup_min ({prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({prompt_lookup_max})",
            )
        if match not in MATCH_CHOICES:
            raise ConfigError("match", f"unknown value {match!r}", allowed=MATCH_CHOICES)
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens
        self.match = match

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, *, match: str = "recent") -> NgramProposer:
        if cfg.method != "ngram" or cfg.prompt_lookup_min is None or cfg.prompt_lookup_max is None:
            raise ConfigError("method", f"expected method 'ngram', got {cfg.method!r}", ["ngram"])
        return cls(
            cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens, match=match
        )

    def propose_one(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        k = min(num_tokens, self.num_speculative_tokens)
        if k <= 0:
            return []
        return _lookup(token_ids, self.prompt_lookup_min, self.prompt_lookup_max, k, self.match)

    def propose(self, requests: Sequence[ProposalInput]) -> DraftProposal:
        return DraftProposal(
            token_ids=[self.propose_one(r.token_ids, r.num_tokens) for r in requests]
        )

    def propose_ahead(self, request_id: str, token_ids: Sequence[int], assumed: Sequence[int],
                      num_tokens: int) -> list[int]:
        """The token expected after ``token_ids`` + ``assumed`` (a chained verify's drafts, assumed
        accepted), then up to ``min(num_tokens, num_speculative_tokens)`` drafts after it: one
        lookup of that many tokens + 1 (``base.py``)."""
        k = min(num_tokens, self.num_speculative_tokens)
        if k <= 0:
            return []
        if len(assumed):
            token_ids = (np.concatenate([token_ids, np.asarray(assumed, dtype=token_ids.dtype)])
                         if isinstance(token_ids, np.ndarray) else [*token_ids, *assumed])
        return _lookup(token_ids, self.prompt_lookup_min, self.prompt_lookup_max, k + 1, self.match)

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """Stateless: nothing to forget."""
