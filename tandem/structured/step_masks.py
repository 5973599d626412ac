"""The token bitmask of one step's sampled rows that have a grammar.

The executor lays out a step's sampled rows request by request (k + 1 rows for a verify of k drafts);
``step_bitmask`` builds the masks of the rows that belong to structured requests and returns them with
their row indices in that layout, so the masks can never be applied to another request's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.structured.matcher import RequestGrammar


def step_bitmask(items: Sequence[tuple[RequestGrammar | None, Sequence[int]]]
                 ) -> tuple[torch.Tensor, list[int]] | None:
    """For each sampling request in step order (its grammar or None, its drafts): the int32 bitmask
    [structured rows, ceil(V / 32)] and the step-row index of each bitmask row; None without grammars."""
    rows: list[int] = []
    spans: list[tuple[RequestGrammar, Sequence[int], int]] = []
    base = 0
    vocab = 0
    for grammar, drafts in items:
        n = len(drafts) + 1
        if grammar is not None:
            spans.append((grammar, drafts, len(rows)))
            rows.extend(range(base, base + n))
            vocab = max(vocab, grammar.vocab_size)
        base += n
    if not spans:
        return None
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    for grammar, drafts, first in spans:
        grammar.fill_masks(drafts, bitmask, first)
    return bitmask, rows
