"""GrammarCompilerCache: constraints compiled against the model's vocabulary once, shared by requests.

The vocabulary comes from the HF tokenizer (``xgrammar.TokenizerInfo.from_huggingface``) with the
model's logits width as its size — a model's embedding table may be wider than the tokenizer's
vocabulary; the extra ids are never allowed — and the engine's EOS ids as the stop tokens (the only
tokens that end a grammar); the tokenizer's other special tokens are banned from every mask. Compiled
grammars are kept in an LRU keyed by the constraint's canonical ``key``, so twenty requests with one
schema compile it once. Built lazily: an engine that never sees a
structured request never builds the tokenizer info.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from tandem.errors import SamplingParamsError
from tandem.structured.matcher import RequestGrammar
from tandem.structured.params import StructuredOutputsParams, _xgrammar_message


class GrammarCompilerCache:
    def __init__(self, tokenizer_info: Any, max_cached: int = 256, special_token_ids: Sequence[int] = ()) -> None:
        """``special_token_ids``: further ids no grammar may produce (the tokenizer's special tokens, which
        xgrammar may take for text: ``<|im_start|>`` would otherwise match a JSON string's characters)."""
        import xgrammar

        self.info = tokenizer_info
        self.vocab_size = int(tokenizer_info.vocab_size)
        stop = frozenset(int(t) for t in tokenizer_info.stop_token_ids)
        self.special = frozenset(int(t) for t in (*tokenizer_info.special_token_ids, *special_token_ids)) - stop
        self.keep = _keep_mask(self.vocab_size, self.special)
        self._compiler = xgrammar.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self.max_cached = max_cached
        self.num_compiled = 0  # compilations done (cache misses)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarCompilerCache:
        """The cache for an HF tokenizer and a model whose logits are ``vocab_size`` wide."""
        import xgrammar

        size = max(int(vocab_size), len(tokenizer))
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size,
                                                       stop_token_ids=sorted(set(stop_token_ids)) or None)
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        special |= {int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                    if getattr(t, "special", False)}
        return cls(info, special_token_ids=sorted(special))

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (cached)."""
        key = spec.key
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        grammar = spec.to_grammar()
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise SamplingParamsError(f"structured_outputs.{spec.kind}", _xgrammar_message(e)) from None
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh per-request matcher for ``spec``."""
        return RequestGrammar(self.compile(spec), self.vocab_size, self.special, self.keep)


def _keep_mask(vocab_size: int, banned: frozenset[int]) -> torch.Tensor | None:
    """An int32 bitmask row with the bits of ``banned`` cleared (None when nothing is banned)."""
    ids = [t for t in banned if 0 <= t < vocab_size]
    if not ids:
        return None
    words = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int64)
    for t in ids:
        words[t // 32] &= ~(1 << (t % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement int32
