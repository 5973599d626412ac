"""Drafts left on the device (spec_decode/device_drafts.py), without weights: which verify rows take
which drafts (budget cuts, prefill chunks, requests without drafts), the one read, and the
speculator putting the real ids in place of the placeholders (after a cut, after a preemption)."""

from __future__ import annotations

import torch

from tandem.config.speculative import SpeculativeConfig
from tandem.engine.stats import SpecStats
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.scheduler import ScheduledRequest, SchedulerOutput
from tandem.spec_decode.chain import collect_chain, flatten_chain
from tandem.spec_decode.device_drafts import PENDING, DeviceDrafts, pending
from tandem.spec_decode.speculator import Speculator


def _req(rid: str, n: int = 6) -> Request:
    r = Request(rid, [1, 2], SamplingParams(max_tokens=50), (0,), 64, token_ids=list(range(10, 10 + n)))
    r.num_computed_tokens = n - 1
    r.status = RequestStatus.RUNNING
    return r


def _drafts() -> DeviceDrafts:
    # a chain of three steps: step 1 drafts for requests 0 and 2, steps 2-3 for request 0 only
    steps = [([0, 2], torch.tensor([100, 300])), ([0], torch.tensor([101])), ([0], torch.tensor([102]))]
    ids, where = flatten_chain(steps, 3)
    assert ids.tolist() == [100, 300, 101, 102] and where == [[0, 2, 3], [], [1]]
    return DeviceDrafts.launch(ids, {rid: tuple(p) for rid, p in zip("abc", where) if p})


def test_feed_maps_each_pending_draft_to_its_verify_row():
    dd = _drafts()
    a, b, c, d = _req("a"), _req("b"), _req("c"), _req("d")
    sched = SchedulerOutput((
        ScheduledRequest(d, 5, 0, (), True),  # a prefill chunk: rows 0-4
        ScheduledRequest(a, 4, 5, pending(3), True),  # bonus row 5, drafts at rows 6-8
        ScheduledRequest(b, 1, 5, (), True),  # a decode: row 9
        ScheduledRequest(c, 2, 5, pending(1), True),  # rows 10, 11
    ), (), 12)
    fed = dd.feed(sched)
    assert fed is not None and fed.rows == (6, 7, 8, 11) and fed.src == (0, 2, 3, 1)
    assert fed.values.index_select(0, torch.tensor(fed.src)).tolist() == [100, 101, 102, 300]
    # a budget cut kept one of a's drafts: only its first draft is fed
    cut = SchedulerOutput((ScheduledRequest(a, 2, 5, pending(1), True),), (), 2)
    fed = dd.feed(cut)
    assert fed is not None and fed.rows == (1,) and fed.src == (0,)
    # drafts already on the host (or none) feed nothing
    assert dd.feed(SchedulerOutput((ScheduledRequest(a, 2, 5, (7,), True),), (), 2)) is None
    assert dd.read() == {"a": [100, 101, 102], "c": [300]}


def test_collect_chain_reads_the_same_drafts():
    steps = [([0, 2], torch.tensor([100, 300])), ([0], torch.tensor([101]))]
    drafts: list[list[int]] = [[], [], []]
    collect_chain(steps, drafts)
    assert drafts == [[100, 101], [], [300]]


class _OnDevice:
    drafts_on_host_for_free = False

    def __init__(self) -> None:
        self.host_calls = 0

    def propose_on_device(self, reqs, ks):
        steps = [([i for i, k in enumerate(ks) if k > j], torch.tensor([1000 * (i + 1) + j for i, k in enumerate(ks)
                                                                          if k > j])) for j in range(max(ks))]
        steps = [(live, t) for live, t in steps if live]
        ids, where = flatten_chain(steps, len(reqs))
        return DeviceDrafts.launch(ids, {r.request_id: tuple(p) for r, p in zip(reqs, where) if p})

    def propose_requests(self, reqs, ks):
        self.host_calls += 1
        raise AssertionError("the host path is not taken")

    def forget(self, request_id, output_token_ids):
        pass


def test_speculator_puts_the_read_drafts_in_place_of_the_placeholders():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_acceptance=False),
                      _OnDevice(), SpecStats())  # type: ignore[arg-type]
    reqs = [_req("a"), _req("b"), _req("c")]
    spec._new_tokens.update(r.request_id for r in reqs)
    drafts = spec.drafts_for(reqs)
    assert {rid: d.token_ids for rid, d in drafts.items()} == {"a": pending(3), "b": pending(3), "c": pending(3)}
    assert spec.device_drafts is not None
    for r in reqs:
        r.spec_token_ids = list(drafts[r.request_id].token_ids)
    reqs[1].spec_token_ids = reqs[1].spec_token_ids[:1]  # a budget cut
    reqs[2].spec_token_ids = []  # preempted
    spec.resolve_drafts()
    assert [r.spec_token_ids for r in reqs] == [[1000, 1001, 1002], [2000], []]
    assert spec.device_drafts is None
    spec.resolve_drafts()  # nothing pending: nothing happens
    assert PENDING not in reqs[0].spec_token_ids


def test_a_grammar_keeps_the_drafts_on_the_host():
    class Grammar:
        def validate(self, toks, keep_refused=False):
            return toks[:1]

    class Both(_OnDevice):
        def propose_requests(self, reqs, ks):
            self.host_calls += 1
            from tandem.spec_decode.base import DraftProposal
            return DraftProposal([[5, 6, 7][:k] for k in ks])

    proposer = Both()
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_acceptance=False),
                      proposer, SpecStats())  # type: ignore[arg-type]
    r = _req("a")
    r.grammar = Grammar()  # type: ignore[assignment]
    spec._new_tokens.add("a")
    assert spec.drafts_for([r])["a"].token_ids == (5,)
    assert proposer.host_calls == 1 and spec.device_drafts is None
