"""The EAGLE proposer's feature store (spec_decode/eagle_features.py) against a plain reference: per
request, the row last recorded for each position. Steps are decode runs (kept as one tensor per step),
verifies whose rejected rows later steps overwrite, prefill chunks, requests joining, leaving and
finishing; every read must give exactly the reference's rows."""

from __future__ import annotations

import random

import torch

from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.scheduler import ScheduledRequest, SchedulerOutput
from tandem.spec_decode.eagle_features import FeatureStore

F = 3


def _req(rid: str, prompt_len: int) -> Request:
    r = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=10_000), (0,), 100_000)
    r.status = RequestStatus.RUNNING
    return r


def _step(store: FeatureStore, ref: dict[str, dict[int, torch.Tensor]], items: list[tuple[Request, int, int]],
          value: list[float]) -> None:
    """One target step: (request, start, rows) per scheduled request; row values unique per step."""
    rows = []
    for r, start, n in items:
        for p in range(start, start + n):
            value[0] += 1.0
            row = torch.full((F,), value[0])
            rows.append(row)
            ref.setdefault(r.request_id, {})[p] = row
        r.num_computed_tokens = start  # (as the scheduler leaves it while the step runs: a one-row
        r.token_ids = list(range(start + n))  # step is a decode)
    sched = SchedulerOutput(tuple(ScheduledRequest(r, n, start, (), True) for r, start, n in items), (),
                            sum(n for _, _, n in items))
    store.record(sched, torch.stack(rows))


def _check(store: FeatureStore, ref: dict[str, dict[int, torch.Tensor]], rid: str) -> None:
    f = store.segment(rid)
    assert f is not None
    want = torch.stack([ref[rid][p] for p in range(f.start, f.end)])
    assert torch.equal(f.rows, want)


def test_runs_verifies_and_membership_changes_keep_the_last_row_per_position():
    rng = random.Random(0)
    store = FeatureStore(backlog_rows=1_000)
    ref: dict[str, dict[int, torch.Tensor]] = {}
    value = [0.0]
    reqs = {rid: _req(rid, 5) for rid in "abcd"}
    pos = {rid: 0 for rid in reqs}
    active = ["a", "b"]
    for rid in active:  # prefill
        _step(store, ref, [(reqs[rid], 0, 5)], value)
        pos[rid] = 5
    for _ in range(400):
        x = rng.random()
        if x < 0.05 and len(active) < 4:  # a request joins with its prompt
            rid = next(r for r in reqs if r not in active)
            active.append(rid)
            _step(store, ref, [(reqs[rid], pos[rid], 5)], value)
            pos[rid] += 5
        elif x < 0.1 and len(active) > 1:  # one leaves (preempted: keeps its rows) or finishes
            rid = active.pop(rng.randrange(len(active)))
            if rng.random() < 0.5:
                store.forget(rid)
                ref.pop(rid, None)
                reqs[rid] = _req(rid, 5)
                pos[rid] = 0
        elif x < 0.13 and len(active) < 4:  # one request decodes in another's place (same batch size)
            rid = next(r for r in reqs if r not in active)
            active[rng.randrange(len(active))] = rid
            if pos[rid] == 0:
                _step(store, ref, [(reqs[rid], 0, 5)], value)
                pos[rid] = 5
            _step(store, ref, [(reqs[r], pos[r], 1) for r in active], value)
            for r in active:
                pos[r] += 1
        elif x < 0.16:  # one request recomputes its last position (a prefix-cache hit after preemption)
            rid = rng.choice(active)
            pos[rid] -= 1
            _step(store, ref, [(reqs[r], pos[r], 1) for r in active], value)
            for r in active:
                pos[r] += 1
        elif x < 0.25:  # a verify of 3 drafts: 0..3 accepted, the rejected rows are overwritten later
            items = [(reqs[rid], pos[rid], 4) for rid in active]
            _step(store, ref, items, value)
            for rid in active:
                pos[rid] += 1 + rng.randrange(4)
        else:  # a plain decode step of the whole batch (a run)
            _step(store, ref, [(reqs[rid], pos[rid], 1) for rid in active], value)
            for rid in active:
                pos[rid] += 1
        if rng.random() < 0.05:  # a read in the middle of a run
            _check(store, ref, rng.choice(list(ref)))
    for rid in ref:
        _check(store, ref, rid)


def test_a_decode_run_is_kept_whole_until_read_and_reports_its_backlog():
    store = FeatureStore(backlog_rows=8)
    ref: dict[str, dict[int, torch.Tensor]] = {}
    value = [0.0]
    a, b = _req("a", 3), _req("b", 3)
    _step(store, ref, [(a, 0, 3), (b, 0, 3)], value)
    for j in range(6):
        _step(store, ref, [(a, 3 + j, 1), (b, 3 + j, 1)], value)
    assert store._run is not None and len(store._run.steps) == 6  # one tensor per step, no per-request split
    assert store.rows_held() == {"a": 9, "b": 9} and store.due  # 9 rows > 8
    _check(store, ref, "a")
    assert store._run is None  # a read splits the run
    store.consumed("a", 8)
    store.consumed("b", 8)
    assert store.rows_held() == {"a": 1, "b": 1} and not store.due
    _check(store, ref, "b")


def test_a_step_of_other_requests_at_the_expected_positions_ends_the_run():
    store = FeatureStore(backlog_rows=1_000)
    ref: dict[str, dict[int, torch.Tensor]] = {}
    value = [0.0]
    a, b, c = _req("a", 7), _req("b", 7), _req("c", 7)
    _step(store, ref, [(a, 0, 7), (b, 0, 7), (c, 0, 7)], value)
    _step(store, ref, [(a, 7, 1), (b, 7, 1)], value)
    _step(store, ref, [(a, 8, 1), (c, 8, 1)], value)  # c where b would have been, at b's next position
    for rid in "abc":
        _check(store, ref, rid)
    assert store.segment("b").end == 8 and store.segment("c").end == 9
