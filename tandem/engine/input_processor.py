"""Input processor: a user's prompt and SamplingParams become validated engine Requests.

The prompt is tokenized (or taken as token ids; without a tokenizer, ``skip_tokenizer_init``, only
token ids are accepted); a request that cannot be served — empty prompt, ids
outside the vocabulary, no room to generate within ``max_model_len``, a ``logit_bias`` outside the
vocabulary — raises a ``RequestError`` (or a subclass) for that request only. ``n > 1`` fans out
into n child Requests ``<id>#i``, child i seeded with ``seed + i`` when a seed is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


from tandem.engine.output_processor import NewRequest
from tandem.errors import PromptTooLongError, RequestError
from tandem.request import Request
from tandem.sample.logits import validate_for_vocab
from tandem.sample.seeded import SeededStream
from tandem.sampling_params import SamplingParams

NO_TOKENIZER_MESSAGE = ("text prompts need the tokenizer, which skip_tokenizer_init=True did not load; "
                        "pass token ids ({'prompt_token_ids': [...]} or a list of ints)")


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammars: Any = None  # structured/compiler.GrammarCompilerCache, built on first use

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(NO_TOKENIZER_MESSAGE, param="prompt")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def process(self, request_id: str, prompt: str | Sequence[int] | None, params: SamplingParams,
                prompt_token_ids: Sequence[int] | None = None) -> NewRequest:
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.encode(prompt)
            elif prompt is not None:
                prompt_token_ids = prompt
            else:
                raise RequestError("a prompt or prompt_token_ids is required", param="prompt")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        validate_for_vocab(params, self.vocab_size)
        if self.tokenizer is None and params.stop:
            raise RequestError("stop strings need the tokenizer, which skip_tokenizer_init=True did not load; "
                               "use stop_token_ids", param="stop")
        grammars = self._grammar_compiler(params)
        children = []
        for i in range(params.n):
            gen = None if params.seed is None else SeededStream(params.seed + i)
            children.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(ids), params=params, eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len, prompt=text, generator=gen,
                grammar=grammars.matcher(params.structured_outputs) if grammars is not None else None,
            ))
        return NewRequest(request_id, text, ids, tuple(children))

    def _grammar_compiler(self, params: SamplingParams) -> Any:
        """The compiler cache when ``params`` asks for structured output (compiling it now, so a bad
        constraint fails here); None otherwise."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise RequestError("structured output needs the tokenizer, which skip_tokenizer_init=True did not load",
                               param="structured_outputs")
        if self.grammars is None:
            from tandem.structured.compiler import GrammarCompilerCache

            self.grammars = GrammarCompilerCache.from_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.grammars.compile(params.structured_outputs)
        return self.grammars
