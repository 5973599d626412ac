"""Log-probabilities returned to users (``logprobs`` / ``prompt_logprobs``), vLLM-compatible.

Values come from the *raw* model logits (before penalties, temperature and filters), vLLM's default.
Each requested position yields a dict ``token id → Logprob`` holding the chosen token (sampled, or
the next prompt token) plus the top-N tokens. Ranks are 1-based: the chosen token's rank is
1 + the number of tokens with a strictly larger logprob; top-N entries have ranks 1..N.
``decoded_token`` is left None here; the detokenizer fills it (``dataclasses.replace``).

With speculation, the rows of a verify step give the logprobs of the emitted tokens: row j for the
j-th emitted token (accepted drafts, then the recovered/bonus token) — the same raw logits that the
plain decode path would have used for that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1-based rank of this token in its position's distribution
    decoded_token: str | None = None


def compute_logprobs(
    raw_logits: torch.Tensor,
    token_ids: torch.Tensor | Sequence[int],
    num_top: Sequence[int | None],
) -> list[dict[int, Logprob] | None]:
    """Per row: None if ``num_top[i]`` is None, else {chosen token, top-num_top[i] tokens}.

    raw_logits: [N, V]; token_ids: [N] chosen token per row. One device → host transfer in total.
    """
    n = len(num_top)
    if raw_logits.dim() != 2 or raw_logits.shape[0] != n:
        raise ValueError(
            f"expected raw_logits of shape [len(num_top)={n}, vocab], got {tuple(raw_logits.shape)}"
        )
    need = [i for i, t in enumerate(num_top) if t is not None]
    result: list[dict[int, Logprob] | None] = [None] * n
    if not need:
        return result
    device = raw_logits.device
    tok = torch.as_tensor(token_ids, dtype=torch.long).to(device).reshape(-1)
    if tok.numel() != n:
        raise ValueError(f"expected {n} token ids, got {tok.numel()}")
    if len(need) < n:
        idx = torch.tensor(need, dtype=torch.long, device=device)
        logits, tok = raw_logits.index_select(0, idx), tok.index_select(0, idx)
    else:
        logits = raw_logits
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n_need, V]
    chosen = lp.gather(1, tok[:, None]).squeeze(1)  # [n_need]
    rank = (lp > chosen[:, None]).sum(dim=-1) + 1  # [n_need]
    max_top = min(max(int(num_top[i]) for i in need), lp.shape[1])  # type: ignore[arg-type]
    if max_top > 0:
        top_lp, top_ids = lp.topk(max_top, dim=-1)  # [n_need, max_top], sorted descending
        packed = torch.cat([chosen[:, None], top_lp], dim=1).tolist()
        ids = torch.cat([tok[:, None], rank[:, None], top_ids], dim=1).tolist()
    else:
        packed = chosen[:, None].tolist()
        ids = torch.stack([tok, rank], dim=1).tolist()

    for row, i in enumerate(need):
        k = min(int(num_top[i]), max_top)  # type: ignore[arg-type]
        vals, meta = packed[row], ids[row]
        entry = {meta[0]: Logprob(vals[0], meta[1])}
        for j in range(k):
            t = meta[2 + j]
            if t not in entry:
                entry[t] = Logprob(vals[1 + j], j + 1)
        result[i] = entry
    return result


def prompt_logprobs(
    logits: torch.Tensor,
    next_token_ids: torch.Tensor | Sequence[int],
    num_top: int,
    *,
    prepend_none: bool = True,
) -> list[dict[int, Logprob] | None]:
    """Prompt logprobs: logits [P-1, V] at prompt positions 0..P-2, next_token_ids = prompt[1:].

    Returns P entries, the first None (nothing predicts the first prompt token). For a later chunk
    of a chunked prefill pass ``prepend_none=False`` and the chunk's own logits/next ids.
    """
    body = compute_logprobs(logits, next_token_ids, [num_top] * logits.shape[0])
    return ([None] + body) if prepend_none else body
