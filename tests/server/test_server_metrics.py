"""/metrics: names, labels, counters equal to the engine's, histograms from per-request timings."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from engine_utils import make_llm
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import write_tiny_hf_checkpoint

from tandem.engine.stats import EngineStats
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.server.api import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.cli import METRICS_PREFIXES as SERVE_METRICS_PREFIXES
from tandem.server.metrics import METRICS_PREFIXES, ServerMetrics

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
PROMPT = "abc abc abc abc abc abc abc abc abc"  # repetitive: n-gram drafts get proposed and accepted

COUNTERS = ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions", "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "spec_decode_draft_acceptance_rate"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds"]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels without model_name): value}; asserts model_name everywhere."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert s.labels.get("model_name") == "tiny", s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def value(smp: dict, name: str, **labels: str) -> float:
    return smp[("tandem:" + name, tuple(sorted(labels.items())))]


# ---- unit: ServerMetrics ----------------------------------------------------------------------------
class FakeEngine:
    def __init__(self) -> None:
        self.stats = EngineStats()
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0


def test_exposed_names_are_vllms_with_tandem_prefix() -> None:
    m = ServerMetrics("tiny", num_speculative_tokens=2)
    text = m.render().decode()
    names = {s[0] for s in samples(text)}
    for c in COUNTERS:
        assert f"tandem:{c}_total" in names, c
    for g in GAUGES:
        assert f"tandem:{g}" in names
    for h in HISTOGRAMS:
        assert {f"tandem:{h}_bucket", f"tandem:{h}_count", f"tandem:{h}_sum"} <= names
    assert not any(n.endswith("_total_total") for n in names)
    smp = samples(text)
    assert value(smp, "spec_decode_num_accepted_tokens_per_pos_total", position="1") == 0
    assert value(smp, "request_success_total", finished_reason="stop") == 0
    assert m.content_type.startswith("text/plain")


def _names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.parametrize("prefix,other", [("tandem", "vllm"), ("vllm", "tandem")])
def test_every_metric_under_the_chosen_prefix_and_none_under_the_other(prefix: str, other: str) -> None:
    text = ServerMetrics("tiny", num_speculative_tokens=2, prefix=prefix).render().decode()
    names = _names(text)
    assert names and all(n.startswith(f"{prefix}:") for n in names), sorted(names)
    assert f"{other}:" not in text  # not in any sample, HELP or TYPE line
    # the same series as the default, only the prefix differs
    default = _names(ServerMetrics("tiny", num_speculative_tokens=2).render().decode())
    assert {n.split(":", 1)[1] for n in names} == {n.split(":", 1)[1] for n in default}
    assert {f"{prefix}:{c}_total" for c in COUNTERS} | {f"{prefix}:{g}" for g in GAUGES} <= names
    assert {f"{prefix}:{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "count", "sum")} <= names


def test_unknown_metrics_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match="tandem, vllm"):
        ServerMetrics("tiny", prefix="sglang")
    assert METRICS_PREFIXES == SERVE_METRICS_PREFIXES  # the serve flag's choices are the module's


def test_counters_follow_engine_stats_by_delta() -> None:
    m, eng = ServerMetrics("tiny"), FakeEngine()
    st = eng.stats
    for step in range(3):
        st.prompt_tokens += 7
        st.generation_tokens += 5
        st.request_success["length"] = st.request_success.get("length", 0) + 1
        st.spec.record(3, step)  # accepted 0, 1, 2 of 3
        st.num_preemptions += step
        eng.num_running, eng.num_waiting, eng.kv_usage = 2, 1, 0.25
        m.sync_engine(eng)
        m.sync_engine(eng)  # idempotent: a second sync without engine progress adds nothing
    smp = samples(m.render().decode())
    assert value(smp, "prompt_tokens_total") == 21 and value(smp, "generation_tokens_total") == 15
    assert value(smp, "request_success_total", finished_reason="length") == 3
    assert value(smp, "num_preemptions_total") == 3
    assert value(smp, "spec_decode_num_drafts_total") == 3
    assert value(smp, "spec_decode_num_draft_tokens_total") == 9
    assert value(smp, "spec_decode_num_accepted_tokens_total") == 3
    assert [value(smp, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)] == \
        st.spec.accepted_per_pos == [2, 1, 0]
    assert value(smp, "spec_decode_draft_acceptance_rate") == pytest.approx(3 / 9)
    assert value(smp, "num_requests_running") == 2 and value(smp, "num_requests_waiting") == 1
    assert value(smp, "kv_cache_usage_perc") == 0.25


def _out(rid: str, tokens: int, finish: str | None = None) -> RequestOutput:
    c = CompletionOutput(0, "x" * tokens, list(range(tokens)), None, None, finish_reason=finish)
    return RequestOutput(rid, None, [1], [c], finished=finish is not None)


def test_histograms_from_request_timings() -> None:
    m = ServerMetrics("tiny")
    m.track("a", arrival=10.0)
    m.track("b", arrival=10.0)
    m.observe_outputs([_out("a", 1), _out("b", 1)], now=10.5)  # TTFT 0.5 each
    m.observe_outputs([_out("a", 4)], now=10.6)  # a verify step releasing 3 tokens: ONE gap of 0.1
    m.observe_outputs([_out("a", 5, "length"), _out("b", 2)], now=10.9)  # gap 0.3; a done; b gap 0.4
    m.forget("b")  # aborted: nothing more observed
    m.observe_outputs([_out("b", 2, "abort")], now=11.0)
    smp = samples(m.render().decode())
    assert value(smp, "time_to_first_token_seconds_count") == 2
    assert value(smp, "time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(smp, "inter_token_latency_seconds_count") == 3
    assert value(smp, "inter_token_latency_seconds_sum") == pytest.approx(0.1 + 0.3 + 0.4)
    assert value(smp, "e2e_request_latency_seconds_count") == 1
    assert value(smp, "e2e_request_latency_seconds_sum") == pytest.approx(0.9)
    # TPOT = (e2e − TTFT) / (tokens − 1) = (0.9 − 0.5) / 4
    assert value(smp, "request_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    assert value(smp, "time_to_first_token_seconds_bucket", le="0.5") == 2
    assert m.num_tracked == 0


# ---- through the API, against a real engine -----------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    path: Path = write_tiny_hf_checkpoint(tmp_path_factory.mktemp("metrics"), family="llama")
    max_len = min(256, json.loads((path / "config.json").read_text()).get("max_position_embeddings", 256))
    llm = make_llm(path, max_model_len=max_len, speculative_config=NGRAM)
    ae = AsyncEngine(llm.engine, "tiny")
    yield SimpleNamespace(engine=llm.engine, app=build_app(ae, ["tiny"], None), ae=ae)
    ae.shutdown()


def _scrape(app: Any) -> tuple[str, str]:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/metrics")

    r = asyncio.run(go())
    assert r.status_code == 200
    return r.text, r.headers["content-type"]


def _complete(app: Any, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_counters_equal_engine_stats_after_traffic(served: SimpleNamespace) -> None:
    text, ctype = _scrape(served.app)
    assert ctype.startswith("text/plain")
    before = samples(text)
    assert value(before, "generation_tokens_total") == 0
    n_req, max_tokens = 6, 24
    bodies = [{"prompt": f"{i}{PROMPT}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
               "stream": i % 2 == 0} for i in range(n_req)]
    assert all(r.status_code == 200 for r in _complete(served.app, bodies))

    smp = samples(_scrape(served.app)[0])
    st = served.engine.stats
    assert value(smp, "prompt_tokens_total") == st.prompt_tokens == sum(len(f"{i}{PROMPT}") for i in range(n_req))
    assert value(smp, "generation_tokens_total") == st.generation_tokens == n_req * max_tokens
    assert value(smp, "request_success_total", finished_reason="length") == n_req
    assert value(smp, "num_preemptions_total") == st.num_preemptions
    assert value(smp, "spec_decode_num_drafts_total") == st.spec.num_drafts > 0
    assert value(smp, "spec_decode_num_draft_tokens_total") == st.spec.num_draft_tokens
    assert value(smp, "spec_decode_num_accepted_tokens_total") == st.spec.num_accepted_tokens > 0
    for pos, count in enumerate(st.spec.accepted_per_pos):
        assert value(smp, "spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == count
    assert value(smp, "spec_decode_draft_acceptance_rate") == pytest.approx(st.spec.acceptance_rate)
    assert value(smp, "num_requests_running") == 0 and value(smp, "num_requests_waiting") == 0
    assert value(smp, "kv_cache_usage_perc") == 0
    assert value(smp, "time_to_first_token_seconds_count") == n_req
    assert value(smp, "e2e_request_latency_seconds_count") == n_req
    assert value(smp, "request_time_per_output_token_seconds_count") == n_req
    # One ITL gap per engine output after the first; a verify step releases 1 + accepted tokens at
    # once, so gaps = tokens − accepted − 1 per request (no stop strings, no EOS here).
    assert value(smp, "inter_token_latency_seconds_count") == \
        n_req * max_tokens - st.spec.num_accepted_tokens - n_req

    # counters move as more requests complete
    assert all(r.status_code == 200 for r in _complete(served.app, [{**bodies[1], "max_tokens": 5}]))
    later = samples(_scrape(served.app)[0])
    assert value(later, "request_success_total", finished_reason="length") == n_req + 1
    assert value(later, "generation_tokens_total") == n_req * max_tokens + 5
    assert value(later, "generation_tokens_total") == served.engine.stats.generation_tokens
