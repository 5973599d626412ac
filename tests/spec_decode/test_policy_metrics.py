"""The goodput policy's decisions in /metrics (``spec_decode_policy_chosen_k{k}``,
``spec_decode_drafting_requests``, ``spec_decode_drafting_ratio``) and in the periodic log line."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.stats import EngineStats, PeriodicLogger
from tandem.server.metrics import ServerMetrics


class _Engine:
    def __init__(self) -> None:
        self.stats = EngineStats()
        self.num_running = self.num_waiting = 0
        self.kv_usage = 0.0


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_chosen_k_counters_and_drafting_gauges():
    m, eng = ServerMetrics("tiny", num_speculative_tokens=3), _Engine()
    smp = _samples(m)
    assert all(smp[("tandem:spec_decode_policy_chosen_k_total", (("k", str(k)),))] == 0 for k in range(4))
    sp = eng.stats.spec
    sp.record_choices([0, 0, 3, 1], 3)
    m.sync_engine(eng)
    sp.record_choices([3, 0], 3)
    m.sync_engine(eng)
    m.sync_engine(eng)  # no new decisions: nothing added
    smp = _samples(m)
    got = [smp[("tandem:spec_decode_policy_chosen_k_total", (("k", str(k)),))] for k in range(4)]
    assert got == sp.chosen_k == [3, 1, 0, 2]
    assert smp[("tandem:spec_decode_drafting_requests", ())] == 1  # the latest round: [3, 0]
    assert smp[("tandem:spec_decode_drafting_ratio", ())] == pytest.approx(3 / 6)


def test_log_line_shows_policy(caplog):
    stats = EngineStats()
    log = PeriodicLogger(interval=0.0)
    stats.spec.record_choices([0, 2, 2, 0], 3)
    stats.spec.record(2, 1)
    with caplog.at_level(logging.INFO, logger="tandem"):
        log.maybe_log(stats, 4, 0, 0.1)
    assert "Policy: drafting 50.0% of requests, chosen k: 0:2 2:2" in caplog.text
    caplog.clear()
    stats.spec.record_choices([0, 0, 0, 1], 3)  # only what changed since the last line
    with caplog.at_level(logging.INFO, logger="tandem"):
        log.maybe_log(stats, 4, 0, 0.1)
    assert "Policy: drafting 25.0% of requests, chosen k: 0:3 1:1" in caplog.text
