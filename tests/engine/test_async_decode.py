"""Asynchronous decode (engine/async_decode.py) on CPU: the engine with the next step queued before
the previous step's tokens are read gives the same tokens, texts and finish reasons as the synchronous
engine, chains where it can, and stops chaining where it must (host-side sampling, new requests,
stops, aborts)."""

from __future__ import annotations

from collections import Counter

import pytest

from engine_utils import chi2_same, greedy, make_llm, random_prompts, tokens_of
from tandem import SamplingParams
from tandem.config import SchedulerConfig
from tandem.engine.async_decode import device_greedy, device_sampled
from tandem.errors import ConfigError
from tandem.request import Request
from tiny_models import write_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama_async"), "llama")


@pytest.fixture(scope="module")
def engines(llama_dir):
    return make_llm(llama_dir, async_scheduling=False), make_llm(llama_dir, async_scheduling=True)


def _summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


def test_async_engine_matches_sync_on_mixed_requests(engines):
    sync, asy = engines
    assert not sync.engine.async_scheduling and asy.engine.async_scheduling
    prompts = [{"prompt_token_ids": p} for p in random_prompts(7, 100, lo=4, hi=20, seed=3)]
    probe = tokens_of(sync.generate(prompts[2:3], greedy(12), use_tqdm=False))[0]
    params = [
        greedy(20),
        greedy(7),  # finishes by length while the others go on
        greedy(16, stop_token_ids=[probe[5]]),  # stops on a token mid-chain (its chained step is dropped)
        SamplingParams(temperature=0.8, seed=1, max_tokens=9),  # host sampling: no chaining meanwhile
        greedy(11, min_tokens=5),  # chained only once min_tokens is reached
        greedy(6, logprobs=2),  # logprobs are computed on the host
        SamplingParams(temperature=0.0, max_tokens=14),  # EOS may stop it
    ]
    before = asy.engine.num_chained_steps
    want = _summary(sync.generate(prompts, params, use_tqdm=False))
    got = _summary(asy.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert want[2][2] == "stop" and len(want[2][0]) <= 6
    assert asy.engine.num_chained_steps > before  # the async path ran
    # Same for a batch of plain greedy requests (chained from the second step on).
    before = asy.engine.num_chained_steps
    assert tokens_of(asy.generate(prompts, greedy(18), use_tqdm=False)) == tokens_of(
        sync.generate(prompts, greedy(18), use_tqdm=False))
    assert asy.engine.num_chained_steps - before >= 15
    # A stop inside a chain: the step already queued for the stopped request is discarded.
    stop_params = [greedy(16, stop_token_ids=[probe[5]]) if i == 2 else greedy(16) for i in range(len(prompts))]
    want = _summary(sync.generate(prompts, stop_params, use_tqdm=False))
    assert want[2][2] == "stop" and len(want[2][0]) <= 6
    assert _summary(asy.generate(prompts, stop_params, use_tqdm=False)) == want


def test_sampled_steps_chain_on_the_device_and_match_the_synchronous_engine(engines):
    """Temperature / top-k / top-p / min-p decoding runs asynchronously too: the tokens are drawn on
    the device and the next step is launched before they are read. A seeded request's tokens are the
    synchronous engine's (its draw is keyed by output position, placeholders counted); unseeded
    requests draw from the engine's generator in the same order, so the same generator state gives
    the same tokens; mixed greedy and sampled rows share a step."""
    sync, asy = engines
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 100, lo=4, hi=20, seed=12)]
    params = [
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=7, seed=6, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.1, seed=8, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=30, top_p=0.95, min_p=0.02, seed=9, max_tokens=24,
                       ignore_eos=True, stop_token_ids=[13]),
        greedy(24),
        SamplingParams(temperature=1.0, seed=10, n=2, max_tokens=22, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=24),  # EOS may stop it
    ]
    seeded = params[:7]
    before = asy.engine.num_chained_steps
    want = _summary(sync.generate(prompts[:7], seeded, use_tqdm=False))
    got = _summary(asy.generate(prompts[:7], seeded, use_tqdm=False))
    assert got == want
    assert asy.engine.num_chained_steps - before >= 15
    assert len({tuple(w[0]) for w in want}) == len(want)  # (sampled: no two alike)
    # Unseeded: equal while no request finishes before the others (a finished request's discarded
    # chained step draws its row too, after which the shared stream is used differently: same law).
    for llm in engines:
        llm.engine.generator.manual_seed(1234)
    unseeded = [p.clone(seed=None, max_tokens=20, stop_token_ids=[]) for p in seeded]
    want = _summary(sync.generate(prompts[:7], unseeded, use_tqdm=False))
    assert _summary(asy.generate(prompts[:7], unseeded, use_tqdm=False)) == want
    # ... and with requests finishing early, every output is a complete one
    got = asy.generate(prompts, [p.clone(seed=None) for p in params], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in got][:4] == [24, 20, 24, 17]


def test_sampled_asynchronous_decode_draws_from_the_target_distribution(engines):
    """The chained steps' tokens (position 2 is drawn by a step launched before position 1 was read)
    follow the synchronous engine's distribution (two-sample chi-square, unseeded requests)."""
    sync, asy = engines
    params = SamplingParams(temperature=1.0, top_k=40, max_tokens=3, ignore_eos=True)
    n = 1200
    before = asy.engine.num_chained_steps
    counts = []
    for llm in engines:
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * n, params, use_tqdm=False)
        counts.append(Counter(o.outputs[0].token_ids[2] for o in outs))
    assert asy.engine.num_chained_steps > before
    assert len(counts[1]) > 10  # a distribution, not an argmax
    assert chi2_same(*counts) > 1e-3


def test_async_abort_and_new_request_mid_chain(engines):
    results = []
    for llm in engines:
        eng = llm.engine
        prompts = random_prompts(3, 100, lo=5, hi=15, seed=9)
        eng.add_request("a", prompts[0], greedy(12))
        eng.add_request("b", prompts[1], greedy(12))
        final = {}
        calls = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            calls += 1
            for r in eng.scheduler.running:  # bookkeeping: everything before the last token is computed
                assert r.num_output_tokens == 0 or r.num_computed_tokens == r.num_tokens - 1
            if calls == 4:
                eng.abort_request("b")
                eng.add_request("c", prompts[2], greedy(10))
        assert eng.num_running == 0 and eng.kv_usage == 0.0
        results.append(final)
    sync, asy = results
    assert asy == sync
    assert sync["b"][1] == "abort" and sync["a"][1] == "length" and len(sync["c"][0]) == 10


def test_device_greedy_and_sampled_rules():
    def req(**kw) -> Request:
        return Request(request_id="r", prompt_token_ids=[1, 2], params=SamplingParams(**kw), eos_token_ids=(0,),
                       max_model_len=64)

    assert device_greedy(req(temperature=0.0), 0)
    assert not device_greedy(req(temperature=0.7), 5)
    # sampled on the device: the parameters alone, nothing applied or read on the host
    assert device_sampled(req(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=3), 5)
    assert device_sampled(req(temperature=0.0), 0)
    assert not device_sampled(req(temperature=0.7, logprobs=0), 5)
    assert not device_sampled(req(temperature=0.7, presence_penalty=0.5), 5)
    assert not device_sampled(req(temperature=0.7, min_tokens=6, max_tokens=8), 5)
    assert not device_greedy(req(temperature=0.0, logprobs=1), 5)
    assert not device_greedy(req(temperature=0.0, repetition_penalty=1.2), 5)
    assert not device_greedy(req(temperature=0.0, logit_bias={3: 1.0}), 5)
    assert not device_greedy(req(temperature=0.0, min_tokens=4, max_tokens=8), 3)
    assert device_greedy(req(temperature=0.0, min_tokens=4, max_tokens=8), 4)


def test_async_scheduling_config_value_is_checked():
    with pytest.raises(ConfigError) as e:
        SchedulerConfig(async_scheduling="yes")  # type: ignore[arg-type]
    assert e.value.key == "async_scheduling" and "allowed" in str(e.value)


def test_speculation_with_a_model_proposer_runs_synchronously(llama_dir):
    """A draft model proposes from read tokens: its verifies are read before the next step is
    proposed (host proposers' chain: test_chained_verify.py)."""
    llm = make_llm(llama_dir, async_scheduling=True,
                   speculative_config={"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": p * 3} for p in random_prompts(2, 100, lo=3, hi=6, seed=4)]
    llm.generate(prompts, greedy(12), use_tqdm=False)
    assert llm.engine.num_chained_steps == 0 and llm.engine.stats.spec.num_drafts > 0


def test_placeholder_decodes_go_through_the_scheduler_under_kv_pressure(llama_dir):
    """Steps launched before the previous one is read are scheduled by ``Scheduler.schedule`` like
    any other (placeholders counted as tokens): KV allocation and preemption apply, and a request
    preempted while its token is in flight keeps that token. Same outputs as the synchronous engine."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 100, lo=20, hi=40, seed=21)]
    kw = dict(kv_cache_memory_bytes=70 * 2048, max_model_len=128)  # 2 KiB per block: 70 blocks
    want = tokens_of(make_llm(llama_dir, async_scheduling=False, **kw).generate(prompts, greedy(40), use_tqdm=False))
    llm = make_llm(llama_dir, async_scheduling=True, **kw)
    eng = llm.engine
    ahead = {"steps": 0, "preempted": 0}
    inner = eng.scheduler.schedule

    def schedule():
        with_placeholders = [r for r in eng.scheduler.running if r.num_output_placeholders]
        out = inner()
        if with_placeholders:  # scheduled while a step is in flight
            ahead["steps"] += 1
            ahead["preempted"] += len(out.preempted)
            for s in out.scheduled:  # one placeholder decode each, at the first unknown position
                assert s.num_new_tokens == 1 and s.start == len(s.request.token_ids) and s.samples
        return out

    eng.scheduler.schedule = schedule
    assert tokens_of(llm.generate(prompts, greedy(40), use_tqdm=False)) == want
    assert ahead["steps"] == eng.num_chained_steps > 20
    assert ahead["preempted"] > 0 and eng.scheduler.num_preemptions >= ahead["preempted"]
    assert eng.pool.all_free() and all(r.num_output_placeholders == 0 for r in eng.scheduler.waiting)


def test_full_batch_keeps_chaining_while_a_queue_waits(llama_dir):
    """With ``max_num_seqs`` requests running, a waiting request could not be admitted by the next
    step anyway: steps chain on (a throughput workload's queue no longer makes every step
    synchronous) and the outputs stay the synchronous engine's."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(10, 100, lo=4, hi=20, seed=5)]
    params = [greedy(12 + 3 * (i % 4)) for i in range(len(prompts))]
    want = tokens_of(make_llm(llama_dir, async_scheduling=False, max_num_seqs=4).generate(
        prompts, params, use_tqdm=False))
    llm = make_llm(llama_dir, async_scheduling=True, max_num_seqs=4)
    eng = llm.engine
    chained_with_queue = 0
    inner = eng.executor.launch

    def launch(sched, feed=None, drafts=None):
        nonlocal chained_with_queue
        chained_with_queue += feed is not None and bool(eng.scheduler.waiting)
        return inner(sched, feed, drafts)

    eng.executor.launch = launch
    assert tokens_of(llm.generate(prompts, params, use_tqdm=False)) == want
    assert chained_with_queue >= 10, chained_with_queue  # 0 when any waiting request stopped chaining


def test_a_max_tokens_finish_does_not_stop_the_chain(engines):
    """A request finishing by max_tokens at its pending token is decoded once more (the token is
    discarded, as after a stop): the other requests' steps stay chained, outputs unchanged."""
    sync, asy = engines
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 100, lo=4, hi=12, seed=8)]
    params = [greedy(4 + 2 * i) for i in range(len(prompts))]  # a length finish every other step
    want = _summary(sync.generate(prompts, params, use_tqdm=False))
    before = asy.engine.num_chained_steps
    assert _summary(asy.generate(prompts, params, use_tqdm=False)) == want
    assert [len(w[0]) for w in want] == [4 + 2 * i for i in range(len(prompts))]
    assert asy.engine.num_chained_steps - before >= 14  # 9 when each length finish broke the chain
    assert asy.engine.pool.all_free()


def test_admission_in_groups_leaves_more_steps_chained_and_outputs_unchanged(llama_dir):
    """With a queue longer than the free seats, admitting in groups of 4 makes fewer steps that
    carry prefill (each one synchronous) and more chained ones; the tokens stay the synchronous
    engine's."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(40, 100, lo=4, hi=20, seed=6)]
    params = [greedy(6 + 5 * (i % 5)) for i in range(len(prompts))]
    want = tokens_of(make_llm(llama_dir, async_scheduling=False, max_num_seqs=8).generate(
        prompts, params, use_tqdm=False))
    counts = {}
    for group in (1, 4):
        llm = make_llm(llama_dir, async_scheduling=True, max_num_seqs=8, admission_group=group)
        admitting = 0
        inner = llm.engine.scheduler.schedule

        def schedule(inner=inner):
            nonlocal admitting
            out = inner()
            admitting += any(s.start == 0 for s in out.scheduled)
            return out

        llm.engine.scheduler.schedule = schedule
        assert tokens_of(llm.generate(prompts, params, use_tqdm=False)) == want
        counts[group] = (admitting, llm.engine.num_chained_steps)
    (adm1, chained1), (adm4, chained4) = counts[1], counts[4]
    assert adm4 < adm1, counts
    assert chained4 > chained1, counts


def test_admission_group_config_value_is_checked():
    with pytest.raises(ConfigError, match="admission_group"):
        SchedulerConfig(admission_group=0)
    assert SchedulerConfig(max_num_seqs=256).resolved_admission_group(graphs=True) == 32
    assert SchedulerConfig(max_num_seqs=256).resolved_admission_group(graphs=False) == 1
    assert SchedulerConfig(admission_group=3).resolved_admission_group(graphs=True) == 3


def test_verify_text_is_decoded_while_the_next_step_runs(llama_dir):
    """An asynchronous engine decodes a verify step's text after launching the next step (the output
    comes one step() later): tokens, texts, stop strings, DELTA pieces, finish reasons and an abort's
    final text are those of the synchronous engine. (A draft model: its verifies run
    synchronously; host proposers' chain, test_chained_verify.py.)"""
    from tandem.sampling_params import RequestOutputKind

    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3,
            "disable_by_acceptance": False}
    sync = make_llm(llama_dir, async_scheduling=False, speculative_config=spec)
    asy = make_llm(llama_dir, async_scheduling=True, speculative_config=spec)
    prompts = [{"prompt_token_ids": p * 3} for p in random_prompts(5, 100, lo=3, hi=6, seed=11)]
    probe = sync.generate(prompts[1:2], greedy(12), use_tqdm=False)[0].outputs[0].text
    stop = probe[len(probe) // 2:len(probe) // 2 + 2]
    params = [greedy(20), greedy(16, stop=[stop]) if stop.strip() else greedy(16), greedy(9),
              greedy(14, output_kind=RequestOutputKind.DELTA), greedy(12, stop_token_ids=[7])]
    deferred = []
    step = asy.engine.step

    def spy():
        deferred.append(asy.engine.output_processor.has_unflushed)
        return step()

    asy.engine.step = spy  # type: ignore[method-assign]
    want = sync.generate(prompts, params, use_tqdm=False)
    got = asy.generate(prompts, params, use_tqdm=False)
    assert _summary(got[:3] + got[4:]) == _summary(want[:3] + want[4:])
    assert any(deferred) and asy.engine.stats.spec.num_drafts > 0
    # DELTA: the pieces streamed add up to the synchronous engine's text and tokens
    eng = asy.engine
    eng.add_request("d", prompts[3]["prompt_token_ids"], params[3])
    text, toks = "", []
    while eng.has_unfinished_requests():
        for out in eng.step():
            text += out.outputs[0].text
            toks += out.outputs[0].token_ids
    assert (toks, text) == (want[3].outputs[0].token_ids, want[3].outputs[0].text)
    # an abort while a verify's text is not decoded yet: its final output has all of it
    finals = []
    for llm in (sync, asy):
        e = llm.engine
        e.add_request("x", prompts[3]["prompt_token_ids"], greedy(30))
        out = None
        for _ in range(5):
            e.step()
        assert e.output_processor.has_unflushed == (e is asy.engine)  # a verify's text waits (async only)
        e.abort_request("x")
        while e.has_unfinished_requests():
            for o in e.step():
                out = o
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        assert len(ids) >= 5 and text == e.tokenizer.decode(ids, skip_special_tokens=True)  # nothing left undecoded
        finals.append(ids)
        assert e.kv_usage == 0.0
    assert finals[1] == finals[0][:len(finals[1])]


def test_only_a_speculating_engine_builds_step_records(llama_dir, monkeypatch):
    """A plain engine's steps build no step records (host work at batch 32–64 on a host-bound GPU);
    a speculating one hands its speculator one per step, listing the requests that got tokens."""
    from tandem.spec_decode.step_record import StepRows

    built = Counter()
    real = StepRows.add

    def counting(self, scheduled, *args):
        built["sampled"] += len(scheduled)
        return real(self, scheduled, *args)

    monkeypatch.setattr(StepRows, "add", counting)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 100, lo=4, hi=8, seed=5)]
    plain = make_llm(llama_dir, async_scheduling=True)
    plain.generate(prompts, greedy(6), use_tqdm=False)
    assert built["sampled"] == 0
    spec = make_llm(llama_dir, async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    spec.generate(prompts, greedy(6), use_tqdm=False)
    assert built["sampled"] >= 4 + 6  # (a verify step: one record for its tokens)
