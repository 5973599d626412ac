"""Structured output and tool calls through the server, with the official ``openai`` client against live
``tandem serve`` processes (tiny random model: plain, n-gram and draft-model speculation; the built-in
SmolLM2 in the slow lane), plus in-process checks of the 400s.

The tiny model is random, so only the grammar makes its outputs JSON: every check here fails if the
mask, the rollback of rejected drafts or the draft cut is wrong.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_utils import make_llm
from test_server import TIMEOUT, _free_port, _wait_healthy, ensure_chat_template, max_len_for, post, stop_servers
from tiny_models import write_tiny_hf_checkpoint

from tandem.server.api import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.tools import ToolConfig

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,10}$"},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
HERMES_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "days": [1-7]\}\}</tool_call>'
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def check_schema(v: Any) -> None:
    """SCHEMA, validated by hand (no jsonschema dependency)."""
    assert isinstance(v, dict) and set(v) == {"name", "age", "tags"}, v
    assert isinstance(v["name"], str) and re.fullmatch("[a-z]{1,8}", v["name"]), v
    assert type(v["age"]) is int and 0 <= v["age"] <= 120, v
    assert isinstance(v["tags"], list) and len(v["tags"]) <= 2 and set(v["tags"]) <= {"x", "y"}, v


def check_weather_args(args: str) -> None:
    v = json.loads(args)
    assert set(v) == {"city", "days"} and re.fullmatch("[a-z]{1,10}", v["city"]) and 1 <= v["days"] <= 7, v


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_hf_checkpoint(tmp_path_factory.mktemp("structured-server"), family="llama",
                                    max_position_embeddings=2048)
    ensure_chat_template(path)
    return path


def _start(model: str, max_len: int, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "tandem.serve", model, "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--max-model-len", str(max_len), "--kv-cache-memory-bytes", str(128 << 20),
           "--served-model-name", "tiny", "--uvicorn-log-level", "warning", "--disable-log-stats", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=root)
    return proc, f"http://127.0.0.1:{port}"


def _serve(servers: dict[str, tuple[str, int, list[str]]], logs: Path) -> Iterator[dict[str, SimpleNamespace]]:
    started: dict[str, SimpleNamespace] = {}
    try:
        for name, (model, max_len, extra) in servers.items():
            proc, url = _start(model, max_len, extra, logs / f"{name}.log")
            started[name] = SimpleNamespace(proc=proc, url=url, log=logs / f"{name}.log")
        for s in started.values():
            _wait_healthy(s.proc, s.url, s.log, timeout=300.0)
            import openai

            s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT * 5)
        yield started
    finally:
        stop_servers([s.proc for s in started.values()])


TOOL_FLAGS = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


@pytest.fixture(scope="module")
def live(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimpleNamespace]]:
    draft = {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3}
    m, n = str(ckpt), max_len_for(ckpt, 2048)
    yield from _serve({"plain": (m, n, TOOL_FLAGS),
                       "ngram": (m, n, ["--speculative-config", json.dumps(NGRAM), *TOOL_FLAGS]),
                       "draft": (m, n, ["--speculative-config", json.dumps(draft), *TOOL_FLAGS])},
                      tmp_path_factory.mktemp("structured-logs"))


def json_schema_requests(client: Any, n: int = 20) -> list[str]:
    """n chat requests (greedy and sampled, concurrently) with response_format json_schema: their texts."""
    def one(i: int) -> str:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"person number {i}, as JSON"}],
            max_tokens=220, temperature=0 if i % 2 == 0 else 1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].message.content
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft"])
def test_json_schema_outputs_validate(live: dict[str, SimpleNamespace], kind: str) -> None:
    texts = json_schema_requests(live[kind].client)
    for t in texts:
        check_schema(json.loads(t))


def test_greedy_structured_output_is_the_same_with_and_without_speculation(live: dict[str, SimpleNamespace]) -> None:
    def run(s: SimpleNamespace) -> list[str]:
        out = []
        for prompt in ("alpha", "the quick brown fox", '{"name": "bob", "age": 3'):
            r = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=220, temperature=0,
                                            extra_body={"guided_json": SCHEMA})
            out.append(r.choices[0].text)
        return out
    base = run(live["plain"])
    for t in base:
        check_schema(json.loads(t))
    assert run(live["ngram"]) == base and run(live["draft"]) == base


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_regex_and_choice_hold(live: dict[str, SimpleNamespace], kind: str) -> None:
    c = live[kind].client
    r = c.completions.create(model="tiny", prompt=["a", "bb"], max_tokens=30, temperature=1.0, seed=3, n=2,
                             extra_body={"guided_regex": r"[a-c]{2,5}-\d{3}"})
    assert len(r.choices) == 4 and all(re.fullmatch(r"[a-c]{2,5}-\d{3}", ch.text) for ch in r.choices)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}], max_tokens=10,
                                  temperature=1.0, n=4, extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert {ch.message.content for ch in r.choices} <= {"red", "green"}
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                       temperature=0.5, stream=True, extra_body={"guided_regex": "(ab|cd)+e"})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert re.fullmatch("(ab|cd)+e", text)


def _join_tool_deltas(stream: Any) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call: id, type, name
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None, d
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_streamed_tool_calls(live: dict[str, SimpleNamespace], kind: str) -> None:
    c = live[kind].client
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    # A named function: the output is the arguments, forced by the grammar.
    stream = c.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER, TIME], max_tokens=120,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       stream=True, temperature=1.0, seed=1)
    calls, finish, _ = _join_tool_deltas(stream)
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    check_weather_args(calls[0]["arguments"])
    # auto + the hermes parser: the model's <tool_call> block (forced here by a regex) becomes a call.
    stream = c.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=150, stream=True,
                                       temperature=1.0, seed=2, extra_body={"guided_regex": HERMES_REGEX})
    calls, finish, content = _join_tool_deltas(stream)
    assert finish == "tool_calls" and content == "" and calls[0]["name"] == "get_weather"
    check_weather_args(calls[0]["arguments"])
    whole = c.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=150,
                                      temperature=1.0, seed=2, extra_body={"guided_regex": HERMES_REGEX})
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.arguments == calls[0]["arguments"] and whole.choices[0].finish_reason == "tool_calls"


def test_required_tool_choice(live: dict[str, SimpleNamespace]) -> None:
    r = live["ngram"].client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather and time"}], tools=[WEATHER, TIME],
        tool_choice="required", max_tokens=250, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
    for call in ch.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        if call.function.name == "get_weather":
            check_weather_args(call.function.arguments)
        else:
            assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    stream = live["ngram"].client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather and time"}], tools=[WEATHER, TIME],
        tool_choice="required", max_tokens=250, temperature=0, stream=True)
    calls, finish, content = _join_tool_deltas(stream)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    # tool_choice none: plain content, no calls
    r = live["ngram"].client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="none",
        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"


def test_bad_constraints_are_400_naming_the_field(live: dict[str, SimpleNamespace]) -> None:
    import openai

    c = live["plain"].client
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
        ({"extra_body": {"structured_outputs": {"grammar": "start ::= 'a'"}}}, "structured_outputs"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2).choices  # still serving


def test_auto_tool_choice_needs_the_flag(ckpt: Path) -> None:
    llm = make_llm(ckpt, max_model_len=2048)
    ae = AsyncEngine(llm.engine, "tiny")
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "max_tokens": 4}
        r = post(build_app(ae, ["tiny"]), "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        app = build_app(ae, ["tiny"], tools=ToolConfig("hermes", True))
        assert post(app, "/v1/chat/completions", body).status_code == 200
        assert post(app, "/v1/chat/completions", {**body, "tool_choice": "none"}).status_code == 200
    finally:
        ae.shutdown()


def test_auto_tool_choice_flag_needs_a_parser(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.server.cli import main

    assert main([str(ckpt), "--device", "cpu", "--port", "1", "--enable-auto-tool-choice"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: enable_auto_tool_choice:") and "--tool-call-parser" in err[0]
    with pytest.raises(SystemExit):
        main([str(ckpt), "--tool-call-parser", "mistral"])


@pytest.mark.slow
def test_builtin_model_json_schema_and_tools(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The built-in SmolLM2: 20 json_schema requests with and without n-gram / draft-model speculation
    validate, greedy outputs agree, and a named tool call streams as valid arguments."""
    draft = {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 3}
    smol = "smollm2-135m-instruct"
    # exact float32 (quantization none): concurrent requests verify several rows per step, and on the
    # packed int4 path (bf16 activations) a multi-request verify is not row-invariant (docs/quantization.md)
    exact = ["--quantization", "none", *TOOL_FLAGS]
    servers = {"plain": (smol, 1024, exact),
               "ngram": (smol, 1024, ["--speculative-config", json.dumps(NGRAM), *exact]),
               "draft": (smol, 1024, ["--speculative-config", json.dumps(draft), *exact])}
    for live in _serve(servers, tmp_path_factory.mktemp("smol-logs")):
        results = {k: json_schema_requests(s.client) for k, s in live.items()}
        for texts in results.values():
            for t in texts:
                check_schema(json.loads(t))
        greedy = {k: v[::2] for k, v in results.items()}
        assert greedy["ngram"] == greedy["plain"] and greedy["draft"] == greedy["plain"]
        stream = live["ngram"].client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "What is the weather in Paris for 3 days?"}],
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True, temperature=0, max_tokens=80)
        calls, finish, _ = _join_tool_deltas(stream)
        assert finish == "tool_calls"
        check_weather_args(calls[0]["arguments"])
