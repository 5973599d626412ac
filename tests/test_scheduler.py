"""Scheduler and block pool on CPU without weights: budgets, chunking, drafts, preemption, freeing."""

from __future__ import annotations

import pytest

from tandem.kv.block_pool import BlockPool
from tandem.outputs import ModelRunnerOutput
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.scheduler import Scheduler


def make_req(rid: str, n_prompt: int, max_model_len: int = 1024) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=100), (0,), max_model_len)


def run_model(out, new_token: int = 7, accept_all: bool = True) -> None:
    """Pretend a forward ran: advance counters; sampling steps append one token (+ accepted drafts)."""
    for s in out.scheduled:
        r = s.request
        r.num_computed_tokens = s.start + s.num_new_tokens
        if s.samples:
            if accept_all:
                r.token_ids.extend(s.spec_token_ids)
            else:
                r.num_computed_tokens -= len(s.spec_token_ids)
            r.token_ids.append(new_token)
            r.spec_token_ids = []


def test_block_pool_alloc_free_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.free(a)
    assert pool.all_free()
    with pytest.raises(RuntimeError):
        pool.free([a[0]])


def test_chunked_prefill_respects_budget_and_mixes_with_decode():
    pool = BlockPool(64)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=1024)
    a, b = make_req("a", 3), make_req("b", 20)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 3), ("b", 5)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    run_model(out)
    out = s.schedule()  # a decodes (1 token), b continues its prefill with the rest of the budget
    assert [(x.request.request_id, x.num_new_tokens, x.start) for x in out.scheduled] == [("a", 1, 3), ("b", 7, 5)]
    assert out.num_batched_tokens == 8


def test_drafts_are_scheduled_as_trailing_query_tokens_and_cut_by_budget():
    pool = BlockPool(64)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=3, max_num_seqs=8, max_model_len=1024)
    r = make_req("a", 2)
    s.add(r)
    run_model(s.schedule())
    r.spec_token_ids = [11, 12, 13, 14]
    out = s.schedule()
    (x,) = out.scheduled
    # budget 3 = last token + 2 drafts; the other drafts are dropped, not deferred
    assert x.num_new_tokens == 3 and x.spec_token_ids == (11, 12) and x.samples
    assert r.spec_token_ids == [11, 12]


def test_lookahead_slots_reserved_for_draft_kv():
    pool = BlockPool(64)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024, lookahead=5)
    r = make_req("a", 4)
    s.add(r)
    s.schedule()
    # 4 prompt tokens + 5 lookahead slots → 3 blocks of 4
    assert len(r.block_ids) == 3


def test_preemption_frees_blocks_and_requeues_front():
    pool = BlockPool(4)  # 16 slots of block 4
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    a, b = make_req("a", 7), make_req("b", 7)
    s.add(a)
    s.add(b)
    run_model(s.schedule())  # both hold 2 blocks; pool full
    assert pool.num_free_blocks == 0
    a.num_computed_tokens, b.num_computed_tokens = 8, 8
    a.token_ids.append(5)  # a now needs a third block
    out = s.schedule()
    assert out.preempted == ("b",)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and not b.block_ids
    assert s.waiting[0] is b
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()  # b is recomputed from scratch: all its tokens
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in out.scheduled] == [("b", 0, 8)]
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    assert pool.all_free()


def test_request_that_preempts_itself_waits_for_room():
    pool = BlockPool(2)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    a = make_req("a", 8)
    s.add(a)
    run_model(s.schedule())
    out = s.schedule()  # a needs a 3rd block that does not exist: it preempts itself
    assert out.preempted == ("a",) and not out.scheduled
    assert pool.all_free()


def test_max_num_seqs_limits_admission():
    pool = BlockPool(64)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=64, max_num_seqs=2, max_model_len=1024)
    for i in range(3):
        s.add(make_req(str(i), 2))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_update_from_output_rolls_back_rejected_drafts_by_count():

    pool = BlockPool(64)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024)
    a, b = make_req("a", 5), make_req("b", 9)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert a.num_computed_tokens == b.num_computed_tokens == 0  # counters move with the results only
    s.update_from_output(first, ModelRunnerOutput(((7,), (8,)), (0, 0), (None, None), (None, None)))
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 9)
    a.token_ids.append(7)
    b.token_ids.append(8)
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert [(x.start, x.num_new_tokens, x.spec_token_ids) for x in out.scheduled] == [(5, 4, (1, 2, 3)), (9, 1, ())]
    s.update_from_output(out, ModelRunnerOutput(((1, 9), (4,)), (1, 0), (None, None), (None, None)))
    assert a.num_computed_tokens == 9 - 2 and a.spec_token_ids == [] and b.num_computed_tokens == 10
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (1, 3, 1) and b.num_drafts == 0


def test_output_placeholders_are_scheduled_like_tokens():
    """A step left on the device: its requests carry a placeholder each, counted in num_tokens, so the
    next schedule() decodes it (at the first position whose id the host does not know) under the usual
    allocation and preemption rules; the read token takes the placeholder's place."""
    pool = BlockPool(4)  # 16 slots of block 4
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    a, b = make_req("a", 7), make_req("b", 7)
    s.add(a)
    s.add(b)
    run_model(s.schedule())  # 8 tokens each, 7 computed: 2 blocks each, pool full
    launched = s.schedule()  # decodes of token 8, left on the device
    assert [(x.start, x.num_new_tokens, x.samples) for x in launched.scheduled] == [(7, 1, True), (7, 1, True)]
    s.add_output_placeholders(launched)
    assert a.num_output_placeholders == 1 and a.num_tokens == 9 and len(a.token_ids) == 8
    assert a.num_computed_tokens == 8 and a.is_decoding
    ahead = s.schedule()  # a's placeholder needs a 3rd block: b (placeholder and all) is preempted
    assert ahead.preempted == ("b",)
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in ahead.scheduled] == [("a", 8, 1)]
    assert b.num_output_placeholders == 1 and b.num_computed_tokens == 0 and s.waiting[0] is b
    s.add_output_placeholders(ahead)
    assert a.num_output_placeholders == 2 and a.num_computed_tokens == 9
    for r, tok in ((a, 11), (b, 12)):  # the launched step is read
        r.append_token(tok)
    assert a.token_ids[-1] == 11 and a.num_output_placeholders == 1 and a.num_tokens == 10
    assert b.num_output_placeholders == 0 and b.num_tokens == 9


def test_a_launched_verify_counts_all_drafts_until_settled():
    """A verify left on the device counts as k + 1 placeholders (all drafts accepted); the step
    after it is scheduled past them, and reading the verify takes back the rejected ones by count —
    placeholders and computed positions — whatever was scheduled meanwhile."""
    pool = BlockPool(16)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    a = make_req("a", 7)
    s.add(a)
    run_model(s.schedule())  # 8 tokens, 7 computed
    a.spec_token_ids = [1, 2, 3]
    verify = s.schedule()
    assert [(x.start, x.num_new_tokens, x.spec_token_ids) for x in verify.scheduled] == [(7, 4, (1, 2, 3))]
    s.add_output_placeholders(verify)
    assert a.num_output_placeholders == 4 and a.num_tokens == 12 and a.num_computed_tokens == 11
    assert a.spec_token_ids == [] and a.is_decoding
    a.spec_token_ids = [5, 6]  # drafts for the step after it, proposed before it is read
    ahead = s.schedule()
    assert [(x.start, x.num_new_tokens, x.spec_token_ids) for x in ahead.scheduled] == [(11, 3, (5, 6))]
    s.add_output_placeholders(ahead)
    assert a.num_output_placeholders == 7 and a.num_computed_tokens == 14
    out = ModelRunnerOutput(((1, 9),), (1,), (None,), (None,))  # the verify accepted 1 of 3 drafts
    s.settle_launched(verify, out)
    for tok in out.sampled_token_ids[0]:
        a.append_token(tok)
    assert a.token_ids[-2:] == [1, 9] and a.num_output_placeholders == 3
    assert a.num_tokens == 13 and a.num_computed_tokens == 12 and a.is_decoding  # 2 rejected: 14 - 2
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (1, 3, 1)


def _admitted(out) -> list[str]:
    """Requests whose prefill this step begins (then the step is run)."""
    ids = [x.request.request_id for x in out.scheduled if x.start == 0]
    run_model(out)
    return ids


def test_admission_in_groups_waits_for_free_seats_then_admits_together():
    pool = BlockPool(256)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=256, max_num_seqs=4, max_model_len=1024,
                  admission_group=2)
    reqs = [make_req(f"r{i}", 3) for i in range(9)]
    for r in reqs:
        s.add(r)
    assert _admitted(s.schedule()) == ["r0", "r1", "r2", "r3"]  # nothing runs: admitted at once
    s.finish(reqs[0], RequestStatus.FINISHED_STOPPED)  # one seat free, five wait: admission waits
    assert not s.admission_open()
    assert _admitted(s.schedule()) == []
    s.finish(reqs[1], RequestStatus.FINISHED_STOPPED)  # two seats: both taken in one step
    assert s.admission_open()
    assert _admitted(s.schedule()) == ["r4", "r5"]
    s.finish(reqs[2], RequestStatus.FINISHED_STOPPED)
    for _ in range(2):  # a free seat waits at most admission_group steps
        assert _admitted(s.schedule()) == []
    assert _admitted(s.schedule()) == ["r6"]
    for r in (reqs[3], reqs[4]):
        s.finish(r, RequestStatus.FINISHED_STOPPED)
    assert _admitted(s.schedule()) == ["r7", "r8"]


def test_admission_in_groups_admits_a_queue_that_fits_at_once():
    pool = BlockPool(256)
    s = Scheduler(pool, block_size=4, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=1024,
                  admission_group=4)
    first = make_req("a", 3)
    s.add(first)
    assert _admitted(s.schedule()) == ["a"]
    s.add(make_req("b", 3))  # one waits, seven seats free: no group to wait for
    assert _admitted(s.schedule()) == ["b"]
    one = Scheduler(BlockPool(64), block_size=4, max_num_batched_tokens=256, max_num_seqs=2, max_model_len=1024)
    rs = [make_req(f"q{i}", 3) for i in range(4)]
    for r in rs:
        one.add(r)
    assert _admitted(one.schedule()) == ["q0", "q1"]
    one.finish(rs[0], RequestStatus.FINISHED_STOPPED)
    assert _admitted(one.schedule()) == ["q2"]  # the default (1): a free seat is taken at once
