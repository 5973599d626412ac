"""``bench serve``: drive an OpenAI-compatible streaming server and measure it (vLLM-compatible).

Flow of ``run_benchmark``: optional initial single-request test (fails fast on bad arguments) →
scrape ``/metrics`` → send every request at its arrival time (``arrivals.py``), at most
``max_concurrency`` in flight → scrape ``/metrics`` again → ``compute_metrics`` + the speculative
decoding section from counter deltas.

Invariants:
- ``send_request`` never raises for a failed request (HTTP status, connection error, timeout, bad
  stream): it returns a ``RequestResult`` with ``success=False`` and ``error`` set. Only
  cancellation propagates.
- Cancellation (Ctrl-C under ``asyncio.run`` cancels the main task) stops the run, cancels the
  requests in flight and returns a ``BenchmarkResult`` with ``interrupted=True`` measured over the
  requests that had finished; unfinished ones are left out of every metric.
- Speculative-decoding counters are read from Prometheus text, ``tandem:`` names first, else
  ``vllm:`` (so the same command measures vLLM). Deltas cover the benchmark only (the initial test is
  before the first scrape), but a shared server's other traffic would be counted too.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from tandem.bench.arrivals import iter_arrivals
from tandem.bench.datasets import SampleRequest
from tandem.bench.metrics import BenchmarkMetrics, RequestResult, compute_metrics
from tandem.config.env import openai_api_key
from tandem.errors import TandemError

BACKENDS = ("openai", "openai-chat", "vllm")  # "vllm" is vLLM's alias of the completions client
DEFAULT_ENDPOINTS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
SPEC_METRIC_PREFIXES = ("tandem:", "vllm:")
SPEC_COUNTERS = {
    "spec_decode_num_drafts": "num_drafts",
    "spec_decode_num_draft_tokens": "num_draft_tokens",
    "spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


class BenchmarkError(TandemError, RuntimeError):
    """The benchmark cannot run (server unreachable, initial test failed, bad arguments)."""


@dataclass(frozen=True)
class ClientConfig:
    """How each request is sent. ``api_url`` is the full endpoint URL."""

    api_url: str
    model: str
    backend: str = "openai"
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 6 * 3600.0

    @property
    def is_chat(self) -> bool:
        return self.backend == "openai-chat"


def build_payload(cfg: ClientConfig, req: SampleRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": cfg.model,
        "temperature": cfg.temperature,
        "max_tokens": req.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.is_chat:
        messages = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": req.prompt}]
        payload["messages"] = messages
    else:
        if not isinstance(req.prompt, str):
            raise BenchmarkError(
                "chat-message prompts need the chat endpoint: pass --backend openai-chat"
            )
        payload["prompt"] = req.prompt
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(cfg.extra_body)
    return payload


def _headers() -> dict[str, str]:
    key = openai_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, cfg: ClientConfig, req: SampleRequest) -> RequestResult:
    """Stream one request and time it. Never raises except on cancellation."""
    result = RequestResult(prompt_len=req.prompt_len)
    pieces: list[str] = []
    st = time.perf_counter()
    result.start_time = st
    ttft: float | None = None
    last_text = first_choice = last_choice = None
    try:
        payload = build_payload(cfg, req)
        async with client.stream("POST", cfg.api_url, json=payload, headers=_headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:1000]}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue  # blank separators, SSE comments/pings, event:/id: fields
                data_str = line[5:].strip()
                if data_str == "[DONE]":
                    break
                data = json.loads(data_str)
                if data.get("error") and not data.get("choices"):
                    err = data["error"]
                    result.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return result
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                choices = data.get("choices") or []
                if not choices:
                    continue
                now = time.perf_counter()
                first_choice = now if first_choice is None else first_choice
                last_choice = now
                text = _chunk_text(choices[0], cfg.is_chat)
                if not text:
                    continue  # role-only / finish-only / empty-text chunk: not a token arrival
                if ttft is None:
                    ttft = now - st
                else:
                    result.itl.append(now - last_text)  # type: ignore[operator]
                last_text = now
                pieces.append(text)
    except Exception as exc:  # noqa: BLE001 - any failure is this request's, never the run's
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result
    result.generated_text = "".join(pieces)
    if ttft is not None:
        result.ttft, result.latency, result.success = ttft, last_text - st, True  # type: ignore[operator]
    elif first_choice is not None and (result.output_tokens or 0) > 0:
        # Tokens whose text is empty (special tokens): time them by the chunks that carried them.
        result.ttft, result.latency, result.success = first_choice - st, last_choice - st, True  # type: ignore[operator]
    else:
        result.error = "Never received a valid chunk to calculate TTFT; this request is counted as failed"
    return result


# --------------------------------------------------------------------------------------------
# /metrics scraping → speculative decoding section
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative counters as read from one scrape (summed over label sets except position)."""

    prefix: str
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_pos: dict[int, float]


@dataclass
class SpecDecodeStats:
    """Counter deltas over the run. Rates are in percent; ``acceptance_length`` is τ."""

    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None  # 100 · accepted / draft tokens
    acceptance_length: float | None  # τ = 1 + accepted / drafts
    per_position_acceptance_rates: list[float]  # 100 · accepted at position i / drafts
    metrics_prefix: str = "tandem:"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_spec_decode_counters(text: str) -> SpecDecodeCounters | None:
    """Speculative-decoding counters from Prometheus text; None when the server exports none."""
    by_prefix: dict[str, dict[str, float]] = {p: defaultdict(float) for p in SPEC_METRIC_PREFIXES}
    per_pos: dict[str, dict[int, float]] = {p: defaultdict(float) for p in SPEC_METRIC_PREFIXES}
    seen: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    for family in families:
        for sample in family.samples:
            prefix = next((p for p in SPEC_METRIC_PREFIXES if sample.name.startswith(p)), None)
            if prefix is None or not sample.name.endswith("_total"):
                continue
            base = sample.name[len(prefix) : -len("_total")]
            if base in SPEC_COUNTERS:
                by_prefix[prefix][SPEC_COUNTERS[base]] += sample.value
                seen.add(prefix)
            elif base == SPEC_PER_POS and "position" in sample.labels:
                try:
                    per_pos[prefix][int(sample.labels["position"])] += sample.value
                except ValueError:
                    continue
                seen.add(prefix)
    for prefix in SPEC_METRIC_PREFIXES:
        if prefix in seen:
            c = by_prefix[prefix]
            return SpecDecodeCounters(
                prefix=prefix,
                num_drafts=c["num_drafts"],
                num_draft_tokens=c["num_draft_tokens"],
                num_accepted_tokens=c["num_accepted_tokens"],
                accepted_per_pos=dict(per_pos[prefix]),
            )
    return None


def spec_decode_delta(before: SpecDecodeCounters | None, after: SpecDecodeCounters | None) -> SpecDecodeStats | None:
    if before is None or after is None or before.prefix != after.prefix:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    positions = sorted(set(after.accepted_per_pos) | set(before.accepted_per_pos))
    per_pos = [
        100.0 * (after.accepted_per_pos.get(i, 0.0) - before.accepted_per_pos.get(i, 0.0)) / drafts
        for i in range(positions[-1] + 1)
    ] if positions and drafts > 0 else []
    return SpecDecodeStats(
        num_drafts=int(round(drafts)),
        draft_tokens=int(round(draft_tokens)),
        accepted_tokens=int(round(accepted)),
        acceptance_rate=100.0 * accepted / draft_tokens if draft_tokens > 0 else None,
        acceptance_length=1.0 + accepted / drafts if drafts > 0 else None,
        per_position_acceptance_rates=per_pos,
        metrics_prefix=after.prefix,
    )


async def scrape_spec_counters(client: httpx.AsyncClient, base_url: str, timeout_s: float = 10.0) -> SpecDecodeCounters | None:
    """GET {base_url}/metrics; None if absent, unreachable or without speculative counters."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", headers=_headers(), timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_spec_decode_counters(resp.text)


async def get_default_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id of GET {base_url}/v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.get(url, headers=_headers())
            resp.raise_for_status()
            return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchmarkError(f"could not read the served model from {url} ({exc}); pass --model") from exc


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


@dataclass
class BenchmarkResult:
    metrics: BenchmarkMetrics
    duration: float
    results: list[RequestResult]  # finished requests, in request order
    spec_decode: SpecDecodeStats | None
    interrupted: bool = False
    num_unfinished: int = 0  # requests not sent or cancelled in flight (only when interrupted)


async def run_benchmark(
    requests: Sequence[SampleRequest],
    client_config: ClientConfig,
    base_url: str,
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    tokenizer: Any | None = None,
    selected_percentiles: Sequence[float] = (99,),
    goodput: dict[str, float] | None = None,
    disable_tqdm: bool = False,
    initial_test: bool = True,
    quiet: bool = False,
) -> BenchmarkResult:
    """Run the workload once; see the module docstring for the flow and invariants."""
    if not requests:
        raise BenchmarkError("no requests to send")
    if max_concurrency is not None and max_concurrency < 1:
        raise BenchmarkError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if not client_config.is_chat and any(not isinstance(r.prompt, str) for r in requests):
        raise BenchmarkError("the dataset has chat-message prompts: pass --backend openai-chat")
    timeout = httpx.Timeout(client_config.request_timeout_s, connect=60.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    log = (lambda *a: None) if quiet else print  # noqa: E731
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if initial_test:
            log("Starting initial single prompt test run...")
            test = await send_request(client, client_config, requests[0])
            if not test.success:
                raise BenchmarkError(
                    "initial test run failed - make sure the benchmark arguments are correct. "
                    f"Error: {test.error}"
                )
            log("Initial test run completed. Starting main benchmark run...")
        before = await scrape_spec_counters(client, base_url)
        log(f"Traffic request rate: {request_rate}")
        log(f"Burstiness factor: {burstiness}" + (" (Poisson process)" if burstiness == 1.0 else ""))
        log(f"Maximum request concurrency: {max_concurrency}")

        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        finished: dict[int, RequestResult] = {}
        pbar = tqdm(total=len(requests), disable=disable_tqdm)

        async def one(index: int, req: SampleRequest) -> None:
            if semaphore is None:
                res = await send_request(client, client_config, req)
            else:
                async with semaphore:
                    res = await send_request(client, client_config, req)
            finished[index] = res
            pbar.update(1)

        tasks: list[asyncio.Task[None]] = []
        interrupted = False
        start = time.perf_counter()
        try:
            async for index, req in iter_arrivals(list(enumerate(requests)), request_rate, burstiness, seed):
                tasks.append(asyncio.create_task(one(index, req)))
            await asyncio.gather(*tasks)
        except (asyncio.CancelledError, KeyboardInterrupt):
            interrupted = True
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
        pbar.close()
        after = await scrape_spec_counters(client, base_url, timeout_s=5.0 if interrupted else 10.0)

    results = [finished[i] for i in sorted(finished)]
    if interrupted:
        log(f"\nInterrupted: reporting the {len(results)} of {len(requests)} requests that finished.")
    metrics = compute_metrics(results, duration, selected_percentiles, goodput=goodput, tokenizer=tokenizer)
    return BenchmarkResult(
        metrics=metrics,
        duration=duration,
        results=results,
        spec_decode=spec_decode_delta(before, after),
        interrupted=interrupted,
        num_unfinished=len(requests) - len(results),
    )


# --------------------------------------------------------------------------------------------
# Result JSON (vLLM's field names)
# --------------------------------------------------------------------------------------------


def result_to_json(
    result: BenchmarkResult,
    *,
    backend: str,
    model_id: str,
    tokenizer_id: str | None,
    num_prompts: int,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    label: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    d: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": backend,
        "endpoint_type": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "duration": result.duration,
    }
    d.update(result.metrics.to_dict())
    d.update(
        {
            "input_lens": [r.prompt_len for r in result.results],
            "output_lens": result.metrics.output_lens,
            "ttfts": [r.ttft for r in result.results],
            "itls": [r.itl for r in result.results],
            "generated_texts": [r.generated_text for r in result.results],
            "errors": [r.error for r in result.results],
            "spec_decode": result.spec_decode.to_dict() if result.spec_decode else None,
            "interrupted": result.interrupted,
        }
    )
    if extra:
        d.update(extra)
    return d


def default_result_filename(label: str, request_rate: float, max_concurrency: int | None, model_id: str, date: str) -> str:
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{label}-{request_rate}qps{conc}-{model_id.split('/')[-1]}-{date}.json"


def save_result_json(data: dict[str, Any], result_dir: str | Path | None, filename: str | None) -> Path:
    name = filename or default_result_filename(
        data.get("label") or data["backend"],
        float("inf") if data["request_rate"] == "inf" else data["request_rate"],
        data["max_concurrency"],
        data["model_id"],
        data["date"],
    )
    path = Path(result_dir) / name if result_dir else Path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path
