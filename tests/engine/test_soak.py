"""Soak: 1000 mixed requests through one engine under pressure — no leaks, no lost requests.

Prefix caching on, n-gram speculation on, a KV cache far too small for the load (preemption), a small
token budget (chunked prefill), requests arriving in waves, ~10 % aborted at random moments (waiting
or running). Every request that was not aborted must finish with exactly the greedy output of a
reference run without caching, speculation or preemption; at the end every block is free or in the
evictable cache, no reference is left, and no per-request state is left behind.
"""

from __future__ import annotations

import random

from engine_utils import greedy, make_llm
from tiny_models import write_tiny_hf_checkpoint

N = 1000


def workload(seed: int = 0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 100) for _ in range(rng.randrange(4, 40))] for _ in range(12)]
    prompts, params = [], []
    for _ in range(N):
        suffix = [rng.randrange(3, 100) for _ in range(rng.randrange(0, 10))]
        prompts.append(rng.choice(prefixes) + suffix)
        stop = [rng.randrange(3, 100)] if rng.random() < 0.2 else None  # stops inside accepted runs
        params.append(greedy(rng.randrange(1, 13), stop_token_ids=stop))
    aborts = {i: rng.randrange(0, 25) for i in rng.sample(range(N), N // 10)}  # id → steps after arrival
    return prompts, params, aborts


def test_soak_1000_mixed_requests(tmp_path):
    path = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2)  # peaked: n-gram drafts get accepted
    prompts, params, aborts = workload()

    ref_engine = make_llm(path, enable_prefix_caching=False, max_model_len=128).engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        ref_engine.add_request(str(i), None, sp, prompt_token_ids=p)
    reference: dict[str, list[int]] = {}
    while ref_engine.has_unfinished_requests():
        for o in ref_engine.step():
            if o.finished:
                reference[o.request_id] = o.outputs[0].token_ids
    assert len(reference) == N and ref_engine.scheduler.num_preemptions == 0

    llm = make_llm(path, max_model_len=128, kv_cache_memory_bytes=48 * 2048, max_num_batched_tokens=48,
                   max_num_seqs=32, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    eng, pool = llm.engine, llm.engine.pool
    assert eng.num_blocks == 48 and eng.scheduler.prefix_cache.enabled
    forward = eng.runner.forward_logits

    def checked_forward(chunks, rows, **kw):  # target KV is only ever written into blocks held alone
        for c in chunks:
            for b in {c.block_ids[p // eng.block_size] for p in range(c.start, c.start + len(c.token_ids))}:
                assert pool.ref_counts[b] == 1 and pool.block_hash(b) is None
        return forward(chunks, rows, **kw)

    eng.runner.forward_logits = checked_forward
    rng = random.Random(1)
    results: dict[str, tuple[str | None, list[int]]] = {}
    due: dict[int, list[str]] = {}  # step → request ids to abort then
    aborted: set[str] = set()
    added = step = 0
    while added < N or eng.has_unfinished_requests():
        for _ in range(min(rng.randrange(0, 9), N - added)):
            rid = str(added)
            eng.add_request(rid, None, params[added], prompt_token_ids=prompts[added])
            if added in aborts:
                due.setdefault(step + aborts[added], []).append(rid)
            added += 1
        for rid in due.pop(step, []):
            if rid not in results:  # still in flight: abort it (a no-op for finished ones anyway)
                aborted.add(rid)
            eng.abort_request(rid)
        for o in eng.step():
            if o.finished:
                assert o.request_id not in results, "a request finished twice"
                results[o.request_id] = (o.outputs[0].finish_reason, o.outputs[0].token_ids)
        step += 1
        if step % 64 == 0:
            pool.check_invariants()
            assert sum(pool.ref_counts) == sum(len(r.block_ids) for r in eng.scheduler.running)

    assert len(results) == N  # every request came back, aborted ones included
    for rid, (reason, toks) in results.items():
        if rid in aborted:
            assert reason == "abort"
            assert toks == reference[rid][:len(toks)]  # what it produced before the abort was right
        else:
            assert reason in ("length", "stop") and toks == reference[rid], rid
    assert 50 <= len(aborted) <= N // 10
    st = eng.stats
    assert eng.scheduler.num_preemptions > 0
    assert st.prefix_cache_hits > 0 and st.spec.num_accepted_tokens > 0
    # nothing leaked: all blocks free or evictable, no references, no per-request state
    assert pool.all_free() and not any(pool.ref_counts) and pool.num_free_blocks == pool.num_blocks
    assert pool.num_cached_blocks == pool.num_evictable_blocks > 0
    pool.check_invariants()
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.output_processor.groups
    assert not eng.scheduler.prefix_cache._state
    print(f"soak: {step} steps, {eng.scheduler.num_preemptions} preemptions, {len(aborted)} aborted, "
          f"prefix cache {st.prefix_cache_hits}/{st.prefix_cache_queries} tokens, "
          f"accepted {st.spec.num_accepted_tokens}/{st.spec.num_draft_tokens} drafts")
