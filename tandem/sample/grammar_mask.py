"""Apply grammar token bitmasks to a step's processed logits (structured output).

A bitmask row is xgrammar's packed form: bit ``t % 32`` of int32 word ``t // 32`` is set iff token t
is allowed. Disallowed tokens get −inf, after every other logits processor, so the target
distribution p of a structured row is zero outside the grammar: the plain sampler never draws such a
token and the rejection sampler rejects a draft that is one (p = 0), whatever the drafter proposed.

If a row has no allowed token left after the other processors (``min_tokens`` banning the EOS the
grammar requires), the grammar wins: the row is masked from the raw logits instead.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, words] int32 → [n, vocab] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab:  # a bitmask narrower than the logits: the extra ids are not allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed[:, :vocab]


def apply_grammar_bitmask(processed: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor,
                          rows: list[int]) -> torch.Tensor:
    """``processed`` with the rows ``rows`` masked by ``bitmask`` (a new tensor; inputs unchanged)."""
    vocab = processed.shape[1]
    allowed = unpack_bitmask(bitmask.to(processed.device, non_blocking=True), vocab)  # packed: 32x less to copy
    idx = torch.tensor(rows, dtype=torch.long, device=processed.device)
    sub = processed.index_select(0, idx).float().masked_fill(~allowed, float("-inf"))
    dead = sub.amax(dim=-1) == float("-inf")
    if bool(dead.any()):
        fallback = raw.index_select(0, idx).float().masked_fill(~allowed, float("-inf"))
        sub = torch.where(dead[:, None], fallback, sub)
    out = processed.to(torch.float32, copy=True)
    return out.index_copy_(0, idx, sub)
