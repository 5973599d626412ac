"""The Speculator (spec_decode/speculator.py) without weights: which requests get drafts and how
many (k per request within max_tokens / max_model_len; the goodput policy's own tests are
test_policy.py), the asynchronous decode predicate, what one step's record updates, and the null speculator."""

from __future__ import annotations

import torch

from tandem.config.speculative import SpeculativeConfig
from tandem.engine.stats import SpecStats
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.scheduler import ScheduledRequest, SchedulerOutput
from tandem.spec_decode.draft_model import DraftModelProposer
from tandem.spec_decode.finished_queue import FinishedQueue
from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.proposers import TokenProposerAdapter, build_proposer
from tandem.spec_decode.speculator import NoSpeculation, Speculator, build_speculator
from tandem.spec_decode.step_record import StepKind, StepRecord, StepRows, step_kind
from tandem.spec_decode.time_credit import TimeCredit

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # only the device type is read


def _cfg(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=3, **kw)


def _req(rid: str, tokens: list[int], max_tokens: int = 50, max_model_len: int = 64) -> Request:
    r = Request(rid, tokens[:2], SamplingParams(max_tokens=max_tokens), (0,), max_model_len, token_ids=list(tokens))
    r.num_computed_tokens = len(tokens) - 1  # decode phase
    r.status = RequestStatus.RUNNING
    return r


def _record(*got: Request, finished: tuple[Request, ...] = (), kind: StepKind = StepKind.OTHER) -> StepRecord:
    return StepRecord(kind, 0.01, got, finished)


def test_capabilities_are_declared_not_type_checked():
    ngram = build_proposer(_cfg(), None, torch.Generator())
    assert isinstance(ngram, TokenProposerAdapter) and ngram.drafts_on_host_for_free
    assert ngram.propose_one([1, 2, 3, 1, 2], 3) == NgramProposer(1, 5, 3).propose_one([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    assert not DraftModelProposer.drafts_on_host_for_free
    stats = SpecStats()
    policy = build_speculator(_cfg(), ngram, stats, CUDA).policy  # on by default for CUDA
    assert policy is not None and policy.free and policy.shadow is not None
    assert build_speculator(_cfg(), ngram, stats, CPU).policy is not None  # on by default everywhere
    assert build_speculator(_cfg(disable_by_acceptance=False), ngram, stats, CPU).policy is None
    assert build_speculator(_cfg(disable_by_acceptance=False), ngram, stats, CUDA).policy is None
    assert build_speculator(_cfg(disable_by_batch_size=8), ngram, stats, CUDA).policy.disable_by_batch_size == 8

    costly = TokenProposerAdapter(NgramProposer(1, 3, 3))
    costly.drafts_on_host_for_free = False  # as a stateful proposer declares: no lazy shadows
    costly.draft_step_cost = 0.3  # type: ignore[attr-defined]  # drafting costs forwards
    policy = build_speculator(_cfg(), costly, stats, CUDA).policy
    assert policy is not None and policy.shadow is None and not policy.free and policy.draft.of(1) == 0.3 and not policy.draft.measured
    assert isinstance(build_speculator(None, ngram, stats, CUDA), NoSpeculation)


def test_drafts_only_for_new_tokens_within_the_room():
    stats = SpecStats()
    off = _cfg(disable_by_acceptance=False)  # no policy: k within the room every step
    spec = build_speculator(off, build_proposer(off, None, torch.Generator()), stats, CPU)
    loop = [5, 6, 7, 8] * 4
    a, b, c = _req("a", loop), _req("b", loop, max_tokens=16), _req("c", loop)
    assert spec.drafts_for([a, b, c]) == {}  # nobody got tokens yet
    spec.observe(_record(a, b, c))
    c.num_computed_tokens = 3  # c is still prefilling: no drafts
    drafts = spec.drafts_for([a, b, c])
    assert set(drafts) == {"a", "b"}
    assert drafts["a"].token_ids == (5, 6, 7) and drafts["a"].probs is None
    assert drafts["b"].token_ids == (5,)  # 14 outputs of 16: one draft + the bonus token
    assert spec.drafts_for([a, b, c]) == {}  # asked once per new tokens
    assert spec.will_draft([a]) and not NoSpeculation().will_draft([a])  # no policy: anyone may draft


def test_record_updates_counters_policy_and_forgets():
    stats = SpecStats()
    on = _cfg(disable_by_acceptance=True)
    spec = build_speculator(on, build_proposer(on, None, torch.Generator()), stats, CPU)
    assert isinstance(spec, Speculator) and spec.policy is not None
    acc = spec.policy.acceptance
    for j in range(3):
        acc.global_rates[j] = 0.0  # nothing has ever been accepted: nobody drafts
    acc.prior_weight = 0.5  # a request's own evidence counts quickly
    loop = [5, 6, 7, 8] * 4
    a = _req("a", loop)
    spec.observe(_record(a))
    assert spec.drafts_for([a])["a"].token_ids == ()  # proposal [5, 6, 7] kept in the shadow
    assert stats.chosen_k == [1, 0, 0, 0] and stats.last_drafting == 0
    a.token_ids += [5, 6, 7]  # the shadow draft came true (a plain decode step, then two more)
    a.num_computed_tokens += 3
    spec.observe(StepRecord(StepKind.DECODE, 0.01, (a,), (), 1, 1))
    assert acc.num_scored_for("a") == 1 and acc.rates("a")[0] > 0.5
    drafts = spec.drafts_for([a])["a"].token_ids
    assert drafts == (8, 5, 6)[: len(drafts)] and len(drafts) >= 1  # now it pays
    spec.observe(StepRecord(StepKind.VERIFY, 0.012, (a,), (), 1, 1 + len(drafts), drafted=(len(drafts),), accepted=(1,)))
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, len(drafts), 1)
    spec.observe(_record(finished=(a,)))
    assert acc.num_scored_for("a") == 0 and "a" not in spec.policy._pending and spec.drafts_for([a]) == {}


def test_step_kind():
    r = _req("a", [1, 2, 3])

    def sched(*items: tuple[int, tuple[int, ...], bool]) -> SchedulerOutput:
        return SchedulerOutput(tuple(ScheduledRequest(r, n, 0, spec, samples) for n, spec, samples in items), (), 0)

    assert step_kind(sched((4, (1, 2, 3), True), (1, (), True))) is StepKind.VERIFY
    assert step_kind(sched((1, (), True), (1, (), True))) is StepKind.DECODE
    assert step_kind(sched((1, (), True), (5, (), False))) is StepKind.OTHER
    assert step_kind(sched()) is StepKind.OTHER


def test_suffix_proposer_learns_finished_outputs_without_lazy_shadows():
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=3)
    proposer = build_proposer(cfg, None, torch.Generator())
    assert isinstance(proposer, TokenProposerAdapter) and not proposer.drafts_on_host_for_free
    policy = build_speculator(cfg, proposer, SpecStats(), CUDA).policy
    assert policy is not None and policy.free and policy.shadow is None  # no stateless shadow drafts
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=3, disable_by_acceptance=False)
    spec = build_speculator(cfg, proposer, SpecStats(), CPU)
    a = _req("a", [1, 2, 3, 4])
    a.prompt_token_ids = [1, 2]
    spec.observe(_record(a))
    assert spec.drafts_for([a])["a"].token_ids == ()
    a.token_ids += [9, 8, 7]  # the finishing step's tokens: the speculator reads them at forget
    a.status = RequestStatus.FINISHED_LENGTH
    spec.observe(_record(a, finished=(a,)))
    suffix = proposer.proposer
    assert suffix.num_active_requests == 1 and not suffix.global_tree  # queued for ``background``
    spec.background()
    assert suffix.num_active_requests == 0 and suffix.global_tree._seqs == {"a": [3, 4, 9, 8, 7]}
    b = _req("b", [5, 5, 4, 9])
    spec.observe(_record(b))
    assert spec.drafts_for([b])["b"].token_ids == (8, 7)  # "4 9" from a's output: 2 tokens at most
    gone = _req("gone", [1, 2])  # aborted before any token: nothing to cache
    gone.status = RequestStatus.FINISHED_ABORTED
    spec.observe(_record(finished=(gone,)))
    spec.background()
    assert "gone" not in suffix.global_tree


def test_finished_outputs_reach_the_proposer_from_background_within_the_time_credit():
    """``observe`` only queues finished requests; ``background`` (the engine calls it while the
    device computes a step) hands them to the proposer in finishing order while the steps' time
    credit lasts (finished_queue.py), ``drain`` hands all."""
    told: list[tuple[str, int]] = []
    clock = [0.0]

    class Recorder(TokenProposerAdapter):
        def forget(self, request_id, output_token_ids):
            told.append((request_id, len(output_token_ids)))
            clock[0] += 1e-5 * len(output_token_ids)  # 10 µs per token

    spec = build_speculator(_cfg(), Recorder(NgramProposer(1, 3, 3)), SpecStats(), CPU)
    spec.finished = FinishedQueue(TimeCredit(0.02, 0.003, lambda: clock[0]), call_max=0.0015)
    done = []
    for i, n in enumerate((100, 100, 300, 5, 5, 5)):
        r = _req(f"r{i}", [1, 2])
        r.token_ids += [7] * n
        r.status = RequestStatus.FINISHED_LENGTH
        done.append(r)
    spec.observe(_record(finished=tuple(done)))  # a step of 10 ms: earns 0.2 ms (the credit is full)
    assert told == []
    spec.background()  # r0 (1 ms), r1 (1 ms): this call's 1.5 ms are spent
    assert told == [("r0", 100), ("r1", 100)]
    spec.observe(_record())
    spec.background()  # 1.2 ms of credit: r2 (3 ms, overdrawn to -1.8 ms)
    assert told[2:] == [("r2", 300)] and spec.finished.credit < 0
    spec.observe(_record())
    spec.background()  # -1.6 ms: nothing
    assert len(told) == 3
    spec.background(drain=True)
    assert [rid for rid, _ in told] == [f"r{i}" for i in range(6)]
    spec.background()  # nothing left
    assert len(told) == 6


def test_spec_stats_count_the_drafts_that_reached_each_position():
    st = SpecStats()
    for drafted, accepted in ((3, 1), (1, 1), (2, 0), (0, 0)):
        st.record(drafted, accepted)
    assert st.num_drafts == 3 and st.accepted_per_pos == [2, 0, 0] and st.drafted_per_pos == [3, 2, 1]
    assert st.copy().drafted_per_pos == [3, 2, 1]


def test_step_rows_list_the_requests_that_got_tokens():
    """A step's record: every scheduled request that got tokens and had not finished before the step
    (an abort, or a stop found while the step ran ahead); a verify's drafted / accepted counts stay
    aligned with its requests, also when plain rows follow; the tokens emitted count accepted drafts."""
    a, b, c, d = (_req(x, [1, 2, 3, 4]) for x in "abcd")
    c.status = RequestStatus.FINISHED_ABORTED
    sched = [ScheduledRequest(r, 1, 3, (), True) for r in (a, b, c, d)]
    rows = StepRows()
    rows.add(sched, [[5], [], [6], [7]], [0, 0, 0, 0], False)  # b: a chunk that sampled nothing
    rec = StepRecord.of(StepKind.DECODE, 0.01, rows, (), 4, 4)
    assert rec.requests == (a, d) and rec.drafted == rec.accepted == () and rec.num_tokens == 2
    verify = [ScheduledRequest(a, 3, 3, (8, 9), True), ScheduledRequest(b, 1, 3, (), True)]
    rows = StepRows()
    rows.add(verify, [[8, 5], [6]], [1, 0], True)
    rows.add(sched[3:], [[7]], [0], False)
    rec = StepRecord.of(StepKind.VERIFY, 0.01, rows, (), 3, 5)
    assert rec.requests == (a, b, d) and rec.drafted == (2, 0, 0) and rec.accepted == (1, 0, 0)
    assert rec.num_tokens == 4
    spec = build_speculator(_cfg(), build_proposer(_cfg(), None, torch.Generator()), SpecStats(), CPU)
    spec.observe(rec)
    assert spec.stats.num_drafts == 1 and spec.stats.num_draft_tokens == 2 and spec.stats.num_accepted_tokens == 1
