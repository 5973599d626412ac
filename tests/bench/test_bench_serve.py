"""``bench serve`` end to end against a FAKE OpenAI-compatible streaming server (FastAPI + uvicorn on
127.0.0.1, random free port): streams fixed tokens (1- and 2-token chunks, like speculative steps)
with small sleeps, answers HTTP 500 for prompts containing FAIL, drops the connection mid-stream for
DROP, and serves /metrics with tandem:spec_decode counters that grow per finished request."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tandem.bench import cli, compare, compare_server
from tandem.bench.datasets import SampleRequest
from tandem.bench.serve import BenchmarkError, ClientConfig, run_benchmark

CHUNK_SLEEP_S = 0.002
# Per finished request the fake engine reports: 4 drafts of k=3, 6 accepted (3 at pos 0, 2, 1).
PER_REQUEST = {"drafts": 4, "draft_tokens": 12, "accepted": 6, "pos": [3, 2, 1]}


class FakeState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.drafts = self.draft_tokens = self.accepted = 0
        self.pos = [0, 0, 0]

    def finish(self) -> None:
        with self.lock:
            self.drafts += PER_REQUEST["drafts"]
            self.draft_tokens += PER_REQUEST["draft_tokens"]
            self.accepted += PER_REQUEST["accepted"]
            self.pos = [a + b for a, b in zip(self.pos, PER_REQUEST["pos"])]

    def prometheus(self) -> str:
        lines = []
        for name, value in (("num_drafts", self.drafts), ("num_draft_tokens", self.draft_tokens),
                            ("num_accepted_tokens", self.accepted)):
            lines += [f"# TYPE tandem:spec_decode_{name}_total counter",
                      f'tandem:spec_decode_{name}_total{{model_name="fake-model"}} {float(value)}']
        lines.append("# TYPE tandem:spec_decode_num_accepted_tokens_per_pos_total counter")
        lines += [f'tandem:spec_decode_num_accepted_tokens_per_pos_total{{model_name="fake-model",position="{i}"}} '
                  f"{float(v)}" for i, v in enumerate(self.pos)]
        return "\n".join(lines) + "\n"


def chunk_sizes(n: int) -> list[int]:
    """1, 2, 1, 2, … tokens per chunk, summing to n."""
    sizes, i = [], 0
    while sum(sizes) < n:
        sizes.append(min(1 + i % 2, n - sum(sizes)))
        i += 1
    return sizes


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.prometheus())

    async def stream(body: dict, text: str, chat: bool):
        n = int(body["max_tokens"])
        sizes = chunk_sizes(n)
        if chat:
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
        yield ": ping\n\n"  # SSE comment: must be ignored
        k = 0
        for j, size in enumerate(sizes):
            await asyncio.sleep(CHUNK_SLEEP_S)
            if "DROP" in text and j == 2:
                raise RuntimeError("connection dropped on purpose")
            piece = "".join(f"t{k + i} " for i in range(size))
            k += size
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            yield "data: " + json.dumps({"choices": [{**choice, "finish_reason": None}]}) + "\n\n"
        end = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        yield "data: " + json.dumps({"choices": [{**end, "finish_reason": "length"}]}) + "\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
        state.finish()

    async def handle(request: Request, chat: bool):
        body = await request.json()
        with state.lock:
            state.bodies.append(body)
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in text:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        return StreamingResponse(stream(body, text, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def make_tokenizer_dir(path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world prompt number one two three FAIL DROP"] * 5, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(path))
    return str(path)


def test_bench_serve_cli_end_to_end(fake_server, tmp_path, capsys):
    base_url, state = fake_server
    prompts = [{"prompt": f"hello world prompt number {i}", "output_tokens": 6 + i} for i in range(10)]
    prompts[3]["prompt"] += " FAIL"
    prompts[6]["prompt"] += " FAIL"
    prompts[8]["prompt"] += " DROP"
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in prompts))
    result_dir = tmp_path / "results"
    rc = cli.main([
        "serve", "--base-url", base_url, "--tokenizer", make_tokenizer_dir(tmp_path / "tok"),
        "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "10",
        "--max-concurrency", "3", "--request-rate", "500", "--burstiness", "0.5", "--seed", "1",
        "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--disable-tqdm",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out
    expected_ok = [i for i in range(10) if i not in (3, 6, 8)]
    total_out = sum(6 + i for i in expected_ok)
    for label, value in [("Successful requests:", 7), ("Failed requests:", 3),
                         ("Total generated tokens:", total_out), ("Maximum request concurrency:", 3),
                         ("Drafts:", 4 * 7), ("Draft tokens:", 12 * 7), ("Accepted tokens:", 6 * 7),
                         ("Acceptance rate (%):", "50.00"), ("Acceptance length:", "2.50")]:
        assert f"{label:<40} {value}" in out, label
    assert f"{'  Position 0:':<40} 75.00" in out and f"{'  Position 2:':<40} 25.00" in out
    assert "P50 E2EL (ms):" in out and "P99 ITL (ms):" in out

    # The requests the server saw: OpenAI format, streaming with usage, the bench's sampling settings.
    body = state.bodies[-1]
    assert body["model"] == "fake-model" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True

    files = list(result_dir.glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith("openai-500.0qps-concurrency3-fake-model-")
    saved = json.loads(files[0].read_text())
    for key in ("date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p50_e2el_ms", "input_lens", "output_lens",
                "ttfts", "itls", "generated_texts", "errors", "spec_decode"):
        assert key in saved, key
    assert (saved["completed"], saved["failed"], saved["num_prompts"]) == (7, 3, 10)
    assert saved["model_id"] == "fake-model" and saved["max_concurrency"] == 3
    assert saved["output_lens"] == [6 + i if i in expected_ok else 0 for i in range(10)]
    assert "HTTP 500" in saved["errors"][3] and "injected failure" in saved["errors"][3]
    assert saved["errors"][8] and saved["generated_texts"][0] == "".join(f"t{k} " for k in range(6))
    # 6 tokens in chunks of 1,2,1,2 → 4 chunks → 3 ITL gaps (a multi-token chunk is ONE gap).
    assert len(saved["itls"][0]) == 3
    assert saved["spec_decode"]["per_position_acceptance_rates"] == pytest.approx([75.0, 50.0, 25.0])


def _client(base_url: str, chat: bool = False) -> ClientConfig:
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    return ClientConfig(api_url=base_url + endpoint, model="fake-model",
                        backend="openai-chat" if chat else "openai", request_timeout_s=30)


def test_chat_backend_and_itl_semantics(fake_server):
    base_url, _ = fake_server
    reqs = [SampleRequest(f"hello {i}", 2, 7) for i in range(6)]
    res = asyncio.run(run_benchmark(reqs, _client(base_url, chat=True), base_url, request_rate=200.0,
                                    burstiness=2.0, disable_tqdm=True, quiet=True))
    assert res.metrics.completed == 6 and res.metrics.failed == 0 and not res.interrupted
    for r in res.results:
        # 7 tokens in chunks 1,2,1,2,1 → 5 content chunks, the role-only chunk is not a token.
        assert r.output_tokens == 7 and len(r.itl) == 4
        assert r.generated_text == "".join(f"t{k} " for k in range(7))
        assert 0 < r.ttft <= r.latency
        assert r.latency - r.ttft == pytest.approx(sum(r.itl), abs=1e-6)
    assert res.metrics.total_output == 42
    assert res.spec_decode is not None and res.spec_decode.num_drafts == 24


def test_no_metrics_endpoint_skips_spec_section(fake_server):
    base_url, _ = fake_server
    reqs = [SampleRequest("hello", 1, 3)] * 2
    # /metrics is looked up under base_url: a prefix without it means "absent".
    res = asyncio.run(run_benchmark(reqs, _client(base_url), base_url + "/nothing-here",
                                    disable_tqdm=True, quiet=True, initial_test=False))
    assert res.metrics.completed == 2 and res.spec_decode is None


def test_unreachable_server_counts_failures_without_crashing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    base_url = f"http://127.0.0.1:{port}"
    reqs = [SampleRequest("hello", 1, 3)] * 3
    with pytest.warns(UserWarning, match="All requests failed"):
        res = asyncio.run(run_benchmark(reqs, _client(base_url), base_url, disable_tqdm=True, quiet=True,
                                        initial_test=False, max_concurrency=2))
    assert (res.metrics.completed, res.metrics.failed) == (0, 3)
    assert all("Connect" in r.error for r in res.results)
    with pytest.raises(BenchmarkError, match="initial test run failed"):
        asyncio.run(run_benchmark(reqs, _client(base_url), base_url, disable_tqdm=True, quiet=True))


def test_interrupt_reports_what_was_measured(fake_server):
    base_url, _ = fake_server
    reqs = [SampleRequest("hello", 1, 60) for _ in range(12)]  # ~40 chunks × 2 ms each

    async def main():
        task = asyncio.create_task(run_benchmark(reqs, _client(base_url), base_url, max_concurrency=2,
                                                 disable_tqdm=True, quiet=True, initial_test=False))
        while True:  # wait until a few requests finished, then "Ctrl-C"
            await asyncio.sleep(0.02)
            if task.done():
                break
            if len(_client_done) >= 3:
                break
        task.cancel()
        return await task

    _client_done: list[int] = []
    import tandem.bench.serve as serve_mod

    original = serve_mod.send_request

    async def counting(*args, **kwargs):
        r = await original(*args, **kwargs)
        _client_done.append(1)
        return r

    serve_mod.send_request = counting
    try:
        res = asyncio.run(asyncio.wait_for(main(), timeout=30))
    finally:
        serve_mod.send_request = original
    assert res.interrupted
    assert 3 <= res.metrics.completed < 12 and res.metrics.failed == 0
    assert res.num_unfinished == 12 - len(res.results)
    from tandem.bench.report import format_report

    assert "Interrupted; unfinished requests:" in format_report(
        res.metrics, res.duration, interrupted=True, num_unfinished=res.num_unfinished)


# ---------------------------------------------------------------- bench compare orchestration


def serve_forever(port: int) -> None:
    """Entry of the fake server as a subprocess (stands in for ``python -m tandem.serve``)."""
    uvicorn.run(make_app(FakeState()), host="127.0.0.1", port=port, log_level="critical")


def _free_port_pair() -> int:
    """Two free consecutive ports below Linux's ephemeral range (32768-60999): a pair taken from that
    range could be taken in turn by one of the first server's client connections (its local port,
    then in TIME_WAIT) before the second server binds it — the likely cause of one failed run here."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        if compare_server.port_free(port) and compare_server.port_free(port + 1):
            return port
    raise RuntimeError("no free port pair")


def test_compare_end_to_end_with_fake_servers(tmp_path, monkeypatch, capsys):
    a, b = tmp_path / "base.json", tmp_path / "ngram.json"
    a.write_text(json.dumps({"name": "base", "max_model_len": 512}))
    b.write_text(json.dumps({"name": "ngram", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}))
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import test_bench_serve as t; t.serve_forever(int(sys.argv[1]))")
    real_commands = []

    def fake_command(model: str, port: int, options: dict) -> list[str]:
        real_commands.append(compare.server_command.__wrapped__(model, port, options))
        return [sys.executable, "-c", code, str(port)]

    fake_command.__wrapped__ = compare.server_command  # type: ignore[attr-defined]
    monkeypatch.setattr(compare, "server_command", fake_command)
    out_dir = tmp_path / "cmp"
    rc = cli.main([
        "compare", "--config", str(a), "--config", str(b), "--model", "some-model",
        "--tokenizer", make_tokenizer_dir(tmp_path / "tok"), "--dataset-name", "random",
        "--random-input-len", "12", "--random-output-len", "8", "--num-prompts", "6",
        "--concurrency", "1,3", "--result-dir", str(out_dir), "--port-base", str(_free_port_pair()),
        "--server-timeout", "60", "--disable-tqdm",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "--no-enable-prefix-caching" in real_commands[0] and "--speculative-config" in real_commands[1]
    assert "Speculative decoding comparison (baseline: base)" in out
    data = json.loads((out_dir / "compare.json").read_text())
    assert [(r["config"], r["concurrency"]) for r in data["rows"]] == [
        ("base", 1), ("ngram", 1), ("base", 3), ("ngram", 3)]
    ngram = data["rows"][1]
    assert ngram["tau"] == pytest.approx(2.5) and ngram["alpha"] is not None and ngram["k"] == 3
    assert ngram["model_speedup"] is not None and ngram["efficiency"] is not None
    assert all(r["failed"] == 0 for r in data["rows"])
    for name in ("tpot_vs_concurrency.png", "throughput_vs_concurrency.png", "per_position_acceptance.png"):
        assert (out_dir / name).stat().st_size > 0
    assert len(list((out_dir / "runs").glob("*.json"))) == 4


def test_compare_reports_server_that_dies(tmp_path, monkeypatch, capsys):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"name": "broken"}))
    die = "import sys; print('model file not found: boom', file=sys.stderr); sys.exit(3)"
    monkeypatch.setattr(compare, "server_command", lambda model, port, options: [sys.executable, "-c", die])
    rc = cli.main([
        "compare", "--config", str(a), "--model", "m", "--tokenizer", make_tokenizer_dir(tmp_path / "tok"),
        "--dataset-name", "random", "--random-input-len", "8", "--num-prompts", "2", "--concurrency", "1",
        "--result-dir", str(tmp_path / "out"), "--port-base", str(_free_port_pair()), "--disable-tqdm",
    ])
    captured = capsys.readouterr()
    assert rc == 1
    assert "exited with code 3" in captured.err and "model file not found: boom" in captured.err
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["errors"]["broken"]


def readme_compare_argv() -> list[str]:
    """The README's ``tandem bench compare`` example, as argv after ``tandem bench``."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    start = text.index("tandem bench compare ")
    command = text[start:text.index("\n```", start)].replace("\\\n", " ")
    argv = shlex.split(command.splitlines()[0])
    assert argv[:3] == ["tandem", "bench", "compare"]
    return argv[2:]


def test_readme_compare_example_runs_with_inline_configs(tmp_path, monkeypatch, capsys):
    """The README example as written (inline configs, default model), servers faked, no network."""
    from tandem.loader.registry import DEFAULT_MODEL

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import test_bench_serve as t; t.serve_forever(int(sys.argv[1]))")
    started = []

    def fake_command(model: str, port: int, options: dict) -> list[str]:
        started.append((model, options))
        return [sys.executable, "-c", code, str(port)]

    monkeypatch.setattr(compare, "server_command", fake_command)
    argv = readme_compare_argv()
    assert "--model" not in argv and all(not a.endswith(".json") for a in argv)
    out_dir = tmp_path / "cmp"
    rc = cli.main([*argv, "--tokenizer", make_tokenizer_dir(tmp_path / "tok"), "--result-dir", str(out_dir),
                   "--port-base", str(_free_port_pair()), "--server-timeout", "60", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert [m for m, _ in started] == [DEFAULT_MODEL, DEFAULT_MODEL]
    assert started[1][1]["speculative_config"]["method"] == "ngram" and "name" not in started[1][1]
    data = json.loads((out_dir / "compare.json").read_text())
    assert [(r["config"], r["concurrency"]) for r in data["rows"]] == [
        ("base", 1), ("ngram", 1), ("base", 4), ("ngram", 4)]
    assert data["num_prompts"] == 8 and data["concurrencies"] == [1, 4]
    assert all(r["failed"] == 0 for r in data["rows"])


def test_inline_config_names_and_errors(tmp_path):
    from tandem.bench.compare_config import CompareError, load_config

    assert load_config('{"name": "mine", "max_num_seqs": 4}').name == "mine"
    assert load_config('{"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}').name == "ngram"
    assert load_config('{"speculative_config": "{\\"method\\": \\"ngram\\"}"}').name == "ngram"
    assert load_config("{}").name == "base" and load_config(' {"max_num_seqs": 4}').options == {"max_num_seqs": 4}
    f = tmp_path / "fast.json"
    f.write_text('{"max_num_seqs": 4}')
    assert load_config(str(f)).name == "fast"
    with pytest.raises(CompareError, match="neither a file nor valid JSON"):
        load_config('{"name": ')
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(CompareError, match="must be a JSON object"):
        load_config(str(tmp_path / "list.json"))


def test_bench_serve_logs_no_line_per_request_but_keeps_errors(fake_server, tmp_path, capsys, caplog):
    import logging

    base_url, _ = fake_server
    saved = {name: logging.getLogger(name).level for name in cli.HTTP_REQUEST_LOGGERS}
    caplog.set_level(logging.INFO)
    try:
        rc = cli.main(["serve", "--base-url", base_url, "--tokenizer", make_tokenizer_dir(tmp_path / "tok"),
                       "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
                       "--num-prompts", "5", "--disable-tqdm"])
        assert rc == 0
        assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore", "uvicorn"))]
        logging.getLogger("httpx").error("connection refused")  # errors still reach the console
        assert [r.getMessage() for r in caplog.records if r.name == "httpx"] == ["connection refused"]
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
    # without the quieting, httpx does log one INFO line per request (what the test guards against)
    caplog.clear()
    import httpx
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    httpx.get(base_url + "/health")
    assert any(r.name == "httpx" and r.levelno == logging.INFO for r in caplog.records)


@pytest.mark.parametrize("dataset", ["humaneval", "sharegpt"])
def test_readme_bench_serve_command_runs_with_a_fresh_cache(fake_server, tmp_path, monkeypatch, capsys, dataset):
    """The README's ``tandem bench serve`` line as written (its dataset, then ShareGPT, the other one
    the README names), pointed at a fake server, with an empty tandem cache: the datasets come with
    the README's install, nothing is fetched."""
    import re
    import shlex

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "fresh-cache"))
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    line = next(m for m in re.findall(r"^tandem bench serve .*$", readme, re.M) if "--dataset-name" in m)
    argv = shlex.split(line)[2:]  # after "tandem bench"
    i = argv.index("--port")
    del argv[i:i + 2]
    argv[argv.index("--dataset-name") + 1] = dataset
    argv[argv.index("--num-prompts") + 1] = "4"
    base_url, _ = fake_server
    rc = cli.main([*argv, "--base-url", base_url, "--tokenizer", make_tokenizer_dir(tmp_path / "tok"),
                   "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"{'Successful requests:':<40} 4" in out
    assert not (tmp_path / "fresh-cache").exists() or not any((tmp_path / "fresh-cache").iterdir())
