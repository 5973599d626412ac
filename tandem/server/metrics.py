"""Prometheus metrics for the server: vLLM's metric names under the ``tandem:`` prefix.

The prefix is a choice (``tandem serve --metrics-prefix vllm``): under ``vllm:`` every series has
exactly vLLM's name, so existing vLLM Grafana dashboards work unchanged. One server exposes one
prefix, never both.

Every metric lives in one dedicated :class:`CollectorRegistry` (two servers in one process, as in
tests, never collide) and carries the label ``model_name``, like vLLM.

Where the numbers come from:

- Counters (prompt/generation tokens, finished requests, preemptions, speculation, prefix-cache
  queries/hits in tokens) mirror the
  engine's cumulative :class:`~tandem.engine.stats.EngineStats`: :meth:`ServerMetrics.sync_engine`
  adds the *delta* since its last call. It runs on the engine thread right after each ``step()``
  (before the step's outputs are handed to clients), so once a client sees its request finish, the
  counters already include it, and at any quiet moment they equal the engine's counts exactly.
- Gauges (running, waiting, KV usage, acceptance rate) are set by the same call.
- The goodput policy's decisions (tandem only): ``spec_decode_policy_chosen_k{k}`` counts requests
  given k drafts per proposal round (a histogram of the chosen k, 0 = not drafting);
  ``spec_decode_drafting_requests`` is the latest round's drafting requests and
  ``spec_decode_drafting_ratio`` the share of decisions that drafted since start.
- Histograms come from per-request timings, all ``time.monotonic()`` stamps taken on the engine
  thread when a step's outputs exist (:meth:`ServerMetrics.observe_outputs`):
  TTFT = first output carrying tokens − arrival; ITL = gap between successive outputs of one request
  (a verify step that releases several tokens is ONE gap, which is what a streaming client sees);
  TPOT = (e2e − TTFT) / (tokens − 1); e2e = finish − arrival. Only requests finishing with "stop" or
  "length" feed e2e and TPOT; aborted requests feed nothing more after their abort.

prometheus_client appends ``_total`` to counter names itself, so counters are declared without it:
``Counter("tandem:prompt_tokens")`` is exposed as ``tandem:prompt_tokens_total``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from tandem.engine.stats import EngineStats
from tandem.outputs import RequestOutput

METRICS_PREFIXES: tuple[str, ...] = ("tandem", "vllm")  # the choices of --metrics-prefix
LABEL = "model_name"

# vLLM's bucket choices (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
TPOT_BUCKETS: tuple[float, ...] = ITL_BUCKETS
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort")


class EngineView(Protocol):
    """What :meth:`ServerMetrics.sync_engine` reads from an engine (LLMEngine satisfies it)."""

    stats: EngineStats

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...


@dataclass
class _Timing:
    """Per-request timing state; all stamps are ``time.monotonic()`` seconds."""

    arrival: float
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0


class ServerMetrics:
    """The server's Prometheus metrics, in their own registry.

    Thread-safety: ``sync_engine``/``observe_outputs``/``track``/``forget`` are meant for the engine
    thread; they also hold a lock, so calling them from elsewhere is safe. prometheus_client itself
    is thread-safe for updates and for ``render``.
    """

    def __init__(self, model_name: str, num_speculative_tokens: int = 0, prefix: str = "tandem") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
        self.model_name = model_name
        self.prefix = prefix + ":"
        self.registry = CollectorRegistry(auto_describe=True)
        reg, labels, pre = self.registry, [LABEL], self.prefix

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(pre + name, doc, labels, registry=reg)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(pre + name, doc, [*labels, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(pre + name, doc, labels, buckets=list(buckets), registry=reg)

        m = model_name
        self.num_requests_running = gauge("num_requests_running",
                                          "Number of requests in model execution batches.").labels(m)
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Number of requests waiting to be processed.").labels(m)
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(m)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(m)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.").labels(m)
        self._request_success = counter("request_success", "Count of successfully processed requests.",
                                        ["finished_reason"])
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.").labels(m)
        self.prefix_cache_queries = counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.").labels(m)
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.").labels(m)
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.").labels(m)
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.").labels(m)
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                "Number of accepted tokens.").labels(m)
        self._spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", ["position"])
        self.spec_acceptance_rate = gauge("spec_decode_draft_acceptance_rate",
                                          "Accepted draft tokens / proposed draft tokens, since start.").labels(m)
        # tandem's goodput policy (spec_decode/policy.py): its decisions, per request and proposal round
        self._spec_chosen_k = counter("spec_decode_policy_chosen_k",
                                      "Goodput policy decisions (request x proposal round) by draft tokens chosen.",
                                      ["k"])
        self.spec_drafting_requests = gauge("spec_decode_drafting_requests",
                                            "Requests given draft tokens in the latest proposal round.").labels(m)
        self.spec_drafting_ratio = gauge("spec_decode_drafting_ratio",
                                         "Share of the goodput policy's decisions that drafted, since start.").labels(m)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS).labels(m)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS).labels(m)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "Histogram of time_per_output_token_seconds per request.",
                                               TPOT_BUCKETS).labels(m)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", E2E_BUCKETS).labels(m)
        # Expose zero-valued series up front, as vLLM does, so dashboards see them before traffic.
        for reason in FINISHED_REASONS:
            self._request_success.labels(m, reason)
        for pos in range(num_speculative_tokens):
            self._spec_per_pos.labels(m, str(pos))
        for k in range(num_speculative_tokens + 1 if num_speculative_tokens else 0):
            self._spec_chosen_k.labels(m, str(k))

        self._lock = threading.Lock()
        self._seen = EngineStats()  # the engine counts already added to the counters
        self._seen_per_pos: list[int] = []
        self._seen_chosen_k: list[int] = []
        self._timings: dict[str, _Timing] = {}

    # ---- engine counters (deltas) ----------------------------------------------------------------
    def sync_engine(self, engine: EngineView) -> None:
        """Bring counters up to the engine's cumulative stats and refresh the gauges."""
        with self._lock:
            st, seen = engine.stats, self._seen
            _add(self.prompt_tokens, st.prompt_tokens - seen.prompt_tokens)
            _add(self.generation_tokens, st.generation_tokens - seen.generation_tokens)
            _add(self.num_preemptions, st.num_preemptions - seen.num_preemptions)
            seen.prompt_tokens, seen.generation_tokens = st.prompt_tokens, st.generation_tokens
            seen.num_preemptions = st.num_preemptions
            _add(self.prefix_cache_queries, st.prefix_cache_queries - seen.prefix_cache_queries)
            _add(self.prefix_cache_hits, st.prefix_cache_hits - seen.prefix_cache_hits)
            seen.prefix_cache_queries, seen.prefix_cache_hits = st.prefix_cache_queries, st.prefix_cache_hits
            for reason, count in list(st.request_success.items()):
                _add(self._request_success.labels(self.model_name, reason),
                     count - seen.request_success.get(reason, 0))
                seen.request_success[reason] = count
            sp, ss = st.spec, seen.spec
            _add(self.spec_num_drafts, sp.num_drafts - ss.num_drafts)
            _add(self.spec_num_draft_tokens, sp.num_draft_tokens - ss.num_draft_tokens)
            _add(self.spec_num_accepted_tokens, sp.num_accepted_tokens - ss.num_accepted_tokens)
            ss.num_drafts, ss.num_draft_tokens = sp.num_drafts, sp.num_draft_tokens
            ss.num_accepted_tokens = sp.num_accepted_tokens
            for pos, count in enumerate(list(sp.accepted_per_pos)):
                if pos >= len(self._seen_per_pos):
                    self._seen_per_pos.append(0)
                _add(self._spec_per_pos.labels(self.model_name, str(pos)), count - self._seen_per_pos[pos])
                self._seen_per_pos[pos] = count
            if sp.num_draft_tokens:
                self.spec_acceptance_rate.set(sp.num_accepted_tokens / sp.num_draft_tokens)
            for k, count in enumerate(list(sp.chosen_k)):
                if k >= len(self._seen_chosen_k):
                    self._seen_chosen_k.append(0)
                _add(self._spec_chosen_k.labels(self.model_name, str(k)), count - self._seen_chosen_k[k])
                self._seen_chosen_k[k] = count
            if sp.chosen_k:
                self.spec_drafting_requests.set(sp.last_drafting)
                self.spec_drafting_ratio.set(sp.drafting_share)
            self.num_requests_running.set(engine.num_running)
            self.num_requests_waiting.set(engine.num_waiting)
            self.kv_cache_usage_perc.set(engine.kv_usage)

    # ---- per-request timings -----------------------------------------------------------------------
    def track(self, request_id: str, arrival: float) -> None:
        """Start timing a request that arrived at ``arrival`` (monotonic seconds)."""
        with self._lock:
            self._timings[request_id] = _Timing(arrival)

    def forget(self, request_id: str) -> None:
        """Stop timing a request (aborted or failed); nothing more is observed for it."""
        with self._lock:
            self._timings.pop(request_id, None)

    def observe_outputs(self, outputs: Iterable[RequestOutput], now: float) -> None:
        """Feed TTFT/ITL/TPOT/e2e from one step's outputs, all produced at ``now``."""
        with self._lock:
            for out in outputs:
                t = self._timings.get(out.request_id)
                if t is None:
                    continue
                tokens = max((len(c.token_ids) for c in out.outputs), default=0)
                if tokens > t.num_tokens:
                    if t.first is None:
                        t.first = now
                        self.time_to_first_token.observe(max(0.0, now - t.arrival))
                    elif t.last is not None:
                        self.inter_token_latency.observe(max(0.0, now - t.last))
                    t.last = now
                    t.num_tokens = tokens
                if out.finished:
                    del self._timings[out.request_id]
                    reasons = {c.finish_reason for c in out.outputs}
                    if reasons <= {"stop", "length"} and t.first is not None:
                        e2e = max(0.0, now - t.arrival)
                        self.e2e_request_latency.observe(e2e)
                        if t.num_tokens > 1:
                            self.time_per_output_token.observe(
                                max(0.0, (e2e - (t.first - t.arrival)) / (t.num_tokens - 1)))

    @property
    def num_tracked(self) -> int:
        return len(self._timings)

    # ---- exposition --------------------------------------------------------------------------------
    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


def _add(counter: Counter, delta: float) -> None:
    # Deltas are never negative for a live engine; a negative one (stats reset) is skipped rather
    # than crashing: Prometheus counters cannot go down.
    if delta > 0:
        counter.inc(delta)
