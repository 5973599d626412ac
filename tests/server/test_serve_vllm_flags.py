"""``tandem serve`` takes a vLLM launch script's flags (docs/vllm_compat.md): --model, --disable-log-requests, …"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import ensure_chat_template, post
from tiny_models import write_tiny_hf_checkpoint

from tandem.cli import build_parser
from tandem.errors import TandemError
from tandem.loader.registry import DEFAULT_MODEL
from tandem.server.cli import add_serve_args, build_server, main, resolve_model_arg

SMALL = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory-bytes", str(16 << 20)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_hf_checkpoint(tmp_path_factory.mktemp("vllm_flags"), family="llama")
    ensure_chat_template(path)
    return path


def serve_ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


# ---- --model --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,model", [
    (["m"], "m"), (["--model", "m"], "m"), (["m", "--model", "m"], "m"), ([], DEFAULT_MODEL),
])
def test_model_as_flag_or_positional(argv: list[str], model: str) -> None:
    assert resolve_model_arg(serve_ns(*argv)) == model
    assert resolve_model_arg(build_parser().parse_args(["serve", *argv])) == model


def test_two_different_models_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TandemError, match="two different models given: 'a' and --model 'b'"):
        resolve_model_arg(serve_ns("a", "--model", "b"))
    assert main(["a", "--model", "b", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: two different models given: 'a' and --model 'b'"]


def test_model_flag_serves_that_model(ckpt: Path) -> None:
    app, ae = build_server(serve_ns("--model", str(ckpt), *SMALL))
    try:
        r = post(app, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "model": str(ckpt)})
        assert r.status_code == 200, r.text
    finally:
        ae.shutdown()


# ---- --metrics-prefix -------------------------------------------------------------------------------------
def test_metrics_prefix_vllm_serves_vllm_names_only(ckpt: Path) -> None:
    assert serve_ns().metrics_prefix == "tandem"
    app, ae = build_server(serve_ns(str(ckpt), "--metrics-prefix", "vllm", *SMALL))
    try:
        assert post(app, "/v1/completions", {"prompt": "hello", "max_tokens": 3}).status_code == 200
        text = asyncio.run(_get(app, "/metrics"))
    finally:
        ae.shutdown()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "vllm:generation_tokens_total" in names and "vllm:time_to_first_token_seconds_count" in names
    assert all(n.startswith("vllm:") for n in names) and "tandem:" not in text


def test_metrics_prefix_other_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serve_ns("--metrics-prefix", "sglang")
    assert "invalid choice: 'sglang'" in capsys.readouterr().err


async def _get(app: object, path: str) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get(path)
    assert r.status_code == 200
    return r.text


# ---- a vLLM launch script's flags ---------------------------------------------------------------------------
def test_disable_log_requests_is_accepted() -> None:
    assert serve_ns("--disable-log-requests").disable_log_requests is True
    assert serve_ns().disable_log_requests is False
    assert build_parser().parse_args(["serve", "m", "--disable-log-requests"]).disable_log_requests


def test_a_vllm_launch_script_starts(ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    ns = serve_ns("--model", str(ckpt), *SMALL, "--host", "0.0.0.0", "--port", "8001", "--disable-log-requests",
                  "--trust-remote-code", "--swap-space", "4", "-tp", "1", "--pipeline-parallel-size", "1",
                  "--enforce-eager", "--enable-chunked-prefill", "--enable-prefix-caching", "--seed", "0",
                  "--kv-cache-dtype", "auto", "--gpu-memory-utilization", "0.9", "--max-num-seqs", "8")
    with caplog.at_level(logging.WARNING):
        app, ae = build_server(ns)
    try:
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 2
        assert warned[0].startswith("trust_remote_code: tandem runs no remote code")
        assert warned[1].startswith("swap_space: tandem has no CPU swap space")
        r = post(app, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "model": str(ckpt)})
        assert r.status_code == 200, r.text
    finally:
        ae.shutdown()


@pytest.mark.parametrize("flags,line", [
    (["-tp", "2"], "error: tensor_parallel_size: tandem runs a model on one device; --tensor-parallel-size (-tp) 2 "
                   "is not supported (allowed: 1)"),
    (["--pipeline-parallel-size", "4"], "error: pipeline_parallel_size: tandem runs a model on one device; "
                                        "--pipeline-parallel-size (-pp) 4 is not supported (allowed: 1)"),
    (["--quantization", "fp8"], "error: quantization: quantization method 'fp8' is not supported by tandem"),
    (["--kv-cache-dtype", "fp8_e4m3"], "error: kv_cache_dtype: --kv-cache-dtype fp8_e4m3 is not supported"),
    (["--skip-tokenizer-init"], "error: skip_tokenizer_init: the server needs the tokenizer"),
])
def test_refused_flags_exit_2_with_one_line(ckpt: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                            line: str) -> None:
    assert main([str(ckpt), *SMALL, "--port", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
