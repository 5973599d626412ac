"""The OpenAI-compatible server: protocol shapes, streaming, errors, auth, disconnects, CLI.

Most tests run in-process (httpx over ASGI against ``build_app``) on a tiny random Llama checkpoint;
the ``real process`` tests start ``python -m tandem.serve`` twice (plain and n-gram speculation) and
talk to it with the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from engine_utils import make_llm
from tiny_models import write_tiny_hf_checkpoint

from tandem.errors import RequestError
from tandem.sampling_params import SamplingParams
from tandem.server.api import build_app
from tandem.server.async_engine import AsyncEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown"
TIMEOUT = 60.0


# ---- fixtures ---------------------------------------------------------------------------------------
def ensure_chat_template(path: Path) -> None:
    """Give the tiny checkpoint's tokenizer a chat template if the fixture wrote none."""
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if cfg.get("chat_template") or (path / "chat_template.jinja").exists():
        return
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))


def max_len_for(path: Path, want: int = 256) -> int:
    cfg = json.loads((path / "config.json").read_text())
    return min(want, int(cfg.get("max_position_embeddings", want)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_hf_checkpoint(tmp_path_factory.mktemp("server"), family="llama")
    ensure_chat_template(path)
    return path


@pytest.fixture(scope="module")
def served(ckpt: Path) -> Iterator[SimpleNamespace]:
    max_len = max_len_for(ckpt)
    llm = make_llm(ckpt, max_model_len=max_len, speculative_config=NGRAM)
    ae = AsyncEngine(llm.engine, "tiny")
    app = build_app(ae, ["tiny"], None, model_aliases=[str(ckpt)])
    yield SimpleNamespace(engine=llm.engine, async_engine=ae, app=app, max_len=max_len, ckpt=ckpt)
    ae.shutdown()


def run(app: Any, fn: Callable[[httpx.AsyncClient], Awaitable[Any]], headers: dict[str, str] | None = None) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tandem", timeout=TIMEOUT,
                                     headers=headers) as client:
            return await asyncio.wait_for(fn(client), TIMEOUT)

    return asyncio.run(main())


def post(app: Any, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go(c: httpx.AsyncClient) -> httpx.Response:
        if isinstance(body, (bytes, str)):
            return await c.post(path, content=body, headers={"content-type": "application/json"})
        return await c.post(path, json=body)

    return run(app, go, headers)


def sse(resp: httpx.Response) -> list[Any]:
    """The events of an SSE body: parsed JSON objects, then the string "[DONE]"."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    return events


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def greedy_body(**kw: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    body.update(kw)
    return body


def chat_body(**kw: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": PROMPT}],
            "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    body.update(kw)
    return body


def streamed_text(events: list[Any], index: int = 0, chat: bool = False) -> str:
    parts = []
    for e in events[:-1]:
        for ch in e["choices"]:
            if ch["index"] == index:
                parts.append((ch["delta"].get("content") or "") if chat else ch["text"])
    return "".join(parts)


# ---- completions ------------------------------------------------------------------------------------
def test_completion_response_shape(served: SimpleNamespace) -> None:
    r = post(served.app, "/v1/completions", greedy_body())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    n_prompt = len(served.engine.encode(PROMPT))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 24, "total_tokens": n_prompt + 24,
                             "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("with_stop", [False, True])
def test_completion_stream_equals_non_stream(served: SimpleNamespace, with_stop: bool) -> None:
    body = greedy_body(max_tokens=40)
    full = post(served.app, "/v1/completions", body).json()["choices"][0]["text"]
    if with_stop:
        # A stop string taken from the middle of the greedy output: the stream must hold back text
        # that the stop string will cut, and still concatenate to exactly the non-streamed text.
        visible = full.replace("\ufffd", "")
        if len(visible) < 8:
            pytest.skip("greedy output too short to pick a stop string")
        body["stop"] = [visible[len(visible) // 2: len(visible) // 2 + 3]]
        full = post(served.app, "/v1/completions", body).json()["choices"][0]["text"]
    events = sse(post(served.app, "/v1/completions", {**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}))
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert streamed_text(events) == full
    finals = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    assert finals[0]["choices"][0]["finish_reason"] == ("stop" if with_stop else "length")


def test_one_sse_chunk_per_engine_output(served: SimpleNamespace) -> None:
    """A verify step that releases several tokens is sent as ONE chunk (n-gram speculation is on)."""
    body = greedy_body(max_tokens=40)

    async def engine_outputs() -> list[Any]:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        return [o async for o in served.async_engine.generate(PROMPT, params, "direct-1")]

    outs = asyncio.run(engine_outputs())
    grew, prev = 0, ""
    for o in outs:
        text = o.outputs[0].text
        if len(text) > len(prev) or o.finished:
            grew += 1
        prev = text
    events = sse(post(served.app, "/v1/completions", {**body, "stream": True}))
    assert len(events) - 1 == grew
    assert streamed_text(events) == outs[-1].outputs[0].text


@pytest.mark.parametrize("prompts", [["hello world", "abc"], [[10, 11, 12, 13, 14], [20, 21]]])
def test_n_and_prompt_lists(served: SimpleNamespace, prompts: list[Any]) -> None:
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0.8, "seed": 3,
            "ignore_eos": True}
    res = post(served.app, "/v1/completions", body).json()
    assert sorted(c["index"] for c in res["choices"]) == [0, 1, 2, 3]
    n_prompt = sum(len(served.engine.encode(p)) if isinstance(p, str) else len(p) for p in prompts)
    assert res["usage"]["prompt_tokens"] == n_prompt
    assert res["usage"]["completion_tokens"] == 4 * 6
    events = sse(post(served.app, "/v1/completions", {**body, "stream": True}))
    finals = [ch["index"] for e in events[:-1] for ch in e["choices"] if ch["finish_reason"]]
    assert sorted(finals) == [0, 1, 2, 3]
    # the same seed gives the same samples, streamed or not
    for i in range(4):
        want = next(c["text"] for c in res["choices"] if c["index"] == i)
        assert streamed_text(events, i) == want


def test_completion_logprobs_and_echo(served: SimpleNamespace) -> None:
    res = post(served.app, "/v1/completions", greedy_body(max_tokens=5, logprobs=2)).json()
    lp = res["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    events = sse(post(served.app, "/v1/completions", greedy_body(max_tokens=5, logprobs=2, stream=True)))
    streamed = {k: [x for e in events[:-1] for x in e["choices"][0]["logprobs"][k]] for k in lp}
    assert streamed == lp  # same tokens, logprobs and text offsets, streamed or not
    echo = post(served.app, "/v1/completions", greedy_body(max_tokens=5, logprobs=1, echo=True)).json()
    ch = echo["choices"][0]
    assert ch["text"].startswith(PROMPT)
    n_prompt = len(served.engine.encode(PROMPT))
    assert len(ch["logprobs"]["tokens"]) == n_prompt + 5
    assert ch["logprobs"]["token_logprobs"][0] is None
    assert all(x is not None for x in ch["logprobs"]["token_logprobs"][1:])


# ---- chat ---------------------------------------------------------------------------------------------
def test_chat_response_and_stream(served: SimpleNamespace) -> None:
    r = post(served.app, "/v1/chat/completions", chat_body())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 20
    events = sse(post(served.app, "/v1/chat/completions",
                      chat_body(stream=True, stream_options={"include_usage": True})))
    first = events[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:-2])
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 20
    assert streamed_text(events, chat=True) == choice["message"]["content"]
    # max_completion_tokens wins over max_tokens
    r2 = post(served.app, "/v1/chat/completions", chat_body(max_completion_tokens=3)).json()
    assert r2["usage"]["completion_tokens"] == 3


def test_chat_logprobs(served: SimpleNamespace) -> None:
    body = post(served.app, "/v1/chat/completions", chat_body(max_tokens=4, logprobs=True, top_logprobs=2)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0
    none = post(served.app, "/v1/chat/completions", chat_body(max_tokens=2)).json()
    assert none["choices"][0]["logprobs"] is None


# ---- errors -------------------------------------------------------------------------------------------
_LONG = object()  # placeholder: a prompt of max_model_len tokens

ERROR_CASES: list[tuple[str, Any, int, str | None, str | None]] = [
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [10 ** 7]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": _LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 10 ** 6}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "x"}, 404, "model", None),
    ("/tokenize", {}, 400, None, None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
]


@pytest.mark.parametrize("path,body,status,param,code", ERROR_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_error_responses(served: SimpleNamespace, path: str, body: Any, status: int, param: str | None,
                         code: str | None) -> None:
    if isinstance(body, dict) and body.get("prompt") is _LONG:
        body = {**body, "prompt": [5] * served.max_len}
    assert_error(post(served.app, path, body), status, param, code)
    if isinstance(body, dict) and path.startswith("/v1/"):  # the streaming variant fails the same way
        if not (isinstance(body, dict) and "stream_options" in body):
            assert_error(post(served.app, path, {**body, "stream": True}), status, param, code)


def test_unknown_route_and_server_stays_up(served: SimpleNamespace) -> None:
    err = assert_error(run(served.app, lambda c: c.get("/v1/nope")), 404)
    assert err["type"] == "not_found_error"
    r = post(served.app, "/v1/completions", greedy_body(max_tokens=2))
    assert r.status_code == 200
    assert served.engine.num_running == 0 and not served.engine.has_unfinished_requests()


def test_model_alias_and_default(served: SimpleNamespace) -> None:
    r = post(served.app, "/v1/completions", greedy_body(max_tokens=2, model=str(served.ckpt)))
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    body = greedy_body(max_tokens=2)
    del body["model"]
    assert post(served.app, "/v1/completions", body).status_code == 200


def test_api_key(served: SimpleNamespace) -> None:
    app = build_app(served.async_engine, ["tiny"], "s3cret")

    async def go(c: httpx.AsyncClient) -> dict[str, int]:
        out = {}
        out["none"] = (await c.post("/v1/completions", json=greedy_body(max_tokens=2))).status_code
        wrong = await c.post("/v1/completions", json=greedy_body(max_tokens=2),
                             headers={"Authorization": "Bearer nope"})
        out["wrong"] = wrong.status_code
        assert_error(wrong, 401, code="invalid_api_key")
        ok = await c.post("/v1/completions", json=greedy_body(max_tokens=2),
                          headers={"Authorization": "Bearer s3cret"})
        out["ok"] = ok.status_code
        out["health"] = (await c.get("/health")).status_code
        out["metrics"] = (await c.get("/metrics")).status_code
        out["models"] = (await c.get("/v1/models")).status_code
        out["tokenize"] = (await c.post("/tokenize", json={"prompt": "x"})).status_code
        return out

    assert run(app, go) == {"none": 401, "wrong": 401, "ok": 200, "health": 200, "metrics": 401,
                            "models": 401, "tokenize": 401}


# ---- small routes -------------------------------------------------------------------------------------
def test_tokenize_detokenize_models_version_health(served: SimpleNamespace) -> None:
    tok = post(served.app, "/tokenize", {"prompt": PROMPT}).json()
    assert tok["tokens"] == served.engine.encode(PROMPT)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == served.max_len
    chat = post(served.app, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 0
    detok = post(served.app, "/detokenize", {"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == served.engine.tokenizer.decode(tok["tokens"])

    async def gets(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.get(p) for p in ("/v1/models", "/version", "/health")]

    models, version, health = run(served.app, gets)
    data = models.json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["tiny"]
    assert data["data"][0]["object"] == "model" and data["data"][0]["max_model_len"] == served.max_len
    assert version.json()["version"]
    assert health.status_code == 200


# ---- engine failures and aborts -----------------------------------------------------------------------
def _inject_step_failures(monkeypatch: pytest.MonkeyPatch, engine: Any) -> Callable[[], None]:
    """Patch engine.step; each call of the returned ``arm()`` makes one step with work in it raise."""
    orig, armed = engine.step, []

    def step() -> Any:
        if armed and (engine.num_running or engine.num_waiting):
            armed.pop()
            raise RuntimeError("injected step failure")
        return orig()

    monkeypatch.setattr(engine, "step", step)
    return lambda: armed.append(1)


def test_step_failure_gives_500_and_server_recovers(served: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    arm = _inject_step_failures(monkeypatch, served.engine)
    arm()
    err = assert_error(post(served.app, "/v1/completions", greedy_body(max_tokens=4)), 500)
    assert err["type"] == "server_error" and "injected step failure" in err["message"]
    arm()
    events = sse(post(served.app, "/v1/completions", greedy_body(max_tokens=4, stream=True)))
    assert "error" in events[-2] and "injected" in events[-2]["error"]["message"]
    assert post(served.app, "/v1/completions", greedy_body(max_tokens=4)).status_code == 200
    monkeypatch.undo()
    assert run(served.app, lambda c: c.get("/health")).status_code == 200
    assert served.engine.num_running == 0 and served.engine.kv_usage == 0


def test_abandoned_generation_frees_kv_and_others_continue(served: SimpleNamespace) -> None:
    ae, engine = served.async_engine, served.engine

    async def main() -> tuple[str | None, int]:
        long = SamplingParams(temperature=0.0, max_tokens=served.max_len - len(PROMPT) - 16, ignore_eos=True)
        short = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        other = asyncio.ensure_future(_last(ae.generate(PROMPT, short, "keeps-going")))
        gen = ae.generate(PROMPT, long, "walks-away")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()  # what a client disconnect does to the handler's iteration
        done = await other
        return done.outputs[0].finish_reason, len(done.outputs[0].token_ids)

    assert asyncio.run(main()) == ("length", 30)
    deadline = time.monotonic() + 10
    while (engine.num_running or engine.kv_usage) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_running == 0 and engine.kv_usage == 0


@pytest.mark.parametrize("stream", [False, True])
def test_http_client_disconnect_aborts_request(served: SimpleNamespace, stream: bool) -> None:
    """Drive the ASGI app directly: the client hangs up while its request is generating."""
    engine = served.engine
    max_tokens = served.max_len - len(PROMPT) - 16
    body = json.dumps(greedy_body(max_tokens=max_tokens, stream=stream)).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("tandem", 80),
             "headers": [(b"content-type", b"application/json"), (b"host", b"tandem")]}

    async def main() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        calls = 0

        async def receive() -> dict[str, Any]:
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            while engine.num_running == 0:  # hang up once the request is being generated
                await asyncio.sleep(0.001)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await served.app(scope, receive, send)
        return sent

    before = engine.stats.generation_tokens
    asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    deadline = time.monotonic() + 10
    while (engine.num_running or engine.kv_usage) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_running == 0 and engine.kv_usage == 0
    assert engine.stats.generation_tokens - before < max_tokens, "the request was not aborted"


def test_engine_rejection_is_per_request(served: SimpleNamespace) -> None:
    ae = served.async_engine

    async def main() -> str | None:
        good = asyncio.ensure_future(_last(ae.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), "ok-1")))
        with pytest.raises(RequestError):
            await _last(ae.generate([10 ** 7], SamplingParams(max_tokens=5), "bad-1"))
        with pytest.raises(RequestError):  # duplicate request id while "ok-1" may still run
            await _last(ae.generate(PROMPT, SamplingParams(max_tokens=5), "ok-1"))
        return (await good).outputs[0].finish_reason

    assert asyncio.run(main()) == "length"


async def _last(agen: Any) -> Any:
    last = None
    async for out in agen:
        last = out
    return last


# ---- CLI ------------------------------------------------------------------------------------------------
def test_serve_is_a_tandem_subcommand() -> None:
    from tandem.cli import build_parser
    from tandem.server.cli import run_serve

    ns = build_parser().parse_args(["serve", "some-model", "--port", "1234", "--served-model-name", "a", "b"])
    assert ns.func is run_serve and ns.model == "some-model" and ns.port == 1234
    assert ns.served_model_name == ["a", "b"] and ns.host == "127.0.0.1"


@pytest.mark.parametrize("flags,needle", [
    (["--speculative-config", '{"method": "bogus", "num_speculative_tokens": 2}'], "method"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
      "--num-speculative-tokens", "3"], "speculative_config"),
    (["--block-size", "3"], "block_size"),
])
def test_startup_config_errors_exit_2(ckpt: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                      needle: str) -> None:
    from tandem.server.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        rc = main([str(ckpt), "--device", "cpu", "--port", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def test_startup_missing_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.server.cli import main

    assert main([str(tmp_path / "nowhere"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_deprecated_speculation_flags_still_work(ckpt: Path) -> None:
    import argparse

    from tandem.server.cli import add_serve_args, build_server

    p = argparse.ArgumentParser()
    add_serve_args(p)
    ns = p.parse_args([str(ckpt), "--device", "cpu", "--kv-cache-memory-bytes", str(16 << 20),
                       "--max-model-len", "64", "--speculative-model", "[ngram]",
                       "--num-speculative-tokens", "2", "--ngram-prompt-lookup-max", "2"])
    with pytest.warns(FutureWarning, match="deprecated"):
        app, ae = build_server(ns)
    try:
        assert ae.engine.spec.method == "ngram" and ae.engine.spec.num_speculative_tokens == 2
        r = post(app, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "model": str(ckpt)})
        assert r.status_code == 200, r.text
    finally:
        ae.shutdown()


# ---- real process ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(ckpt: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "tandem.serve", str(ckpt), "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--max-model-len", str(max_len_for(ckpt, 512)),
           "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "tiny",
           "--uvicorn-log-level", "warning", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=root)
    return proc, f"http://127.0.0.1:{port}"


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGINT every server (they shut down in parallel), then wait; kill any that hangs."""
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"server not healthy after {timeout}s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def live(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimpleNamespace]]:
    logs = tmp_path_factory.mktemp("server-logs")
    specs = {"plain": (["--async-scheduling"], "unused"),  # asynchronous decode under real HTTP load
             "ngram": (["--speculative-config", json.dumps(NGRAM), "--api-key", "sekret"], "sekret")}
    started = {}
    try:
        for name, (extra, key) in specs.items():  # start both, then wait: they load in parallel
            proc, url = _start_server(ckpt, extra, logs / f"{name}.log")
            started[name] = SimpleNamespace(proc=proc, url=url, key=key, log=logs / f"{name}.log",
                                            max_len=max_len_for(ckpt, 512))
        for s in started.values():
            _wait_healthy(s.proc, s.url, s.log)
        yield started
    finally:
        stop_servers([s.proc for s in started.values()])


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_openai_client_end_to_end(live: dict[str, SimpleNamespace], kind: str) -> None:
    import openai

    s = live[kind]
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=s.key, max_retries=0, timeout=TIMEOUT)
    assert [m.id for m in client.models.list()] == ["tiny"]
    kw: dict[str, Any] = dict(model="tiny", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    comp = client.completions.create(prompt=PROMPT, **kw)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 32
    pieces, usage, finish = [], None, None
    for chunk in client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == comp.choices[0].text
    assert finish == "length" and usage is not None and usage.completion_tokens == 32

    msgs = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(messages=msgs, **kw)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 32
    stream = client.chat.completions.create(messages=msgs, stream=True, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(prompt=PROMPT, model="tiny", temperature=-3)
    assert exc.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(prompt=PROMPT, model="other", max_tokens=2)
    if kind == "ngram":
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_64_concurrent_streaming_clients(live: dict[str, SimpleNamespace]) -> None:
    import openai

    s = live["ngram"]

    async def main() -> list[tuple[str | None, int]]:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=s.key, max_retries=0, timeout=TIMEOUT)

        async def one(i: int) -> tuple[str | None, int]:
            finish, n_chunks = None, 0
            stream = await client.completions.create(
                model="tiny", prompt=f"{i} {PROMPT} {i}", max_tokens=16, temperature=0.7, seed=i, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            tokens = 0
            async for chunk in stream:
                n_chunks += 1
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for ch in chunk.choices:
                    finish = ch.finish_reason or finish
            return finish, tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert results == [("length", 16)] * 64


def _metric_values(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if set(s.labels) == {"model_name"}}


def test_client_disconnect_mid_stream_frees_kv(live: dict[str, SimpleNamespace]) -> None:
    s = live["plain"]
    long_tokens, short_tokens = s.max_len - len(PROMPT) - 16, 48  # char-level tokenizer: 1 char = 1 token
    before = _metric_values(s.url)

    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=s.url, timeout=TIMEOUT) as c:
            async def finisher() -> dict[str, Any]:
                r = await c.post("/v1/completions", json=greedy_body(max_tokens=short_tokens))
                return r.json()

            body = greedy_body(max_tokens=long_tokens, stream=True)
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                other = asyncio.ensure_future(finisher())
                seen = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen == 3:
                            break  # leave mid-stream: closing the response drops the connection
            return await other

    other = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert other["choices"][0]["finish_reason"] == "length"
    assert other["usage"]["completion_tokens"] == short_tokens
    deadline = time.monotonic() + 10
    after = _metric_values(s.url)
    while time.monotonic() < deadline and (after["tandem:num_requests_running"] or after["tandem:kv_cache_usage_perc"]):
        time.sleep(0.05)
        after = _metric_values(s.url)
    assert after["tandem:num_requests_running"] == 0
    assert after["tandem:kv_cache_usage_perc"] == 0
    generated = after["tandem:generation_tokens_total"] - before["tandem:generation_tokens_total"]
    assert generated < long_tokens + short_tokens, "the abandoned request ran to completion"
