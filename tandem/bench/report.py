"""The ``bench serve`` result table, line for line in vLLM's format, plus a speculative section.

Latency sections are printed for the metrics selected with ``--percentile-metrics`` (vLLM's
default ``ttft,tpot,itl``; add ``e2el`` for end-to-end latency), each with mean, median and the
``--metric-percentiles`` percentiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tandem.bench.metrics import BenchmarkMetrics, percentile_label
from tandem.bench.serve import SpecDecodeStats

WIDTH = 50
METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def _row(label: str, value: object, fmt: str = "") -> str:
    return "{:<40} {:<10}".format(label, format(value, fmt) if fmt else value)


def _title(text: str, fill: str) -> str:
    return "{s:{c}^{n}}".format(s=text, c=fill, n=WIDTH)


def format_spec_decode(stats: SpecDecodeStats) -> list[str]:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    lines = [
        _title("Speculative Decoding", "-"),
        _row("Acceptance rate (%):", pct(stats.acceptance_rate)),
        _row("Acceptance length:", pct(stats.acceptance_length)),
        _row("Drafts:", stats.num_drafts),
        _row("Draft tokens:", stats.draft_tokens),
        _row("Accepted tokens:", stats.accepted_tokens),
    ]
    if stats.per_position_acceptance_rates:
        lines.append("Per-position acceptance (%):")
        lines += [_row(f"  Position {i}:", r, ".2f") for i, r in enumerate(stats.per_position_acceptance_rates)]
    return lines


def format_report(
    metrics: BenchmarkMetrics,
    duration: float,
    selected_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    spec_decode: SpecDecodeStats | None = None,
    interrupted: bool = False,
    num_unfinished: int = 0,
) -> str:
    lines = [_title(" Serving Benchmark Result ", "=")]
    if interrupted:
        lines.append(_row("Interrupted; unfinished requests:", num_unfinished))
    lines += [
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if math.isfinite(request_rate):
        lines.append(_row("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [
        _row("Benchmark duration (s):", duration, ".2f"),
        _row("Total input tokens:", metrics.total_input),
        _row("Total generated tokens:", metrics.total_output),
        _row("Request throughput (req/s):", metrics.request_throughput, ".2f"),
    ]
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput, ".2f"))
    lines += [
        _row("Output token throughput (tok/s):", metrics.output_throughput, ".2f"),
        _row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f"),
        _row("Peak concurrent requests:", metrics.max_concurrent_requests),
        _row("Total Token throughput (tok/s):", metrics.total_token_throughput, ".2f"),
    ]
    for key in ("ttft", "tpot", "itl", "e2el"):
        if key not in selected_metrics:
            continue
        short, header = METRIC_HEADERS[key]
        lines += [
            _title(header, "-"),
            _row(f"Mean {short} (ms):", getattr(metrics, f"mean_{key}_ms"), ".2f"),
            _row(f"Median {short} (ms):", getattr(metrics, f"median_{key}_ms"), ".2f"),
        ]
        for p, value in getattr(metrics, f"percentiles_{key}_ms"):
            lines.append(_row(f"P{percentile_label(p)} {short} (ms):", value, ".2f"))
    if spec_decode is not None:
        lines += format_spec_decode(spec_decode)
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def print_report(*args: object, **kwargs: object) -> None:
    print(format_report(*args, **kwargs))  # type: ignore[arg-type]
