"""Benchmark arithmetic on synthetic timings: serving metrics, arrivals, /metrics parsing, the
report table, and bench compare's table / η / plots (fake per-config results, no servers)."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from tandem.bench import arrivals, compare, compare_config, compare_output, compare_table, report
from tandem.bench.metrics import RequestResult, compute_metrics
from tandem.bench.serve import SpecDecodeCounters, parse_spec_decode_counters, spec_decode_delta
from tandem.errors import ConfigError

# ---------------------------------------------------------------- compute_metrics


def _results() -> list[RequestResult]:
    a = RequestResult(success=True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.05, 0.05, 0.05],
                      latency=0.25, start_time=0.0, generated_text="a b c d")
    # B streams 5 tokens in 2 chunks (e.g. speculative steps): one ITL gap, TPOT over tokens.
    b = RequestResult(success=True, prompt_len=20, output_tokens=5, ttft=0.3, itl=[0.1],
                      latency=0.4, start_time=0.5, generated_text="x")
    c = RequestResult(success=False, error="HTTP 500", prompt_len=30)
    d = RequestResult(success=True, prompt_len=5, output_tokens=1, ttft=0.2, itl=[], latency=0.2,
                      start_time=1.2, generated_text="z")
    return [a, b, c, d]


def test_metric_arithmetic():
    m = compute_metrics(_results(), duration=2.0, selected_percentiles=[50, 90, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 35 and m.total_output == 10
    assert m.output_lens == [4, 5, 0, 1]
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(22.5)
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert m.median_ttft_ms == pytest.approx(200.0)
    assert m.std_ttft_ms == pytest.approx(np.std([100, 300, 200]))
    assert dict(m.percentiles_ttft_ms)[99] == pytest.approx(np.percentile([100, 300, 200], 99))
    assert dict(m.percentiles_ttft_ms)[50] == pytest.approx(200.0)
    # TPOT: A (0.25-0.1)/3 = 50 ms, B (0.4-0.3)/4 = 25 ms, D excluded (1 token).
    assert m.mean_tpot_ms == pytest.approx(37.5)
    assert m.median_tpot_ms == pytest.approx(37.5)
    assert m.mean_itl_ms == pytest.approx(62.5)  # gaps 50, 50, 50, 100
    assert dict(m.percentiles_itl_ms)[90] == pytest.approx(np.percentile([50, 50, 50, 100], 90))
    assert m.mean_e2el_ms == pytest.approx((250 + 400 + 200) / 3)
    # Peak: bucket 0 holds A's 4 chunks (1 token each) + B's 2 chunks (2.5 tokens each) = 9.
    assert m.max_output_tokens_per_s == pytest.approx(9.0)
    assert m.max_concurrent_requests == 2
    d = m.to_dict()
    assert d["p99_ttft_ms"] == pytest.approx(dict(m.percentiles_ttft_ms)[99])
    assert d["total_input_tokens"] == 35 and d["total_output_tokens"] == 10
    assert "p50_e2el_ms" in d and "output_lens" not in d


def test_goodput_and_retokenized_output_counts():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    results = _results()
    results[0].output_tokens = None  # no usage from the server → "a b c d" re-tokenized = 4
    m = compute_metrics(results, 2.0, goodput={"ttft": 250.0}, tokenizer=Tok())
    assert m.total_output == 10
    assert m.request_goodput == pytest.approx(1.0)  # A (100 ms) and D (200 ms) meet the SLO
    m = compute_metrics(results, 2.0, goodput={"tpot": 40.0, "ttft": 1000.0}, tokenizer=Tok())
    assert m.request_goodput == pytest.approx(1.0)  # B (25 ms) and D (TPOT 0) are good


def test_all_failed_is_not_a_crash():
    with pytest.warns(UserWarning):
        m = compute_metrics([RequestResult(error="boom")], 1.0)
    assert (m.completed, m.failed, m.total_output, m.mean_ttft_ms) == (0, 1, 0, 0.0)


def test_percentile_labels():
    m = compute_metrics(_results(), 1.0, selected_percentiles=[99.9])
    assert "p99.9_ttft_ms" in m.to_dict()


# ---------------------------------------------------------------- arrivals


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrival_statistics(burstiness):
    gaps = arrivals.inter_arrival_gaps(40_000, request_rate=8.0, burstiness=burstiness, seed=0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    again = arrivals.inter_arrival_gaps(40_000, request_rate=8.0, burstiness=burstiness, seed=0)
    assert np.array_equal(gaps, again)


def test_arrival_times_and_validation():
    t = arrivals.arrival_times(5, math.inf)
    assert np.array_equal(t, np.zeros(5))
    t = arrivals.arrival_times(4, 10.0, seed=1)
    assert t[0] == 0.0 and np.all(np.diff(t) > 0)
    with pytest.raises(ConfigError, match="request-rate"):
        arrivals.inter_arrival_gaps(3, 0.0)
    with pytest.raises(ConfigError, match="burstiness"):
        arrivals.inter_arrival_gaps(3, 1.0, burstiness=0.0)


def test_iter_arrivals_follows_schedule():
    items = list(range(8))
    expected = arrivals.arrival_times(8, 100.0, seed=3)

    async def collect():
        loop = asyncio.get_running_loop()
        start, seen = loop.time(), []
        async for item in arrivals.iter_arrivals(items, 100.0, seed=3):
            seen.append((item, loop.time() - start))
        return seen

    seen = asyncio.run(collect())
    assert [s[0] for s in seen] == items
    for (_, at), want in zip(seen, expected):
        assert at >= want - 1e-3 and at < want + 0.05


# ---------------------------------------------------------------- /metrics → speculative section

PROM = """# HELP {p}spec_decode_num_drafts Number of spec decoding drafts.
# TYPE {p}spec_decode_num_drafts_total counter
{p}spec_decode_num_drafts_total{{model_name="m"}} {d}
# TYPE {p}spec_decode_num_draft_tokens_total counter
{p}spec_decode_num_draft_tokens_total{{model_name="m"}} {dt}
# TYPE {p}spec_decode_num_accepted_tokens_total counter
{p}spec_decode_num_accepted_tokens_total{{model_name="m"}} {a}
# TYPE {p}spec_decode_num_accepted_tokens_per_pos_total counter
{p}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {a0}
{p}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} {a1}
# TYPE other_requests_total counter
other_requests_total 5
"""


def test_spec_counters_and_delta():
    before = parse_spec_decode_counters(PROM.format(p="tandem:", d=10, dt=20, a=12, a0=8, a1=4))
    after = parse_spec_decode_counters(PROM.format(p="tandem:", d=110, dt=220, a=162, a0=98, a1=64))
    assert before == SpecDecodeCounters("tandem:", 10, 20, 12, {0: 8, 1: 4})
    s = spec_decode_delta(before, after)
    assert (s.num_drafts, s.draft_tokens, s.accepted_tokens) == (100, 200, 150)
    assert s.acceptance_rate == pytest.approx(75.0)
    assert s.acceptance_length == pytest.approx(2.5)
    assert s.per_position_acceptance_rates == pytest.approx([90.0, 60.0])
    # vLLM's names work too; no counters / no endpoint → no section.
    v = parse_spec_decode_counters(PROM.format(p="vllm:", d=1, dt=2, a=1, a0=1, a1=0))
    assert v is not None and v.prefix == "vllm:"
    assert parse_spec_decode_counters("other_requests_total 5\n") is None
    assert spec_decode_delta(None, after) is None
    zero = spec_decode_delta(before, before)
    assert zero.acceptance_rate is None and zero.acceptance_length is None


def test_report_table_format():
    m = compute_metrics(_results(), 2.0, selected_percentiles=[99])
    before = SpecDecodeCounters("tandem:", 0, 0, 0, {})
    after = SpecDecodeCounters("tandem:", 100, 300, 150, {0: 80, 1: 50, 2: 20})
    text = report.format_report(m, 2.0, ["ttft", "tpot", "itl", "e2el"], max_concurrency=4,
                                spec_decode=spec_decode_delta(before, after))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for label, value in [
        ("Successful requests:", "3"), ("Failed requests:", "1"), ("Maximum request concurrency:", "4"),
        ("Benchmark duration (s):", "2.00"), ("Total input tokens:", "35"), ("Total generated tokens:", "10"),
        ("Request throughput (req/s):", "1.50"), ("Output token throughput (tok/s):", "5.00"),
        ("Peak output token throughput (tok/s):", "9.00"), ("Total Token throughput (tok/s):", "22.50"),
        ("Mean TTFT (ms):", "200.00"), ("Median TTFT (ms):", "200.00"), ("Mean TPOT (ms):", "37.50"),
        ("Mean ITL (ms):", "62.50"), ("Acceptance rate (%):", "50.00"), ("Acceptance length:", "2.50"),
        ("Drafts:", "100"), ("Draft tokens:", "300"), ("Accepted tokens:", "150"),
    ]:
        assert f"{label:<40} {value}" in text, label
    for header in ["---------------Time to First Token----------------",
                   "-----Time per Output Token (excl. 1st token)------",
                   "---------------Inter-token Latency----------------",
                   "----------------End-to-end Latency----------------",
                   "---------------Speculative Decoding---------------",
                   "Per-position acceptance (%):"]:
        assert header in lines, header
    assert any(line.startswith("P99 TTFT (ms):") for line in lines)
    assert f"{'  Position 2:':<40} 20.00" in text
    # Only the selected metrics get a section (vLLM default: ttft,tpot,itl).
    short = report.format_report(m, 2.0, ["ttft"])
    assert "Mean TPOT" not in short and "Speculative" not in short and "Request rate" not in short


# ---------------------------------------------------------------- bench compare arithmetic


def _configs():
    return [
        compare_config.CompareConfig.from_dict({"name": "base", "max_model_len": 2048}, "a"),
        compare_config.CompareConfig.from_dict(
            {"name": "ngram", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                     "prompt_lookup_max": 4}}, "b"),
        compare_config.CompareConfig.from_dict(
            {"name": "draft", "speculative_config": {"method": "draft_model", "model": "d",
                                                     "num_speculative_tokens": 2},
             "draft_cost_ratio": 0.1, "cost_v": 0.05}, "c"),
        compare_config.CompareConfig.from_dict(
            {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}, "nocost"),
    ]


def _spec(per_pos_frac, drafts=100):
    acc = sum(per_pos_frac) * drafts
    return {"num_drafts": drafts, "draft_tokens": drafts * len(per_pos_frac), "accepted_tokens": acc,
            "acceptance_rate": 100 * acc / (drafts * len(per_pos_frac)),
            "acceptance_length": 1 + acc / drafts,
            "per_position_acceptance_rates": [100 * p for p in per_pos_frac]}


def _runs():
    runs = {}
    for conc, base_tpot in ((1, 20.0), (8, 30.0)):
        runs[("base", conc)] = compare_table.RunSummary("base", conc, base_tpot, 50.0, 100.0 * conc, 10, 0)
        runs[("ngram", conc)] = compare_table.RunSummary("ngram", conc, base_tpot / 2, 55.0, 180.0 * conc, 10, 0,
                                                   _spec([0.8, 0.64, 0.512, 0.4096]))
        runs[("draft", conc)] = compare_table.RunSummary("draft", conc, base_tpot / 1.5, 60.0, 140.0 * conc, 10, 0,
                                                   _spec([0.5, 0.25]))
        runs[("nocost", conc)] = compare_table.RunSummary("nocost", conc, base_tpot, 60.0, 100.0 * conc, 9, 1,
                                                    _spec([0.5, 0.25]))
    return runs


def test_config_to_server_command():
    cfgs = _configs()
    assert cfgs[1].k == 4 and cfgs[1].cost_c == 0.0 and cfgs[1].method == "ngram"
    assert cfgs[2].cost_c == 0.1 and cfgs[2].cost_v == 0.05
    assert cfgs[3].name == "nocost" and cfgs[3].cost_c is None
    cmd = compare_config.server_command("smollm2-135m-instruct", 8123, cfgs[1].options)
    assert cmd[1:6] == ["-m", "tandem.serve", "smollm2-135m-instruct", "--port", "8123"]
    i = cmd.index("--speculative-config")
    assert json.loads(cmd[i + 1]) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert "--no-enable-prefix-caching" in cmd and "name" not in " ".join(cmd)
    cmd = compare_config.server_command("m", 1, {"enable_prefix_caching": True, "max_model_len": 2048,
                                          "enforce_eager": True, "x_list": [1, 2]})
    assert "--enable-prefix-caching" in cmd and "--no-enable-prefix-caching" not in cmd
    assert cmd[cmd.index("--max-model-len") + 1] == "2048" and "--enforce-eager" in cmd
    assert cmd[cmd.index("--x-list") + 1: cmd.index("--x-list") + 3] == ["1", "2"]


def test_alpha_and_cost_model():
    assert compare_table.estimate_alpha(0.8 + 0.64 + 0.512 + 0.4096, 4) == pytest.approx(0.8, abs=1e-9)
    assert compare_table.estimate_alpha(0.0, 4) == 0.0 and compare_table.estimate_alpha(5.0, 4) == 1.0
    assert compare_table.cost_model_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8**5) / 0.2)
    assert compare_table.cost_model_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert compare_table.cost_model_speedup(0.5, 2, 0.1, 0.05) == pytest.approx(1.75 / 1.25)


def test_compare_rows_table_and_eta():
    cfgs, runs = _configs(), _runs()
    rows = compare_table.compute_rows(cfgs, runs, [1, 8])
    assert [(r.concurrency, r.config) for r in rows][:4] == [(1, "base"), (1, "ngram"), (1, "draft"), (1, "nocost")]
    by = {(r.config, r.concurrency): r for r in rows}
    base = by[("base", 1)]
    assert base.speedup_tpot == 1.0 and base.efficiency == 1.0 and base.tau is None
    ng = by[("ngram", 1)]
    assert ng.speedup_tpot == pytest.approx(2.0) and ng.speedup_throughput == pytest.approx(1.8)
    assert ng.alpha == pytest.approx(0.8) and ng.tau == pytest.approx(1 + 2.3616)
    s = (1 - 0.8**5) / 0.2  # c = 0 (ngram), v = 0
    assert ng.model_speedup == pytest.approx(s) and ng.efficiency == pytest.approx(2.0 / s)
    dr = by[("draft", 8)]
    assert dr.alpha == pytest.approx(0.5) and dr.speedup_tpot == pytest.approx(1.5)
    assert dr.efficiency == pytest.approx(1.5 / (1.75 / (2 * 0.1 + 1 + 0.05)))
    nc = by[("nocost", 1)]
    assert nc.model_speedup is None and nc.efficiency is None and nc.failed == 1
    table = compare_table.format_table(rows, cfgs)
    assert "baseline: base" in table and "ngram: k=4, c=0" in table
    assert "nocost: k=2, c=unknown" in table and "S = (1 − α^(k+1))" in table
    assert f"{2.0 / s:.2f}" in table


def test_compare_plots_and_json(tmp_path):
    cfgs, runs = _configs(), _runs()
    paths = compare_output.write_plots(cfgs, runs, [1, 8], tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["per_position_acceptance.png", "throughput_vs_concurrency.png", "tpot_vs_concurrency.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert compare_output.aggregate_per_position([runs[("ngram", 1)], runs[("ngram", 8)]]) == pytest.approx(
        [80.0, 64.0, 51.2, 40.96])
    data = compare_output.results_json(cfgs, runs, compare_table.compute_rows(cfgs, runs, [1, 8]), {"model": "m"})
    text = json.dumps(data)
    assert json.loads(text)["rows"][1]["config"] == "ngram"
    with pytest.raises(compare_config.CompareError):
        compare.parse_concurrencies("1,0")
    assert compare.parse_concurrencies("1, 4,16") == [1, 4, 16]

