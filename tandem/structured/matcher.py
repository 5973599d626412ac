"""RequestGrammar: one request's position in its grammar, advanced only by accepted tokens.

Speculation never moves the committed state: drafts are explored tentatively and rolled back.

- ``accept(token)``: commit an emitted token (the output processor, in output order). False if the
  grammar refuses it (the state is then unchanged).
- ``validate(drafts)``: the longest draft prefix the grammar accepts, ending at the first token that
  terminates it (a stop token); the state is rolled back. Drafts are cut to it before verification.
  Drafts sampled from a draft distribution q keep their first refused token (``keep_refused``): the
  verifier rejects it (p = 0) and samples the recovered token from norm(max(p − q, 0)); dropping it
  would sample from p instead, which is not the target's distribution given the draft was sampled.
  Deterministic drafts (one-hot q) lose nothing by the cut: the recovered token would come from p.
- ``fill_masks(drafts, bitmask, row)``: the k + 1 token masks of a verify of k drafts — mask j assumes
  drafts 0..j-1 were accepted (the only case in which row j's token is used) — by accepting drafts
  tentatively and rolling back. Rows after a draft the grammar refuses, or after one that terminates
  it, are never used (the verifier rejects that draft, or the request stops at it) and are left
  all-allowed.
- ``is_terminated``: a stop token was accepted — the output is complete.

EOS is allowed by a mask only where the grammar can end (xgrammar's stop tokens are the engine's EOS
ids), so a request ends exactly when its output matches. Other special tokens are never allowed:
xgrammar may read a tokenizer's ``<|im_start|>`` as text, but the detokenizer drops it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class RequestGrammar:
    def __init__(self, compiled: Any, vocab_size: int, special: frozenset[int] = frozenset(),
                 keep: torch.Tensor | None = None) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size  # bitmask width in tokens (model logits width or more)
        self._special = special  # ids no grammar accepts (special tokens other than the stop tokens)
        self._keep = keep  # int32 bitmask row with those ids cleared (ANDed into every filled mask)
        self.num_accepted = 0

    def _refuses(self, token: int) -> bool:
        """Refused without asking the matcher (xgrammar logs a warning per special token it is offered)."""
        return not 0 <= token < self.vocab_size or token in self._special

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def accept(self, token: int) -> bool:
        if self._matcher.is_terminated() or self._refuses(token):
            return False
        ok = bool(self._matcher.accept_token(int(token)))
        self.num_accepted += ok
        return ok

    def validate(self, drafts: Sequence[int], keep_refused: bool = False) -> list[int]:
        """The grammar-valid prefix of ``drafts`` (state unchanged); with ``keep_refused``, plus the
        first refused token, if any (see ``Speculator.drafts_for``: sampled drafts)."""
        m = self._matcher
        n = 0
        keep = 0
        for t in drafts:
            if m.is_terminated():
                break
            if self._refuses(int(t)) or not m.accept_token(int(t)):
                keep = int(keep_refused)
                break
            n += 1
        if n:
            m.rollback(n)
        return [int(t) for t in drafts[:n + keep]]

    def fill_masks(self, drafts: Sequence[int], bitmask: Any, row: int) -> None:
        """Rows ``row .. row + len(drafts)`` of ``bitmask`` (int32 [rows, words]): the verify masks."""
        m = self._matcher
        advanced = 0
        live = True
        for j in range(len(drafts) + 1):
            if live and not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, row + j)
                if self._keep is not None:
                    bitmask[row + j, :self._keep.shape[0]] &= self._keep
            else:
                bitmask[row + j].fill_(-1)  # never used: all allowed
                live = False
            if j < len(drafts) and live:
                t = int(drafts[j])
                if m.is_terminated() or self._refuses(t) or not m.accept_token(t):
                    live = False
                else:
                    advanced += 1
        if advanced:
            m.rollback(advanced)
