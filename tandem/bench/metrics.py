"""Per-request measurements and the aggregate serving metrics of ``bench serve`` (vLLM's names).

Timing definitions (all from the client's clock, ``time.perf_counter`` seconds):
- ``ttft``: request sent → first streamed chunk carrying generated text.
- ``itl``: gaps between consecutive text-carrying chunks. A chunk that carries several tokens (a
  server streaming all tokens accepted in one speculative step together, or a detokenizer holding
  back partial characters) counts as ONE gap, so with speculation ITL measures the time between
  *steps*, not between tokens; TPOT below is the per-token figure.
- ``latency`` (E2EL): request sent → last text-carrying chunk.
- TPOT per request = (latency − ttft) / (output_tokens − 1), only for requests with > 1 output token.

Output token counts come from the server's ``usage.completion_tokens`` (requested with
``stream_options.include_usage``) when it gives them, else from re-tokenizing the generated text
with the benchmark tokenizer (or, with no tokenizer, the number of chunks: a lower bound).

Peak output throughput: successful requests' tokens are put in 1-second buckets from the first
request's start; each request's tokens are spread evenly over its chunks (equal to vLLM's one token
per chunk when every chunk carries one token, and not undercounting multi-token chunks).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
MS = 1000.0


@dataclass
class RequestResult:
    """What the client measured for one request. Times in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int | None = None  # usage.completion_tokens; None → recount from text
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""

    @property
    def num_chunks(self) -> int:
        return len(self.itl) + 1 if self.success else 0


def percentile_label(p: float) -> str:
    """99 → '99', 99.9 → '99.9' (vLLM's p-word)."""
    return str(int(p)) if float(p).is_integer() else str(p)


@dataclass
class BenchmarkMetrics:
    """Aggregates over one run. Latency fields in milliseconds; percentiles as (p, value) pairs."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    percentiles_ttft_ms: list[tuple[float, float]]
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    percentiles_tpot_ms: list[tuple[float, float]]
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    percentiles_itl_ms: list[tuple[float, float]]
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    percentiles_e2el_ms: list[tuple[float, float]]
    output_lens: list[int] = field(default_factory=list)  # per request, 0 for failed ones

    def to_dict(self) -> dict[str, Any]:
        """Flat dict with vLLM's result-JSON names (``total_input_tokens``, ``p99_ttft_ms`` …)."""
        d = asdict(self)
        d["total_input_tokens"] = d.pop("total_input")
        d["total_output_tokens"] = d.pop("total_output")
        d.pop("output_lens")
        for name in METRIC_NAMES:
            for p, value in d.pop(f"percentiles_{name}_ms"):
                d[f"p{percentile_label(p)}_{name}_ms"] = value
        return d


def _stats(values_s: Sequence[float], percentiles: Sequence[float]) -> tuple[float, float, float, list[tuple[float, float]]]:
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * MS
    return (
        float(arr.mean()),
        float(np.median(arr)),
        float(arr.std()),
        [(float(p), float(np.percentile(arr, p))) for p in percentiles],
    )


def output_token_count(result: RequestResult, tokenizer: Any | None = None) -> int:
    if result.output_tokens is not None:
        return int(result.output_tokens)
    if tokenizer is not None:
        from tandem.bench.datasets import encode

        return len(encode(tokenizer, result.generated_text))
    return result.num_chunks


def _peak_buckets(ok: Sequence[RequestResult], counts: Sequence[int]) -> tuple[float, int]:
    """(max output tokens in any 1-s bucket, max requests active in any 1-s bucket)."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    t_end = max(r.start_time + r.latency for r in ok)
    n_buckets = int(np.ceil(t_end - t0)) + 1
    tokens = np.zeros(n_buckets)
    active = np.zeros(n_buckets, dtype=np.int64)
    for r, n_out in zip(ok, counts):
        chunk_times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        per_chunk = n_out / len(chunk_times)
        buckets = np.clip((chunk_times - t0).astype(np.int64), 0, n_buckets - 1)
        np.add.at(tokens, buckets, per_chunk)
        first = int(r.start_time - t0)
        last = min(int(r.start_time + r.latency - t0), n_buckets - 1)
        active[first : last + 1] += 1
    return float(tokens.max()), int(active.max())


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    selected_percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
    tokenizer: Any | None = None,
) -> BenchmarkMetrics:
    """Aggregate ``results`` of a run that lasted ``duration`` seconds.

    ``goodput``: SLOs in ms keyed by ``ttft`` / ``tpot`` / ``e2el``; a completed request is good
    when it meets all of them (a request with <= 1 output token has TPOT 0 for this purpose).
    """
    output_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    ok: list[RequestResult] = []
    ok_counts: list[int] = []
    total_input = 0
    for r in results:
        if not r.success:
            output_lens.append(0)
            continue
        n_out = output_token_count(r, tokenizer)
        output_lens.append(n_out)
        ok.append(r)
        ok_counts.append(n_out)
        total_input += r.prompt_len
        tpot = 0.0
        if n_out > 1:
            tpot = (r.latency - r.ttft) / (n_out - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(r.itl)
        ttfts.append(r.ttft)
        e2els.append(r.latency)

    completed = len(ok)
    if completed == 0 and results:
        warnings.warn("All requests failed; check the server and the benchmark arguments.", stacklevel=2)

    good = None
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        unknown = set(goodput) - set(per_metric)
        if unknown:
            raise ValueError(f"goodput keys must be ttft, tpot or e2el; got {sorted(unknown)}")
        good = sum(
            all(per_metric[k][i] * MS <= slo for k, slo in goodput.items()) for i in range(completed)
        )

    peak, max_active = _peak_buckets(ok, ok_counts)
    total_output = sum(output_lens)
    dur = duration if duration > 0 else float("inf")
    stats = {
        "ttft": _stats(ttfts, selected_percentiles),
        "tpot": _stats(tpots, selected_percentiles),
        "itl": _stats(itls, selected_percentiles),
        "e2el": _stats(e2els, selected_percentiles),
    }
    per_metric_fields: dict[str, Any] = {}
    for name, (mean, median, std, pcts) in stats.items():
        per_metric_fields.update(
            {
                f"mean_{name}_ms": mean,
                f"median_{name}_ms": median,
                f"std_{name}_ms": std,
                f"percentiles_{name}_ms": pcts,
            }
        )
    return BenchmarkMetrics(
        completed=completed,
        failed=len(results) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / dur,
        request_goodput=None if good is None else good / dur,
        output_throughput=total_output / dur,
        total_token_throughput=(total_input + total_output) / dur,
        max_output_tokens_per_s=peak,
        max_concurrent_requests=max_active,
        output_lens=output_lens,
        **per_metric_fields,
    )
