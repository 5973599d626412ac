"""Speculative decoding inside the continuous-batching engine: lossless greedy output (float32),
statistically exact sampling, acceptance counters, stops inside accepted runs."""

from __future__ import annotations

import warnings

import pytest

from engine_utils import chi2_same, greedy, make_llm, random_prompts, token_counts, tokens_of
from tandem import SamplingParams
from tandem.worker.model_runner import TorchRunner
from tiny_models import write_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("spec")
    # std 0.2: peaked, repetitive outputs (n-gram finds matches); the draft has other weights.
    target = write_tiny_hf_checkpoint(base, "llama", std=0.2, name="target")
    draft = write_tiny_hf_checkpoint(base, "qwen3", seed=7, std=0.2, name="draft", num_hidden_layers=1)
    # Same seed, one layer fewer: q overlaps p partly (acceptance well inside (0, 1)).
    close = write_tiny_hf_checkpoint(base, "llama", std=0.2, name="close", num_hidden_layers=1)
    return target, draft, close


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(16, 100, lo=2, hi=50, seed=11)]


@pytest.fixture(scope="module")
def reference(dirs, prompts):
    llm = make_llm(dirs[0])
    return tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False))


def spec_llm(target, **spec):
    return make_llm(target, speculative_config=spec)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_no_speculation_past_speculative_max_model_len(dirs, prompts, reference, method):
    """``speculative_config.max_model_len`` below the target's: requests longer than it are not
    speculated for (a draft model built for that length crashed on them: an index past its rope
    table), shorter ones are until they grow past it; greedy output stays the target's."""
    extra = {"model": str(dirs[1])} if method == "draft_model" else {}
    llm = spec_llm(dirs[0], method=method, num_speculative_tokens=3, max_model_len=40, **extra)
    outs = llm.generate(prompts, greedy(32), use_tqdm=False)  # prompts of 2..50 tokens, 32 more each
    assert tokens_of(outs) == reference
    assert llm.engine.stats.spec.num_draft_tokens > 0
    for p, o in zip(prompts, outs):
        if len(p["prompt_token_ids"]) >= 39:
            assert o.outputs[0].num_draft_tokens == 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_equals_no_speculation(dirs, prompts, reference, k):
    llm = spec_llm(dirs[0], method="draft_model", model=str(dirs[1]), num_speculative_tokens=k)
    assert tokens_of(llm.generate(prompts[:1], greedy(32), use_tqdm=False)) == reference[:1]
    outs = llm.generate(prompts, greedy(32), use_tqdm=False)
    assert tokens_of(outs) == reference
    st = llm.engine.stats.spec
    assert st.num_draft_tokens > 0 and sum(o.outputs[0].num_draft_tokens for o in outs) > 0
    assert llm.engine.pool.all_free()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_equals_no_speculation(dirs, prompts, reference, k):
    llm = spec_llm(dirs[0], method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    assert tokens_of(llm.generate(prompts[:1], greedy(32), use_tqdm=False)) == reference[:1]
    outs = llm.generate(prompts, greedy(32), use_tqdm=False)
    assert tokens_of(outs) == reference
    st = llm.engine.stats.spec
    assert st.num_accepted_tokens > 0, "repetitive tiny-model output should give n-gram hits"
    assert sum(o.outputs[0].num_accepted_tokens for o in outs) == st.num_accepted_tokens


@pytest.mark.parametrize("k", [2, 5])
def test_suffix_greedy_equals_no_speculation(dirs, prompts, reference, k):
    llm = spec_llm(dirs[0], method="suffix", num_speculative_tokens=k)
    assert tokens_of(llm.generate(prompts[:1], greedy(32), use_tqdm=False)) == reference[:1]
    st = llm.engine.stats.spec
    start = (st.num_draft_tokens, st.num_accepted_tokens)
    outs = llm.generate(prompts, greedy(32), use_tqdm=False)
    assert tokens_of(outs) == reference
    accepted = st.num_accepted_tokens - start[1]
    assert accepted > 0, "repetitive tiny-model output should give suffix hits"
    assert sum(o.outputs[0].num_accepted_tokens for o in outs) == accepted
    proposer = llm.engine.speculator.proposer.proposer
    # finished outputs reach the proposer while later steps run (Speculator.background): a batch's
    # last ones are still queued when it ends
    assert len(proposer.global_tree) < 1 + len(prompts)
    llm.engine.speculator.background(drain=True)
    assert proposer.num_active_requests == 0 and len(proposer.global_tree) == 1 + len(prompts)
    # the same prompts again: their finished outputs, now in the global tree, predict them
    mid = (st.num_draft_tokens, st.num_accepted_tokens)
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    print(f"suffix k={k}: accepted {accepted}/{mid[0] - start[0]}, "
          f"again {st.num_accepted_tokens - mid[1]}/{st.num_draft_tokens - mid[0]}")
    assert st.num_accepted_tokens - mid[1] > accepted


def _draft_lengths(llm) -> list[int]:
    """Every draft length the engine's speculator hands out from now on."""
    spec = llm.engine.speculator
    seen: list[int] = []
    propose = spec.drafts_for

    def spy(requests):
        drafts = propose(requests)
        seen.extend(len(d.token_ids) for d in drafts.values())
        return drafts

    spec.drafts_for = spy
    return seen


def test_drafts_stop_at_the_runners_fast_query_limit(dirs, prompts, reference, monkeypatch):
    """A verify longer than the target runner's captured steps would run eagerly (the CUDA runner's
    ``fast_query_limit``; faked here on the torch runner): suffix's default k = 24 is cut to fit,
    and stays cut when speculation is switched between runs."""
    free = spec_llm(dirs[0], method="suffix")
    seen = _draft_lengths(free)
    for _ in range(2):  # the second time the global tree holds the answers: long matches
        assert tokens_of(free.generate(prompts, greedy(32), use_tqdm=False)) == reference
    assert free.engine.draft_limit is None and max(seen) > 3  # without a limit, longer drafts come

    monkeypatch.setattr(TorchRunner, "fast_query_limit", 4)
    llm = spec_llm(dirs[0], method="suffix")
    assert llm.engine.draft_limit == 3 and llm.engine.speculator.k == 3
    seen = _draft_lengths(llm)
    for _ in range(2):
        assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    assert max(seen) == 3
    suffix = llm.engine.speculator.proposer.proposer
    assert len(suffix.global_tree) < 2 * len(prompts)  # the last outputs still queued (``background``)
    llm.engine.spec = llm.engine.spec  # rebuilt between runs (benchmarks): the limit holds
    assert llm.engine.speculator.k == 3 and llm.engine.policy is None
    # the old speculator handed its queue to the proposer, which the new one keeps
    assert len(suffix.global_tree) == 2 * len(prompts) and suffix.num_active_requests == 0


def test_a_packed_cpu_model_cuts_drafts_at_its_one_step_verify(tmp_path):
    """A packed CPU model verifies at most 8 rows in one step (longer verifies run as several:
    ``TorchRunner._long_verify``), so suffix decoding's k = 24 is cut to 7; a float model has no
    such limit."""
    path = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2)
    packed = make_llm(path, quantization="int4", speculative_config={"method": "suffix"})
    assert packed.engine.runner.fast_query_limit == 8 and packed.engine.speculator.k == 7
    plain = make_llm(path, speculative_config={"method": "suffix"})
    assert plain.engine.runner.fast_query_limit is None and plain.engine.speculator.k == 24


def test_suffix_with_preemption_and_chunking(dirs, prompts, reference):
    llm = make_llm(dirs[0], kv_cache_memory_bytes=70 * 2048, max_num_batched_tokens=48,  # 2 KiB per block
                   speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats.spec.num_accepted_tokens > 0
    assert llm.engine.pool.all_free()


def test_target_as_its_own_draft_accepts_everything(dirs, prompts, reference):
    llm = spec_llm(dirs[0], method="draft_model", model=str(dirs[0]), num_speculative_tokens=4)
    outs = llm.generate(prompts, greedy(32), use_tqdm=False)
    assert tokens_of(outs) == reference
    st = llm.engine.stats.spec
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    assert st.mean_acceptance_length == pytest.approx(1 + st.num_accepted_tokens / st.num_drafts)
    assert all(a == st.num_drafts for a in st.accepted_per_pos[:1])


def test_stops_inside_an_accepted_run(dirs, prompts, reference):
    """max_tokens and stop strings can land in the middle of a verified run: tokens past the end
    are dropped and the result equals the non-speculative one."""
    base = make_llm(dirs[0])
    llm = spec_llm(dirs[0], method="draft_model", model=str(dirs[0]), num_speculative_tokens=5)
    for max_tokens in (3, 7, 10):
        assert tokens_of(llm.generate(prompts, greedy(max_tokens), use_tqdm=False)) == [r[:max_tokens] for r in reference]
    full = base.generate(prompts[0], greedy(32), use_tqdm=False)[0].outputs[0]
    stop = full.text[9:11]
    want = base.generate(prompts[0], greedy(32, stop=[stop]), use_tqdm=False)[0].outputs[0]
    got = llm.generate(prompts[0], greedy(32, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    tid = full.token_ids[6]
    want = base.generate(prompts[0], greedy(32, stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    got = llm.generate(prompts[0], greedy(32, stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.stop_reason == tid


def test_speculation_with_preemption_and_chunking(dirs, prompts, reference):
    llm = make_llm(dirs[0], kv_cache_memory_bytes=70 * 3072, max_num_batched_tokens=48,  # 3 KiB per block (target + draft)
                   speculative_config={"method": "draft_model", "model": str(dirs[1]), "num_speculative_tokens": 3})
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.all_free()


@pytest.mark.parametrize("proposer", ["draft_probabilistic", "draft_greedy", "suffix"])
def test_sampled_distribution_matches_target(dirs, proposer, monkeypatch):
    """The token after the first (drafted and verified) follows the same distribution with and
    without speculation, with T≠1 and top-k/top-p active and drafts whose q differs strongly from p:
    another model sampling; the target's own argmax as a one-hot q; suffix drafts (one-hot q; at
    position 1 they come from the global tree of earlier requests' outputs, so they are common and
    often rejected). Replacing the recovery step by plain target sampling must be detected (drafts
    with probabilities; one-hot drafts are verified by coupling, which has no recovery step: its
    exactness is tested token for token in ``test_seeded_sampling_is_unchanged_by_speculation``)."""
    params = SamplingParams(temperature=1.3, top_k=6, top_p=0.95, max_tokens=3, ignore_eos=True)
    n = 3000
    plain = token_counts(make_llm(dirs[0], max_num_seqs=1024), n, params, 1)
    if proposer == "suffix":
        cfg = {"method": "suffix", "num_speculative_tokens": 2}
    else:
        sample_method = proposer.removeprefix("draft_")
        draft = dirs[2] if sample_method == "probabilistic" else dirs[0]
        cfg = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
               "draft_sample_method": sample_method}
    spec = make_llm(dirs[0], max_num_seqs=1024, speculative_config=cfg)
    assert chi2_same(plain, token_counts(spec, n, params, 1)) > 1e-3
    st = spec.engine.stats.spec
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    if proposer != "draft_probabilistic":
        return
    import tandem.sample.rejection as rej

    monkeypatch.setattr(rej, "_recover", lambda p, q: p)
    bad = chi2_same(plain, token_counts(spec, n, params, 1))
    print(f"acceptance {st.num_accepted_tokens}/{st.num_draft_tokens}, wrong-recovery p-value {bad:.2e}")
    assert bad < 1e-4


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_greedy"])
def test_seeded_sampling_is_unchanged_by_speculation(dirs, prompts, method):
    """A seeded request's randomness is keyed by output position and one-hot drafts are verified by
    coupling, so its sampled output is token for token what it is without speculation, whatever
    was drafted and accepted (the goodput policy's timing decisions cannot change it)."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(len(prompts))]
    plain = tokens_of(make_llm(dirs[0]).generate(prompts, params, use_tqdm=False))
    if method == "draft_greedy":
        cfg = {"method": "draft_model", "model": str(dirs[0]), "num_speculative_tokens": 3,
               "draft_sample_method": "greedy"}
    else:
        cfg = {"method": method, "num_speculative_tokens": 4, **({"prompt_lookup_min": 1} if method == "ngram" else {})}
    llm = make_llm(dirs[0], speculative_config=cfg)
    assert tokens_of(llm.generate(prompts, params, use_tqdm=False)) == plain
    st = llm.engine.stats.spec
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    # and alone, one request at a time (other batches, other drafts)
    assert tokens_of(llm.generate(prompts[3], params[3], use_tqdm=False)) == plain[3:4]


def test_synthetic_acceptance_is_labelled_and_hits_rate(dirs, prompts):
    llm = spec_llm(dirs[0], method="draft_model", model=str(dirs[1]), num_speculative_tokens=3,
                   rejection_sample_method="synthetic", synthetic_acceptance_rate=0.6)
    outs = llm.generate(prompts, greedy(32), use_tqdm=False)
    assert all(o.synthetic for o in outs)
    st = llm.engine.stats.spec
    # each position is accepted with probability 0.6 given the previous ones were
    assert st.accepted_per_pos[0] / st.num_drafts == pytest.approx(0.6, abs=0.08)
    assert st.accepted_per_pos[1] / st.accepted_per_pos[0] == pytest.approx(0.6, abs=0.1)


def test_deprecated_kwargs_work_with_warning(dirs, prompts, reference):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = make_llm(dirs[0], speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=3)
    assert any("deprecated" in str(x.message) for x in w)
    assert llm.engine.spec.method == "ngram"
    assert tokens_of(llm.generate(prompts[:4], greedy(32), use_tqdm=False)) == reference[:4]


def test_draft_vocab_mismatch_is_a_config_error(tmp_path, dirs):
    from tandem.errors import ConfigError

    other = write_tiny_hf_checkpoint(tmp_path, "llama", vocab_size=160, name="bigvocab")
    with pytest.raises(ConfigError) as e:
        spec_llm(dirs[0], method="draft_model", model=str(other), num_speculative_tokens=2)
    assert e.value.key == "model" and "vocab" in str(e.value)


def test_runner_token_ids_feed_equals_host_tokens(dirs):
    """The draft loop feeds device-side tokens through ``token_ids``: same logits as real tokens."""
    import torch

    from tandem.worker.batch import SeqChunk

    runner = make_llm(dirs[0]).engine.runner
    blocks = [list(range(0, 4)), list(range(4, 8))]
    prompts = [[5, 9, 11, 3], [7, 7, 2]]
    runner.forward_logits([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], [3, 6])
    steps = [SeqChunk([t], len(p), b) for p, b, t in zip(prompts, blocks, [13, 17])]
    want = runner.forward_logits(steps, [0, 1])
    fed = [SeqChunk([0], c.start, c.block_ids) for c in steps]
    got = runner.forward_logits(fed, [0, 1], token_ids=torch.tensor([13, 17]))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="single-token"):
        runner.forward_logits([SeqChunk([1, 2], 0, blocks[0])], [1], token_ids=torch.tensor([3]))
