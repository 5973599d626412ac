"""Argument parsing for ``tandem bench`` (vLLM's flag names): ``serve`` and ``compare`` here, the offline
``latency`` and ``throughput`` (in-process engine, no server) in :mod:`tandem.bench.offline`.

``tandem/cli.py`` builds ``tandem bench`` and calls ``add_bench_subparsers(bench_subparsers)``,
then ``args.func(args)`` (returns an exit code). ``python -m tandem.bench.cli serve ...`` also works
standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from typing import Any

from tandem.bench.workload import load_tokenizer, sample_from_args
from tandem.errors import ConfigError, TandemError

DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
# One INFO line per HTTP request (httpx's "HTTP Request: POST ..." and uvicorn's access log) would
# flood a benchmark's console; their warnings and errors still show.
HTTP_REQUEST_LOGGERS = ("httpx", "httpcore", "uvicorn.access")


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def quiet_http_request_logs() -> None:
    """Raise the per-request HTTP loggers to WARNING, unless someone set their level explicitly."""
    for name in HTTP_REQUEST_LOGGERS:
        lg = logging.getLogger(name)
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.WARNING)


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """``["ttft:100", "tpot:50"]`` → {"ttft": 100.0, "tpot": 50.0} (ms)."""
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ConfigError("--goodput", f"takes KEY:MS with KEY in ttft,tpot,e2el; got {item!r}")
        try:
            out[key] = float(value)
        except ValueError as exc:
            raise ConfigError("--goodput", f"{value!r} in {item!r} is not a number") from exc
    return out


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise ConfigError("--metric-percentiles", f"comma-separated numbers expected, got {text!r}") from exc
    if not values or any(not 0 <= v <= 100 for v in values):
        raise ConfigError("--metric-percentiles", f"values must be in [0, 100], got {text!r}")
    return values


def _add_dataset_args(p: argparse.ArgumentParser, default_num_prompts: int) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="sharegpt",
                   help="sharegpt | humaneval | random | prefix-repetition | custom | edit | repeated-task "
                        "(default: sharegpt)")
    g.add_argument("--dataset-path", default=None,
                   help="file for custom (JSONL); optional local copy for sharegpt/humaneval")
    g.add_argument("--num-prompts", type=int, default=default_num_prompts)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length instead of the ShareGPT reply's length")
    g.add_argument("--humaneval-output-len", type=int, default=128)
    g.add_argument("--custom-output-len", type=int, default=256,
                   help="output length for custom lines without output_tokens")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--edit-output-len", type=int, default=256, help="edit and repeated-task output length")
    g.add_argument("--repeated-task-repeats", type=int, default=4,
                   help="repeated-task: times each task is asked (with small changes)")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    from tandem.bench.serve import BACKENDS

    p.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer id/dir or .gguf file (default: the model)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second; inf (default) sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps; 1 = Poisson")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")


# --------------------------------------------------------------------------------------------
# bench serve
# --------------------------------------------------------------------------------------------


def run_serve(args: argparse.Namespace) -> int:
    """Entry for ``bench serve``. Ctrl-C during the run prints what was measured (exit code 130)."""
    quiet_http_request_logs()
    try:
        return _run_serve(args)
    except KeyboardInterrupt:
        print("\nInterrupted before the benchmark started; nothing measured.", file=sys.stderr)
        return 130


def _run_serve(args: argparse.Namespace) -> int:
    from tandem.bench.metrics import METRIC_NAMES
    from tandem.bench.report import print_report
    from tandem.bench.serve import (
        DEFAULT_ENDPOINTS,
        ClientConfig,
        get_default_model,
        result_to_json,
        run_benchmark,
        save_result_json,
    )

    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in selected if m not in METRIC_NAMES]
    if bad:
        raise ConfigError("--percentile-metrics", f"unknown {bad}", allowed=METRIC_NAMES)
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_url = base_url + (args.endpoint or DEFAULT_ENDPOINTS[args.backend])
    model_id = args.model or asyncio.run(get_default_model(base_url))
    tokenizer_id = args.tokenizer or model_id
    tokenizer = load_tokenizer(tokenizer_id, args.trust_remote_code)
    requests = sample_from_args(args, tokenizer)
    client = ClientConfig(
        api_url=api_url,
        model=args.served_model_name or model_id,
        backend=args.backend,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout,
    )
    result = asyncio.run(
        run_benchmark(
            requests, client, base_url,
            request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, seed=args.seed, tokenizer=tokenizer,
            selected_percentiles=percentiles, goodput=goodput, disable_tqdm=args.disable_tqdm,
            initial_test=not args.skip_initial_test,
        )
    )
    print_report(
        result.metrics, result.duration, selected,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate,
        spec_decode=result.spec_decode, interrupted=result.interrupted,
        num_unfinished=result.num_unfinished,
    )
    if args.save_result:
        data = result_to_json(
            result, backend=args.backend, model_id=model_id, tokenizer_id=tokenizer_id,
            num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, label=args.label,
            extra={"dataset_name": args.dataset_name, "seed": args.seed},
        )
        path = save_result_json(data, args.result_dir, args.result_filename)
        print(f"Saved result to {path}")
    return 130 if result.interrupted else 0


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="benchmark a running OpenAI-compatible server (vLLM bench serve compatible)",
        description="Benchmark online serving: stream requests to a running server and report "
                    "TTFT/TPOT/ITL/E2EL, throughput and speculative-decoding acceptance from /metrics.",
    )
    p.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/completions, or /v1/chat/completions for openai-chat)")
    p.add_argument("--model", default=None, help="model id (default: first of GET /v1/models)")
    p.add_argument("--served-model-name", default=None, help="model name sent in requests (default: --model)")
    _add_client_args(p)
    _add_dataset_args(p, default_num_prompts=1000)
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--percentile-metrics", default=DEFAULT_PERCENTILE_METRICS,
                   help="comma-separated from ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help='comma-separated, e.g. "25,50,99"')
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    p.add_argument("--skip-initial-test", action="store_true", help="skip the single-request test run")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None, help="prefix of the result file name (default: backend)")
    p.set_defaults(func=run_serve)
    return p


# --------------------------------------------------------------------------------------------
# bench compare
# --------------------------------------------------------------------------------------------


def _run_compare(args: argparse.Namespace) -> int:
    from tandem.bench.compare import run_compare

    quiet_http_request_logs()
    return run_compare(args)


def add_compare_parser(subparsers: Any) -> argparse.ArgumentParser:
    from tandem.loader.registry import DEFAULT_MODEL

    p = subparsers.add_parser(
        "compare", help="start tandem serve per config and compare speculative configs",
        description="For each --config (JSON dict of tandem serve options) start a fresh server, "
                    "run the identical workload at each --concurrency, and print speedups, "
                    "acceptance (tau, alpha) and engine efficiency eta; writes JSON and PNG plots.",
    )
    p.add_argument("--config", action="append", required=True, metavar="FILE.json|JSON",
                   help="a JSON file or an inline JSON object of tandem serve options (plus \"name\"); "
                        "repeat; the first config is the baseline")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model for every config without its own \"model\" (default: {DEFAULT_MODEL})")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated max concurrency levels")
    p.add_argument("--result-dir", default=None, help="default: bench_results/compare-DATE")
    p.add_argument("--port-base", type=int, default=8100, help="config i's server listens on port-base + i")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    _add_client_args(p)
    _add_dataset_args(p, default_num_prompts=200)
    p.set_defaults(func=_run_compare)
    return p


def add_bench_subparsers(subparsers: Any) -> None:
    """Add ``serve``, ``compare``, ``latency``, ``throughput`` and ``sweep`` to ``tandem bench``; each sets ``func``."""
    add_serve_parser(subparsers)
    add_compare_parser(subparsers)
    # Offline benchmarks (in-process engine, no server).
    from tandem.bench.offline import add_latency_parser, add_throughput_parser

    add_latency_parser(subparsers)
    add_throughput_parser(subparsers)
    from tandem.bench.sweep import add_sweep_parser

    add_sweep_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m tandem.bench.cli {serve,compare,latency,throughput,sweep} ...``."""
    parser = argparse.ArgumentParser(prog="tandem bench")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_bench_subparsers(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
