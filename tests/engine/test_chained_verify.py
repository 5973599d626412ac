"""Chained verifies (engine/async_decode.py) on CPU: a greedy verify left on the device, the next
step's drafts proposed from what it would leave if it accepted them all and launched before it is
read (moved back on the device by what it rejected) — the tokens, texts and finish reasons are
those of plain decoding, whether the assumptions hold or fail, through stops, length limits,
preemption, chunked prefill, sampled neighbours and the goodput policy."""

from __future__ import annotations

import pytest

from engine_utils import greedy, make_llm, random_prompts
from tandem import SamplingParams
from tandem.spec_decode.policy_cost import StepCostModel
from tiny_models import write_tiny_hf_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama_chained"), "llama")


@pytest.fixture(scope="module")
def plain(llama_dir):
    return make_llm(llama_dir, async_scheduling=False)


def _prompts(n_repetitive: int, n_random: int, seed: int = 3) -> list[dict]:
    """Repetitive prompts (n-gram matches: long accepted runs, assumptions that hold) and random
    ones (matches that fail)."""
    rep = [([5, 6, 7, 8, 9, 10][: 3 + i % 4] * 12)[: 14 + i] for i in range(n_repetitive)]
    return [{"prompt_token_ids": p} for p in rep + random_prompts(n_random, 100, lo=4, hi=20, seed=seed)]


def _summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


def _chained(llama_dir, **kw):
    llm = make_llm(llama_dir, async_scheduling=True, speculative_config=kw.pop("spec", NGRAM), **kw)
    assert llm.engine.speculator.chains
    return llm


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("batch", [1, 12])
def test_chained_verifies_give_the_tokens_of_plain_decoding(llama_dir, plain, batch, spec):
    prompts = _prompts(8, 4)[:batch] if batch > 1 else _prompts(2, 0)[1:]  # (one whose output repeats)
    llm = _chained(llama_dir, spec=spec)
    eng = llm.engine
    sync_verifies, chained_drafts = [], []
    start, launch = eng.executor.start, eng.executor.launch
    eng.executor.start = lambda sched, *a: (sync_verifies.append(any(s.spec_token_ids for s in sched.scheduled)),
                                            start(sched, *a))[1]

    def spy(sched, feed=None, drafts=None):
        if feed is not None and feed.verifies:
            chained_drafts.extend(len(s.spec_token_ids) for s in sched.scheduled)
        return launch(sched, feed, drafts)

    eng.executor.launch = spy
    got = _summary(llm.generate(prompts, greedy(40), use_tqdm=False))
    assert not any(sync_verifies)  # every verify chained or launched: the pipeline never drains to draft
    if spec is NGRAM:  # a chained verify drafts the full k (the emitted token is asked for apart)
        assert max(chained_drafts) == 4
    assert got == _summary(plain.generate(prompts, greedy(40), use_tqdm=False))
    assert eng.num_chained_verifies > 0
    assert eng.stats.spec.num_assumed_held > 0
    if batch > 1:
        assert eng.stats.spec.num_assumed_failed > 0  # drafts on a failed assumption: verified all the same
    assert eng.stats.spec.num_accepted_tokens > 0


def test_stops_and_limits_inside_chained_verifies(llama_dir, plain):
    prompts = _prompts(6, 3)
    probe = plain.generate(prompts[:1], greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    params = [
        greedy(40, stop_token_ids=[probe[9]]),  # a stop inside an accepted run: its tail dropped
        greedy(7),  # max_tokens mid-verify
        greedy(13),
        SamplingParams(temperature=0.0, max_tokens=30),  # EOS may stop it
        greedy(25, min_tokens=12),  # host logits processing until min_tokens: no drafts ahead then
        greedy(30, stop=["a"]),  # stop strings are decoded at once
        greedy(60),  # runs into max_model_len
        greedy(22),
        greedy(18),
    ]
    want = _summary(make_llm(llama_dir, async_scheduling=False, max_model_len=64).generate(
        prompts, params, use_tqdm=False))
    llm = _chained(llama_dir, max_model_len=64)
    assert _summary(llm.generate(prompts, params, use_tqdm=False)) == want
    assert want[0][2] == "stop" and want[6][2] == "length"
    assert llm.engine.num_chained_verifies > 0


def test_preemption_and_chunked_prefill_under_chained_verifies(llama_dir, plain):
    prompts = _prompts(10, 6, seed=7)
    params = [greedy(20 + 3 * (i % 5)) for i in range(len(prompts))]
    want = _summary(plain.generate(prompts, params, use_tqdm=False))
    kw = dict(kv_cache_memory_bytes=90 * 2048, max_model_len=128, max_num_batched_tokens=48)  # 2 KiB per block
    llm = _chained(llama_dir, **kw)
    assert _summary(llm.generate(prompts, params, use_tqdm=False)) == want
    eng = llm.engine
    assert eng.stats.num_preemptions > 0 and eng.num_chained_verifies > 0


def test_sampled_neighbours_stop_the_drafts_not_the_chain(llama_dir):
    """A seeded sampled request gets the same tokens as without speculation; while it runs, the
    greedy ones draft nothing ahead (only greedy drafts are checked on the device), and they chain
    again after it finishes."""
    prompts = _prompts(4, 0)
    params = [greedy(40), greedy(40), SamplingParams(temperature=0.9, seed=11, max_tokens=12), greedy(30)]
    want = _summary(make_llm(llama_dir, async_scheduling=False).generate(prompts, params, use_tqdm=False))
    llm = _chained(llama_dir)
    assert _summary(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.engine.num_chained_verifies > 0


def test_the_policy_chains_verifies(llama_dir, plain, monkeypatch):
    """With the goodput policy on (the default) the drafts ahead are its choice; a proposal whose
    assumption held is scored like any other."""
    monkeypatch.setattr(StepCostModel, "overhead", lambda self, b: (0.0, 0.0))  # a verify always pays
    prompts = _prompts(4, 0)
    llm = _chained(llama_dir, spec={**NGRAM, "disable_by_acceptance": None})
    eng = llm.engine
    assert eng.policy is not None
    assert _summary(llm.generate(prompts, greedy(48), use_tqdm=False)) == _summary(
        plain.generate(prompts, greedy(48), use_tqdm=False))
    assert eng.num_chained_verifies > 0 and eng.policy.acceptance.num_scored > 0


def test_abort_and_new_requests_mid_chain(llama_dir, plain):
    """An abort while a chained verify is in flight, and a request arriving mid-chain: outputs as
    with synchronous speculation, every block returned, the bookkeeping consistent after each step."""
    prompts = [p["prompt_token_ids"] for p in _prompts(4, 0)]
    results = []
    for asy in (False, True):
        eng = make_llm(llama_dir, async_scheduling=asy, speculative_config=NGRAM).engine
        for rid, p in zip("ab", prompts):
            eng.add_request(rid, p, greedy(30))
        final, calls = {}, 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            calls += 1
            for r in eng.scheduler.running:  # placeholders cover exactly the uncomputed tail
                assert r.num_computed_tokens == r.num_tokens - 1 or r.num_output_tokens == 0
            if calls == 6:
                eng.abort_request("b")
                eng.add_request("c", prompts[2], greedy(20))
            if calls == 9:
                eng.add_request("d", prompts[3], greedy(25))
        assert eng.num_running == 0 and eng.kv_usage == 0.0
        if asy:
            assert eng.num_chained_verifies > 0
        results.append(final)
    sync, chained = results
    assert {k: v for k, v in chained.items() if k != "b"} == {k: v for k, v in sync.items() if k != "b"}
    assert len(sync["c"][0]) == 20
    # the abort keeps what was read when it came (a chained engine reads a step later): a prefix
    full = plain.generate([{"prompt_token_ids": prompts[1]}], greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    for toks, reason in (sync["b"], chained["b"]):
        assert reason == "abort" and toks == full[:len(toks)]


def test_prefix_cache_under_chained_verifies(llama_dir, plain):
    """Blocks registered while verifies are chained hold only tokens the host has read (never an
    assumed one): later requests sharing their prefixes hit them and still decode as without caching."""
    base = _prompts(3, 0)
    params = greedy(36)
    llm = _chained(llama_dir, enable_prefix_caching=True)
    first = _summary(llm.generate(base, params, use_tqdm=False))
    assert first == _summary(plain.generate(base, params, use_tqdm=False))
    # the same prompts extended by their own outputs: their blocks come from the cache
    again = [{"prompt_token_ids": p["prompt_token_ids"] + o[0][:20]} for p, o in zip(base, first)]
    outs = llm.generate(again, params, use_tqdm=False)
    assert _summary(outs) == _summary(plain.generate(again, params, use_tqdm=False))
    assert all(o.num_cached_tokens > len(p["prompt_token_ids"]) for o, p in zip(outs, base))
    assert llm.engine.num_chained_verifies > 0


def test_chained_drafts_show_in_the_periodic_log(llama_dir, caplog):
    import logging

    from tandem.engine.stats import PeriodicLogger

    llm = _chained(llama_dir)
    llm.generate(_prompts(4, 2), greedy(30), use_tqdm=False)
    spec = llm.engine.stats.spec
    held, failed = spec.num_assumed_held, spec.num_assumed_failed
    assert held > 0 and failed > 0
    with caplog.at_level(logging.INFO, logger="tandem"):
        PeriodicLogger(interval=0.0).maybe_log(llm.engine.stats, 0, 0, 0.0)
    assert f"Chained drafts: {held + failed}, assumption held {100 * held / (held + failed):.1f}%" in caplog.text
