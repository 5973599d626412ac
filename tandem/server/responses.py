"""The bodies of ``/v1/completions`` and ``/v1/chat/completions``: one JSON response, or the SSE events of a stream.

Streaming sends one chunk per engine output that carries new text (a verify step releasing several
tokens is one chunk). With stop strings, the last ``max(len(stop)) - 1`` characters are held back
until the request finishes (a stop string may still cut them), so the streamed text always
concatenates to exactly the non-streamed text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tandem.outputs import RequestOutput
from tandem.server.api_errors import stream_error
from tandem.server.async_engine import RequestStream, merge_streams
from tandem.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    StreamState,
    now_s,
    stop_holdback,
    usage_of,
)
from tandem.server.protocol_logprobs import chat_logprobs, completion_logprobs
from tandem.server.serving import Prompt, ServerState, sse
from tandem.server.tools import ToolMode


def completion_response(server: ServerState, req: CompletionRequest, model: str, rid: str,
                        prompts: list[Prompt], outs: list[RequestOutput]) -> CompletionResponse:
    choices = []
    n = prompts[0].params.n
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        prefix = _echo_text(server, p) if req.echo else ""
        for c in out.outputs:
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(c.token_ids, c.logprobs or [], req.logprobs, server.token_text,
                                         initial_offset=len(prefix))
                if req.echo:
                    pl = completion_logprobs(p.ids, out.prompt_logprobs or [None] * len(p.ids), req.logprobs,
                                             server.token_text)
                    lp = type(lp)(text_offset=pl.text_offset + lp.text_offset,
                                  token_logprobs=pl.token_logprobs + lp.token_logprobs,
                                  tokens=pl.tokens + lp.tokens, top_logprobs=pl.top_logprobs + lp.top_logprobs)
            choices.append(CompletionChoice(index=i * n + c.index, text=prefix + c.text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(id=rid, created=now_s(), model=model, choices=choices, usage=usage_of(outs))


def _echo_text(server: ServerState, p: Prompt) -> str:
    return p.text if p.text is not None else server.tokenizer.decode(p.ids)


async def completion_events(server: ServerState, req: CompletionRequest, model: str, rid: str,
                            prompts: list[Prompt], streams: list[RequestStream]) -> AsyncIterator[str]:
    created = now_s()
    n = prompts[0].params.n
    states = {(i, j): StreamState() for i in range(len(prompts)) for j in range(n)}
    latest: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge_streams(streams):
            latest[i] = out
            p = prompts[i]
            hold = stop_holdback(p.params)
            for c in out.outputs:
                st = states[(i, c.index)]
                if st.done:
                    continue
                finished = c.finish_reason is not None
                prefix = ""
                if req.echo and not st.echoed:
                    prefix = _echo_text(server, p)
                    st.echoed, st.echo_len = True, len(prefix)
                offset = st.sent_text + (st.echo_len if req.echo else 0)
                delta = st.advance(c.text, finished, hold)
                if not delta and not prefix and not finished:
                    continue
                lp = None
                if req.logprobs is not None:
                    new = c.token_ids[st.sent_tokens:]
                    lp = completion_logprobs(new, (c.logprobs or [])[st.sent_tokens:], req.logprobs,
                                             server.token_text, initial_offset=offset + len(prefix))
                st.sent_tokens = len(c.token_ids)
                st.done = finished
                chunk = CompletionStreamResponse(id=rid, created=created, model=model, choices=[CompletionChoice(
                    index=i * n + c.index, text=prefix + delta, logprobs=lp,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
                if req.continuous_usage:
                    chunk.usage = usage_of(list(latest.values()))
                yield sse(chunk)
        if req.include_usage:
            yield sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                usage=usage_of(list(latest.values()))))
    except Exception as e:  # headers are sent: report in-band, as OpenAI does
        yield stream_error(e)
    finally:
        for s in streams:
            s.abort()
    yield "data: [DONE]\n\n"


# ---- chat: responses --------------------------------------------------------------------------------
def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_response(server: ServerState, req: ChatCompletionRequest, model: str, rid: str,
                  out: RequestOutput, mode: ToolMode) -> ChatCompletionResponse:
    num_top = req.top_logprobs or 0
    choices = []
    for c in out.outputs:
        content, calls = mode.extract(c.text) if c.finish_reason != "length" or mode.kind == "auto" else (c.text, [])
        choices.append(ChatChoice(
            index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls),
            logprobs=chat_logprobs(c.token_ids, c.logprobs or [], num_top, server.token_text) if req.logprobs else None,
            finish_reason=_finish_reason(c.finish_reason, bool(calls)), stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=rid, created=now_s(), model=model, choices=choices, usage=usage_of([out]))


async def chat_events(server: ServerState, req: ChatCompletionRequest, model: str, rid: str, prompt: Prompt,
                      stream: RequestStream, mode: ToolMode) -> AsyncIterator[str]:
    created = now_s()
    n = prompt.params.n
    num_top = req.top_logprobs or 0
    hold = stop_holdback(prompt.params)
    states = [StreamState() for _ in range(n)]
    tools = [mode.stream() for _ in range(n)]  # tool calls parsed from each choice's text
    last: RequestOutput | None = None

    def chunk(index: int, delta: DeltaMessage, **kw: Any) -> ChatCompletionStreamResponse:
        out = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[
            ChatStreamChoice(index=index, delta=delta, logprobs=kw.get("logprobs"),
                             finish_reason=kw.get("finish_reason"), stop_reason=kw.get("stop_reason"))])
        if req.continuous_usage and last is not None:
            out.usage = usage_of([last])
        return out

    try:
        for j in range(n):  # OpenAI: the first chunk of each choice carries the role
            yield sse(chunk(j, DeltaMessage(role="assistant", content="")))
        async for _, out in merge_streams([stream]):
            last = out
            for c in out.outputs:
                st = states[c.index]
                if st.done:
                    continue
                finished = c.finish_reason is not None
                delta = st.advance(c.text, finished, hold)
                if not delta and not finished:
                    continue
                lp = None
                if req.logprobs:
                    lp = chat_logprobs(c.token_ids[st.sent_tokens:], (c.logprobs or [])[st.sent_tokens:], num_top,
                                       server.token_text)
                st.sent_tokens = len(c.token_ids)
                st.done = finished
                ts = tools[c.index]
                content, calls = ts.feed(delta, finished)
                if not content and not calls and not finished and lp is None:
                    continue
                yield sse(chunk(c.index, DeltaMessage(content=content or None, tool_calls=calls or None),
                                 logprobs=lp, finish_reason=_finish_reason(c.finish_reason, ts.has_calls),
                                 stop_reason=c.stop_reason))
        if req.include_usage and last is not None:
            yield sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                    usage=usage_of([last])))
    except Exception as e:  # headers are sent: report in-band, as OpenAI does
        yield stream_error(e)
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"
