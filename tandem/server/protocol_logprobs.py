"""Logprobs in OpenAI's shapes: token ids → token text (``TokenText``), legacy-completions and chat logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.sample.logprobs import Logprob
from tandem.server.protocol import ChatChoiceLogprobs, ChatLogprobEntry, ChatTopLogprob, CompletionLogprobs


class TokenText:
    """Token id → the token's text as OpenAI reports it in logprobs (decoded alone), cached."""

    def __init__(self, tokenizer: Any, cache_size: int = 1 << 16) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._cache_size = cache_size

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[token_id] = text
        return text


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None],
                        num_top: int, text: TokenText, initial_offset: int = 0) -> CompletionLogprobs:
    """Legacy-completions logprobs for ``token_ids``; an entry of None (first prompt token) → nulls."""
    out = CompletionLogprobs()
    offset = initial_offset
    for tid, entry in zip(token_ids, entries, strict=False):  # entries may be shorter (none)
        tok = text(tid)
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(tok)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        chosen = entry.get(tid)
        out.token_logprobs.append(max(chosen.logprob, -9999.0) if chosen else None)
        top = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= num_top or t == tid))
        out.top_logprobs.append({text(t): max(lp, -9999.0) for _, t, lp in top})
    return out


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], num_top: int,
                  text: TokenText) -> ChatChoiceLogprobs:
    """Chat logprobs (``{"content": [...]}``) for generated ``token_ids``."""
    content: list[ChatLogprobEntry] = []
    for tid, entry in zip(token_ids, entries, strict=False):  # entries may be shorter (none)
        tok = text(tid)
        chosen = entry.get(tid) if entry else None
        tops = []
        if entry and num_top > 0:
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= num_top)
            tops = [ChatTopLogprob(token=text(t), logprob=max(lp, -9999.0), bytes=list(text(t).encode()))
                    for _, t, lp in ranked[:num_top]]
        content.append(ChatLogprobEntry(token=tok, logprob=max(chosen.logprob, -9999.0) if chosen else -9999.0,
                                        bytes=list(tok.encode()), top_logprobs=tops))
    return ChatChoiceLogprobs(content=content)
