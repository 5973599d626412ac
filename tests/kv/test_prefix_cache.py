"""Automatic prefix caching.

- Block pool without weights: hash chain, LRU eviction order, reference counts, take/touch, reset.
- Scheduler without weights: hit lengths (whole blocks, last token always recomputed), hits in the
  middle of a chunked prefill, rejected drafts never registered, preemption gets its blocks back, and
  a randomized simulation that tracks what every KV slot holds and checks that cached context is
  always the right KV and that no request ever writes a block another request references.
- Engine on a tiny checkpoint: identical greedy float32 outputs with caching on and off (chunked
  prefill, preemption, n-gram and draft-model speculation), exact scheduled-token counts for shared
  prefixes, counters, ``reset_prefix_cache``, and the server's usage / metrics / admin route.
"""

from __future__ import annotations

import asyncio
import logging
import random

import httpx
import pytest
from engine_utils import greedy, make_llm, tokens_of
from tiny_models import write_tiny_hf_checkpoint

from tandem import SamplingParams
from tandem.engine.stats import EngineStats, PeriodicLogger
from tandem.kv.block_pool import BlockPool, hash_block
from tandem.request import Request, RequestStatus
from tandem.scheduler import Scheduler, SchedulerOutput

BS = 4


def chain(*blocks: list[int]) -> list[bytes]:
    out, parent = [], None
    for toks in blocks:
        parent = hash_block(parent, toks)
        out.append(parent)
    return out


# ---- block pool ------------------------------------------------------------------------------------
def test_hash_chain():
    a, b = chain([1, 2, 3, 4], [5, 6, 7, 8])
    assert len(a) == 32 and chain([1, 2, 3, 4])[0] == a  # sha256, deterministic across runs
    assert hash_block(None, [5, 6, 7, 8]) != b  # same tokens, other prefix
    assert hash_block(a, [5, 6, 7, 9]) != b
    assert hash_block(None, [1, 2, 3, 4], ("lora", 1)) != a  # the extra-keys slot changes the hash
    assert hash_block(None, [1, 2, 3, 4], ()) == a


def test_lru_evicts_oldest_freed_tail_first():
    pool = BlockPool(6)
    hs = chain([1] * 4, [2] * 4, [3] * 4, [4] * 4)
    blocks = pool.allocate(4)
    for blk, h in zip(blocks, hs):
        assert pool.cache_block(blk, h)
    pool.free(blocks)  # tail first: the request's last block is the LRU's oldest
    pool.check_invariants()
    assert pool.usage == 0.0 and pool.num_free_blocks == 6 and pool.num_cached_blocks == 4
    assert pool.lookup(hs) == blocks
    assert pool.allocate(2) == [4, 5]  # plain free blocks go first: nothing evicted
    assert pool.lookup(hs) == blocks
    got = pool.allocate(1)
    assert got == [blocks[3]] and pool.block_hash(blocks[3]) is None  # evicted: the tail block
    assert pool.lookup(hs) == blocks[:3]
    pool.touch([blocks[0]])  # a hit revives the oldest remaining one: it leaves the LRU
    assert pool.allocate(1) == [blocks[2]]
    assert pool.allocate(1) == [blocks[1]]
    assert pool.lookup(hs) == [blocks[0]] and pool.num_evictions == 3
    pool.check_invariants()
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_shared_blocks_ref_counts_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(2)
    hs = chain([1] * 4, [2] * 4)
    assert all(pool.cache_block(b, h) for b, h in zip(a, hs))
    assert not pool.cache_block(a[0], hs[0])  # already hashed
    other = pool.allocate(1)
    assert not pool.cache_block(other[0], hs[0])  # a second copy of a cached block stays unhashed
    pool.touch(a)  # a second request shares both blocks
    assert pool.ref_counts[a[0]] == 2 and pool.usage == 0.75
    pool.free(a)
    assert pool.ref_counts[a[0]] == 1 and pool.num_evictable_blocks == 0
    pool.free(a + other)
    assert pool.num_evictable_blocks == 2 and pool.all_free()
    pool.check_invariants()
    with pytest.raises(RuntimeError):
        pool.free([a[0]])
    with pytest.raises(RuntimeError):
        pool.cache_block(other[0], hash_block(None, [9] * 4))  # nobody holds it


def test_take_counts_revived_hits_and_is_all_or_nothing():
    pool = BlockPool(4)
    a = pool.allocate(2)
    hs = chain([1] * 4, [2] * 4)
    for b, h in zip(a, hs):
        pool.cache_block(b, h)
    pool.free(a)
    assert pool.take(a, 3) is None  # 2 evictable hits + 3 new > 4 blocks
    pool.check_invariants()
    assert pool.num_evictable_blocks == 2 and pool.all_free()
    got = pool.take(a, 2)
    assert got[:2] == a and len(set(got)) == 4 and pool.num_free_blocks == 0
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = BlockPool(6)
    held = pool.allocate(2)
    gone = pool.allocate(2)
    hs = chain([1] * 4, [2] * 4, [3] * 4, [4] * 4)
    for b, h in zip(held + gone, hs):
        pool.cache_block(b, h)
    pool.free(gone)
    r = pool.reset_prefix_cache()  # blocks in use: only the free cached ones go
    assert (r.evicted_blocks, r.held_blocks, r.held_cached_blocks, r.complete) == (2, 2, 2, False)
    assert pool.lookup(hs) == held and pool.num_evictable_blocks == 0
    pool.check_invariants()
    hits = pool.lookup(hs[:2])
    pool.free(held)
    pool.reset_prefix_cache()  # a reset between lookup and take (server thread): take still works
    taken = pool.take(hits, 1)
    assert taken is not None and taken[:2] == hits
    pool.check_invariants()
    pool.free(taken)
    r = pool.reset_prefix_cache()
    assert r.complete and pool.num_cached_blocks == 0 and pool.lookup(hs) == []
    assert BlockPool(2, enable_caching=False).lookup(hs) == []


# ---- scheduler without weights -----------------------------------------------------------------------
def make_req(rid: str, tokens: list[int], max_tokens: int = 100, **kw) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **kw), (0,), 1024)


def sched(num_blocks: int = 64, budget: int = 64, **kw) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), BS, budget, 16, 1024, enable_prefix_caching=True, **kw)


def run_model(out: SchedulerOutput, new_token: int = 7, num_rejected: int = 0) -> None:
    for s in out.scheduled:
        r = s.request
        r.num_computed_tokens = s.start + s.num_new_tokens
        if s.samples:
            rej = min(num_rejected, len(s.spec_token_ids))
            r.num_computed_tokens -= rej
            r.token_ids.extend(s.spec_token_ids[:len(s.spec_token_ids) - rej])
            r.token_ids.append(new_token)
            r.spec_token_ids = []


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_second_request_computes_only_uncached_suffix():
    s = sched()
    a = make_req("a", list(range(1, 11)))  # 10 tokens: 2 full blocks once computed
    s.add(a)
    run_model(s.schedule())
    b = make_req("b", list(range(1, 9)) + [50, 51, 52])
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("a", 10, 1), ("b", 8, 3)]
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    assert s.pool.ref_counts[a.block_ids[0]] == 2 and b.num_cached_tokens == 8
    assert (s.prefix_cache.stats.queries, s.prefix_cache.stats.hits) == (10 + 11, 8)
    # the whole prompt cached: the last block is recomputed so the request samples
    c = make_req("c", a.token_ids[:8])
    s.add(c)
    run_model(out)
    assert plan(s.schedule())[-1] == ("c", 4, 4) and c.num_cached_tokens == 4
    for r in (a, b, c):
        s.finish(r, RequestStatus.FINISHED_STOPPED)
    assert s.pool.all_free() and s.pool.num_cached_blocks == 2  # a's; b's 3rd block is not full yet
    s.pool.check_invariants()


def test_hits_during_a_chunked_prefill_count_only_computed_blocks():
    s = sched(budget=12)
    prompt = list(range(1, 21))
    a = make_req("a", prompt)
    s.add(a)
    out = s.schedule()
    assert plan(out) == [("a", 0, 12)]
    run_model(out)  # 3 full blocks computed
    b = make_req("b", prompt + [99])
    s.add(b)
    out = s.schedule()  # a's blocks 3-4 are being computed in this very step: b cannot use them
    assert plan(out) == [("a", 12, 8), ("b", 12, 4)]
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]


def test_rejected_draft_slots_are_never_cached():
    s = sched()
    a = make_req("a", [1, 2, 3])
    s.add(a)
    run_model(s.schedule())  # 4 tokens, 3 computed
    a.spec_token_ids = [11, 12, 13, 14]
    out = s.schedule()
    assert plan(out) == [("a", 3, 5)]  # slots 3..7 written, 4..7 with drafts
    run_model(out, new_token=9, num_rejected=4)  # all rejected: 4 computed, tokens [1 2 3 7 9]
    s.schedule()
    assert s.pool.num_cached_blocks == 1 and s.pool.block_hash(a.block_ids[1]) is None
    b = make_req("b", [1, 2, 3, 7, 11, 12, 13, 14, 9])  # the drafts' tokens: their slots hold that KV
    s.add(b)
    s.schedule()  # ...but rolled back, so never registered: b hits only block 0
    assert b.num_cached_tokens == 4


def test_preempted_request_gets_its_own_blocks_back():
    s = sched(num_blocks=4, budget=64)
    a, b = make_req("a", list(range(1, 8))), make_req("b", list(range(20, 27)))
    s.add(a)
    s.add(b)
    run_model(s.schedule())  # 2 blocks each, pool full
    a.num_computed_tokens = b.num_computed_tokens = 8  # pretend both decoded one more token
    a.token_ids.append(5)
    b.token_ids.append(5)
    b_blocks = list(b.block_ids)
    out = s.schedule()  # a needs a 3rd block: b is preempted, its 2 full blocks stay cached
    assert out.preempted == ("b",) and s.pool.block_hash(b_blocks[0]) is not None
    # a's new block evicted the LRU's oldest: b's tail block; b's first block is still cached
    assert s.pool.block_hash(b_blocks[1]) is None
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert plan(out) == [("b", 4, 5)] and b.block_ids[0] == b_blocks[0]
    assert b.num_cached_tokens == 0  # per-request count is of the first admission only
    assert s.prefix_cache.stats.preempted_hits == 4


def test_prompt_logprobs_requests_skip_the_lookup():
    s = sched()
    a = make_req("a", list(range(1, 11)))
    s.add(a)
    run_model(s.schedule())
    b = make_req("b", list(range(1, 11)), prompt_logprobs=1)
    s.add(b)
    assert plan(s.schedule())[-1] == ("b", 0, 10)


class SlotTracker:
    """What each KV slot holds: a key of the token sequence up to the position it encodes (KV at
    position p depends on tokens 0..p)."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    def write(self, out: SchedulerOutput, pool: BlockPool) -> None:
        for s in out.scheduled:
            r = s.request
            keys, k = [], 0
            for t in r.token_ids + list(s.spec_token_ids):
                k = hash((k, t))
                keys.append(k)
            # context: every position before `start` must hold the KV of this request's own tokens
            for p in range(s.start):
                assert self.slots.get(r.block_ids[p // BS] * BS + p % BS) == keys[p], \
                    f"{r.request_id}: wrong KV at position {p}"
            for p in range(s.start, s.start + s.num_new_tokens):
                b = r.block_ids[p // BS]
                # no request writes a block another request references, nor a cached block
                assert pool.ref_counts[b] == 1 and pool.block_hash(b) is None
                self.slots[b * BS + p % BS] = keys[p]


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_keep_cached_kv_valid_and_never_share_writes(seed):
    """Shared prefixes, drafts with random rejections, stops inside accepted runs, aborts, a pool
    small enough to preempt, a small token budget: the context a request attends to is always its
    own tokens' KV, written blocks are never shared, and everything is freed at the end."""
    rng = random.Random(seed)
    s = Scheduler(BlockPool(20), BS, 24, 8, 1024, enable_prefix_caching=True)
    kv = SlotTracker()
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    pending = [make_req(str(i), rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 9))],
                        max_tokens=rng.randrange(1, 20)) for i in range(150)]
    live: list[Request] = []
    for step in range(5000):
        if pending and rng.random() < 0.5:
            r = pending.pop()
            s.add(r)
            live.append(r)
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            s.finish(victim, RequestStatus.FINISHED_ABORTED)
            live.remove(victim)
        out = s.schedule()
        kv.write(out, s.pool)
        s.pool.check_invariants()
        for x in out.scheduled:
            r = x.request
            r.num_computed_tokens = x.start + x.num_new_tokens
            if not x.samples:
                continue
            nspec = len(x.spec_token_ids)
            acc = rng.randrange(nspec + 1)
            r.num_computed_tokens -= nspec - acc
            new = list(x.spec_token_ids[:acc]) + [rng.randrange(3, 50)]
            r.spec_token_ids = []
            for t in new:  # like the engine: a stop inside an accepted run drops the rest
                r.token_ids.append(t)
                if r.num_output_tokens >= r.params.max_tokens:
                    s.finish(r, RequestStatus.FINISHED_LENGTH)
                    live.remove(r)
                    break
            if not r.status.finished and rng.random() < 0.7:  # propose drafts: often repeats
                r.spec_token_ids = [rng.choice(r.token_ids[-4:]) for _ in range(rng.randrange(1, 4))]
        if not pending and not live:
            break
    assert not live and s.num_preemptions > 0 and s.prefix_cache.stats.hits > 0
    assert s.pool.all_free() and s.pool.num_cached_blocks > 0
    s.pool.check_invariants()


# ---- engine on a tiny checkpoint -------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pc")
    target = write_tiny_hf_checkpoint(base, "llama", std=0.2, name="target")
    draft = write_tiny_hf_checkpoint(base, "qwen3", seed=7, std=0.2, name="draft", num_hidden_layers=1)
    return target, draft


def shared_prefix_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 100) for _ in range(L)] for L in (37, 22, 9)]
    return [{"prompt_token_ids": prefixes[i % 3] + [rng.randrange(3, 100) for _ in range(rng.randrange(1, 10))]}
            for i in range(n)]


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(15)


@pytest.fixture(scope="module")
def reference(dirs, prompts):
    llm = make_llm(dirs[0], enable_prefix_caching=False)
    return tokens_of(llm.generate(prompts, greedy(16), use_tqdm=False))


def check_target_writes(engine) -> None:
    """Wrap the target runner: every KV slot written must be in a block held by this request alone."""
    runner, pool, bs = engine.runner, engine.pool, engine.block_size
    inner = runner.forward_logits

    def checked(chunks, rows, **kw):
        for c in chunks:
            for p in range(c.start, c.start + len(c.token_ids)):
                b = c.block_ids[p // bs]
                assert pool.ref_counts[b] == 1 and pool.block_hash(b) is None, f"shared write to block {b}"
        return inner(chunks, rows, **kw)

    runner.forward_logits = checked


DRAFT = "draft"
CONFIGS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preempt": {"kv_cache_memory_bytes": 80 * 2048},  # 2 KiB per block
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 3}},
    "draft": {"speculative_config": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3},
              "kv_cache_memory_bytes": 36 * 3072, "max_model_len": 128, "max_num_batched_tokens": 24},  # 3 KiB/block
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_identical_with_caching_on(dirs, prompts, reference, name):
    kw = dict(CONFIGS[name])
    if "speculative_config" in kw and kw["speculative_config"].get("model") == DRAFT:
        kw["speculative_config"] = {**kw["speculative_config"], "model": str(dirs[1])}
    llm = make_llm(dirs[0], **kw)
    eng = llm.engine
    check_target_writes(eng)
    # first a few prompts alone, so the full batch afterwards starts with cached prefixes
    assert tokens_of(llm.generate(prompts[:3], greedy(16), use_tqdm=False)) == reference[:3]
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert tokens_of(outs) == reference
    assert eng.stats.prefix_cache_hits > 0 and sum(o.num_cached_tokens for o in outs) > 0
    assert all(o.num_cached_tokens % eng.block_size == 0 for o in outs)
    if name in ("preempt", "draft"):
        assert eng.scheduler.num_preemptions > 0
    if name in ("ngram", "draft"):
        assert eng.stats.spec.num_draft_tokens > 0
    assert eng.pool.all_free() and eng.pool.num_cached_blocks > 0
    eng.pool.check_invariants()


def _record(engine) -> list[SchedulerOutput]:
    log: list[SchedulerOutput] = []
    inner = engine.scheduler.schedule

    def schedule():
        out = inner()
        log.append(out)
        return out

    engine.scheduler.schedule = schedule
    return log


def _scheduled_for(log: list[SchedulerOutput], rid: str) -> list[tuple[int, int]]:
    return [(s.start, s.num_new_tokens) for out in log for s in out.scheduled if s.request.request_id == rid]


def test_shared_prefix_schedules_only_the_uncached_suffix(dirs):
    llm = make_llm(dirs[0])
    eng = llm.engine
    log = _record(eng)
    rng = random.Random(5)
    prefix = [rng.randrange(3, 100) for _ in range(32)]  # 8 full blocks of 4
    a = prefix + [11, 12, 13, 14, 15]  # 37 tokens
    out_a = llm.generate({"prompt_token_ids": a}, greedy(8), use_tqdm=False)[0]
    assert _scheduled_for(log, "0") == [(0, 37)] + [(37 + i, 1) for i in range(7)]
    assert out_a.num_cached_tokens == 0
    # b shares the 32-token prefix: its first step computes the 6 other tokens only
    b = prefix + [21, 22, 23, 24, 25, 26]
    log.clear()
    out_b = llm.generate({"prompt_token_ids": b}, greedy(4), use_tqdm=False)[0]
    assert _scheduled_for(log, "1") == [(32, 6), (38, 1), (39, 1), (40, 1)]
    assert log[0].num_batched_tokens == 6  # instead of 38 without the cache
    assert out_b.num_cached_tokens == 32
    # a's output tokens were cached too: a's prompt + its first 7 outputs = 44 tokens = 11 blocks
    c = a + out_a.outputs[0].token_ids[:7] + [30]
    log.clear()
    out_c = llm.generate({"prompt_token_ids": c}, greedy(2), use_tqdm=False)[0]
    assert _scheduled_for(log, "2") == [(44, 1), (45, 1)] and out_c.num_cached_tokens == 44
    # the whole prompt cached: the last (partial) block is recomputed, and the output is the same
    log.clear()
    out_d = llm.generate({"prompt_token_ids": a}, greedy(8), use_tqdm=False)[0]
    assert _scheduled_for(log, "3")[0] == (36, 1) and out_d.num_cached_tokens == 36
    assert out_d.outputs[0].token_ids == out_a.outputs[0].token_ids
    st = eng.stats
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (37 + 38 + 45 + 37, 0 + 32 + 44 + 36)
    # prompt logprobs need every prompt position: no lookup
    out_e = llm.generate({"prompt_token_ids": a}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                         use_tqdm=False)[0]
    assert out_e.num_cached_tokens == 0 and len(out_e.prompt_logprobs) == len(a)
    # caching off: same numbers as before this change
    off = make_llm(dirs[0], enable_prefix_caching=False)
    off_log = _record(off.engine)
    off.generate([{"prompt_token_ids": a}], greedy(2), use_tqdm=False)
    off.generate([{"prompt_token_ids": b}], greedy(2), use_tqdm=False)
    assert [o.num_batched_tokens for o in off_log] == [37, 1, 38, 1]
    assert off.engine.pool.num_cached_blocks == 0 and off.engine.stats.prefix_cache_queries == 0


def test_engine_reset_prefix_cache(dirs, prompts):
    llm = make_llm(dirs[0])
    eng = llm.engine
    llm.generate(prompts[:3], greedy(4), use_tqdm=False)
    cached = eng.pool.num_cached_blocks
    assert cached > 0
    eng.add_request("x", None, greedy(50), prompt_token_ids=prompts[0]["prompt_token_ids"])
    eng.step()
    r = eng.reset_prefix_cache()  # a request is running: only the free cached blocks go
    assert not r.complete and r.held_blocks == len(eng.scheduler.running[0].block_ids)
    assert r.evicted_blocks == cached - r.held_cached_blocks and eng.pool.num_cached_blocks == r.held_cached_blocks
    eng.abort_request("x")
    eng.step()
    r = eng.reset_prefix_cache()
    assert r.complete and eng.pool.num_cached_blocks == 0 and eng.pool.all_free()
    out = llm.generate(prompts[0], greedy(2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0


def test_log_line_and_startup_sizing(dirs, caplog):
    with caplog.at_level(logging.INFO, logger="tandem"):
        make_llm(dirs[0], kv_cache_memory_bytes=100 * 2048)
    assert "KV cache sized by kv_cache_memory_bytes: 100 blocks × 4 tokens = 400 tokens" in caplog.text
    st = EngineStats(prefix_cache_queries=200, prefix_cache_hits=50)
    log = PeriodicLogger(interval=0.0)
    with caplog.at_level(logging.INFO, logger="tandem"):
        log.maybe_log(st, 1, 0, 0.5)
        assert "Prefix cache hit rate: 25.0%" in caplog.records[-1].getMessage()
        st.prefix_cache_queries, st.prefix_cache_hits = 300, 150  # this interval: 100 of 100
        log.maybe_log(st, 1, 0, 0.5)
        assert "Prefix cache hit rate: 100.0%" in caplog.records[-1].getMessage()
        PeriodicLogger(interval=0.0).maybe_log(EngineStats(), 0, 0, 0.0)
        assert "Prefix cache" not in caplog.records[-1].getMessage()  # caching off: no figure


# ---- server --------------------------------------------------------------------------------------------
def test_server_usage_metrics_and_reset_route(dirs):
    from tandem.server.api import build_app
    from tandem.server.async_engine import AsyncEngine

    llm = make_llm(dirs[0], max_model_len=256)
    ae = AsyncEngine(llm.engine, "tiny")
    app = build_app(ae, ["tiny"], "sekret")
    auth = {"Authorization": "Bearer sekret"}
    prompt = list(range(10, 40))  # 30 tokens: 7 full blocks cacheable (28 tokens, last token recomputed)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def go(c: httpx.AsyncClient):
        first = (await c.post("/v1/completions", json=body, headers=auth)).json()
        second = (await c.post("/v1/completions", json=body, headers=auth)).json()
        metrics = (await c.get("/metrics", headers=auth)).text
        denied = await c.post("/reset_prefix_cache")
        reset = await c.post("/reset_prefix_cache", headers=auth)
        third = (await c.post("/v1/completions", json=body, headers=auth)).json()
        return first, second, metrics, denied, reset, third

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await go(c)

    try:
        first, second, metrics, denied, reset, third = asyncio.run(main())
    finally:
        ae.shutdown()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 28
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert 'tandem:prefix_cache_queries_total{model_name="tiny"} 60.0' in metrics
    assert 'tandem:prefix_cache_hits_total{model_name="tiny"} 28.0' in metrics
    assert denied.status_code == 401
    assert reset.status_code == 200 and reset.json()["success"] is True and reset.json()["evicted_blocks"] > 0
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_server_reset_while_requests_run_is_a_400(dirs):
    from tandem.server.api import build_app
    from tandem.server.async_engine import AsyncEngine

    llm = make_llm(dirs[0])
    eng = llm.engine
    llm.generate({"prompt_token_ids": list(range(10, 30))}, greedy(4), use_tqdm=False)
    ae = AsyncEngine(eng, "tiny", start=False)  # drive the engine from this thread
    app = build_app(ae, ["tiny"])
    eng.add_request("busy", None, greedy(50), prompt_token_ids=list(range(40, 60)))
    eng.step()
    eng.step()  # busy's 5 computed blocks are registered (held and cached)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/reset_prefix_cache")

    resp = asyncio.run(main())
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "prefix_cache_in_use" and "dropped 5 cached free block(s)" in err["message"]
    assert eng.pool.num_evictable_blocks == 0 and eng.pool.num_cached_blocks == 5  # the running one's blocks


def test_on_by_default_everywhere():
    from tandem.cli import build_parser
    from tandem.config import CacheConfig

    assert CacheConfig().enable_prefix_caching
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).enable_prefix_caching is True
    assert parser.parse_args(["generate", "hi", "--no-enable-prefix-caching"]).enable_prefix_caching is False
