"""LLM: the offline, vLLM-shaped Python API (``LLM(...).generate / .chat``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from tandem.engine.args import engine_config
from tandem.engine.input_processor import NO_TOKENIZER_MESSAGE
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import RequestError
from tandem.loader.registry import DEFAULT_MODEL
from tandem.loader.tokenizer import apply_chat_template
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, str]


class LLM:
    """The offline engine: ``LLM(model, **engine_args)``, then ``generate`` / ``chat``.

    ``model``: a local Hugging Face directory, a ``.gguf`` file or a built-in alias. The keyword
    arguments are vLLM's (``tokenizer``, ``dtype``, ``device``, ``seed``, ``load_format``,
    ``revision``, ``max_model_len``, ``skip_tokenizer_init``, ``gpu_memory_utilization``,
    ``kv_cache_memory_bytes``, ``max_num_seqs``, ``max_num_batched_tokens``, ``async_scheduling``,
    ``block_size``, ``enable_prefix_caching``, ``speculative_config``, ``enforce_eager``,
    ``log_stats``, the deprecated speculative keywords, and ``trust_remote_code``, ``swap_space``,
    ``tensor_parallel_size`` … which configure nothing here, :mod:`tandem.config.compat`) plus
    ``runner_config``; see :mod:`tandem.engine.args`. Each is optional and defaults to its config
    field's default, which is written only there.

    ``skip_tokenizer_init=True`` (as vLLM): no tokenizer is loaded; ``generate`` takes token-id
    prompts only (a text prompt raises a RequestError before anything runs), ``chat`` is refused,
    and every output's ``text`` is "" (the token ids are in ``token_ids``).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        items = _as_prompt_list(prompts)
        if self.engine.tokenizer is None and any(_split_prompt(item)[1] is None for item in items):
            raise RequestError(NO_TOKENIZER_MESSAGE, param="prompt")
        if sampling_params is None:
            params_list = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(items)} prompts; pass one or one per prompt")
        params_list = _final_only(params_list)
        engine = self.engine
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        for item, params in zip(items, params_list):
            rid = engine.new_request_id()
            ids.append(rid)
            text, tokens = _split_prompt(item)
            try:
                engine.add_request(rid, text, params, prompt_token_ids=tokens)
            except RequestError as e:
                results[rid] = _error_output(rid, text, tokens, str(e))
        bar = tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm or len(items) < 2)
        bar.update(len(results))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        if self.engine.tokenizer is None:
            raise RequestError("chat needs the tokenizer's chat template, which skip_tokenizer_init=True did not "
                               "load; apply the template yourself and pass token ids to generate()",
                               param="messages")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [
            {"prompt_token_ids": apply_chat_template(self.engine.tokenizer, list(conv), add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    seq = list(prompts)
    if seq and all(isinstance(t, int) for t in seq):
        return [seq]  # a single token-id prompt
    return seq


def _final_only(params_list: list[SamplingParams]) -> list[SamplingParams]:
    """The params as given, asking for one output per request, when it finishes (as vLLM's
    ``LLM.generate`` does): nothing here reads the outputs of unfinished requests."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for p in params_list:
        if p.output_kind is not RequestOutputKind.FINAL_ONLY and id(p) not in copies:
            copies[id(p)] = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        out.append(copies.get(id(p), p))
    return out


def _split_prompt(item: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(item, str):
        return item, None
    if isinstance(item, Mapping):
        if "prompt_token_ids" in item:
            return item.get("prompt"), list(item["prompt_token_ids"])
        if "prompt" in item:
            return str(item["prompt"]), None
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return None, [int(t) for t in item]


def _error_output(rid: str, text: str | None, tokens: list[int] | None, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=rid, prompt=text, prompt_token_ids=tokens or [],
        outputs=[CompletionOutput(0, "", [], None, None, finish_reason="error")],
        finished=True, error=message,
    )
