"""The goodput policy inside the engine (tiny fp32 model): with the policy on (the CUDA default;
``disable_by_acceptance: true`` here on CPU) the output is token-for-token the output without speculation, for n-gram and suffix, with and
without asynchronous decode; when speculation cannot pay nobody drafts (and decode steps chain
asynchronously, the n-gram shadow drafts still scored); when it always pays requests draft; the
decisions reach the engine's counters."""

from __future__ import annotations

import pytest

from engine_utils import greedy, make_llm, random_prompts, tokens_of
from tandem.spec_decode.policy import GoodputPolicy
from tandem.spec_decode.policy_cost import StepCostModel
from tandem.spec_decode.policy_guard import GoodputGuard
from tiny_models import write_tiny_hf_checkpoint

K = 3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama_policy"), "llama")


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p * 3} for p in random_prompts(3, 100, lo=3, hi=7, seed=11)]


@pytest.fixture(scope="module")
def want(llama_dir, prompts):
    return tokens_of(make_llm(llama_dir).generate(prompts, greedy(40), use_tqdm=False))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_default_policy_is_lossless(llama_dir, prompts, want, method, async_scheduling):
    llm = make_llm(llama_dir, async_scheduling=async_scheduling,
                   speculative_config={"method": method, "num_speculative_tokens": K, "disable_by_acceptance": True})
    eng = llm.engine
    assert eng.policy is not None
    assert tokens_of(llm.generate(prompts, greedy(40), use_tqdm=False)) == want
    spec = eng.stats.spec
    assert sum(spec.chosen_k) > 0 and len(spec.chosen_k) == K + 1
    assert eng.policy.acceptance.num_scored > 0  # proposals scored against the real tokens
    assert not eng.policy._pending and not eng.policy.acceptance._reqs  # finished requests forgotten


def test_policy_switches_drafting_off_and_on(llama_dir, prompts, want, monkeypatch):
    llm = make_llm(llama_dir, async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": K, "disable_by_acceptance": True})
    eng = llm.engine
    eng.policy.guard = GoodputGuard(min_efficiency=0.0)  # the model alone decides here (wall time varies)
    sigma = [100.0]  # a verify step costs 100 decode steps: speculation never pays
    monkeypatch.setattr(StepCostModel, "overhead", lambda self, b: (sigma[0], 0.0))
    assert tokens_of(llm.generate(prompts, greedy(40), use_tqdm=False)) == want
    spec = eng.stats.spec
    assert spec.num_drafts == 0 and spec.chosen_k[0] > 0 and sum(spec.chosen_k[1:]) == 0
    assert spec.num_shadow_drafts > 0  # lazy n-gram shadows while decode steps ran ahead
    assert eng.num_chained_steps > 0

    sigma[0] = 0.0  # verify costs nothing extra: draft whenever a draft exists
    drafts_before = spec.num_drafts
    assert tokens_of(llm.generate(prompts, greedy(40), use_tqdm=False)) == want
    assert spec.num_drafts - drafts_before > 10
    assert sum(spec.chosen_k[1:]) > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_no_proposal_while_nobody_would_draft(llama_dir, prompts, want, monkeypatch, temperature):
    """A synchronous engine (sampled requests never chain asynchronously either) makes no proposal
    while the policy's estimates say nobody would draft: n-gram lookups and their scoring for the
    whole batch every step had cost 0.69-0.84x at T = 0.8 on the H200 with nobody drafting
    (docs/performance.md section 32). Shadow drafts still bring evidence; the output is unchanged."""
    from tandem import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": K, "disable_by_acceptance": True}
    llm = make_llm(llama_dir, async_scheduling=False, speculative_config=spec)
    eng = llm.engine
    eng.policy.guard = GoodputGuard(min_efficiency=0.0)  # the model alone decides here (wall time varies)
    monkeypatch.setattr(StepCostModel, "overhead", lambda self, b: (100.0, 0.0))  # a verify never pays
    proposer = eng.speculator.proposer
    calls = []
    real = proposer.propose_requests
    monkeypatch.setattr(proposer, "propose_requests", lambda reqs, ks: (calls.append(len(reqs)), real(reqs, ks))[1])
    if temperature:
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=40)
        want = tokens_of(make_llm(llama_dir, async_scheduling=False).generate(prompts, params, use_tqdm=False))
    else:
        params = greedy(40)
    assert tokens_of(llm.generate(prompts, params, use_tqdm=False)) == want
    assert calls == []  # before: one proposal for every request at every step
    assert eng.stats.spec.num_drafts == 0 and eng.stats.spec.chosen_k[0] > 0
    assert eng.stats.spec.num_shadow_drafts > 0 and eng.policy.acceptance.num_scored > 0


def test_policy_off_and_batch_size_cap(llama_dir, prompts, want):
    off = make_llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                                  "disable_by_acceptance": False})
    assert off.engine.policy is None
    assert tokens_of(off.generate(prompts, greedy(40), use_tqdm=False)) == want
    assert off.engine.stats.spec.num_drafts > 0
    capped = make_llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                                     "disable_by_acceptance": True, "disable_by_batch_size": 2})
    assert tokens_of(capped.generate(prompts, greedy(40), use_tqdm=False)) == want
    # 3 requests run together until the first finishes: no drafts while 2 or more run
    assert capped.engine.stats.spec.num_drafts == 0
    capped_off = make_llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                                         "disable_by_acceptance": False, "disable_by_batch_size": 2})
    assert tokens_of(capped_off.generate(prompts, greedy(40), use_tqdm=False)) == want
    assert capped_off.engine.stats.spec.num_drafts == 0  # honoured without the policy too
    assert tokens_of(capped_off.generate(prompts[:1], greedy(40), use_tqdm=False)) == want[:1]
    assert capped_off.engine.stats.spec.num_drafts > 0  # alone: below the cap


def test_draft_model_with_policy_is_lossless_and_chooses_per_request(tmp_path_factory, monkeypatch):
    """A model proposer: k chosen before drafting (some requests 0, some k), requests catching up
    after rounds without drafts; output equal to no speculation."""
    base = tmp_path_factory.mktemp("policy_draft")
    target = write_tiny_hf_checkpoint(base, "llama", std=0.2, name="target")
    close = write_tiny_hf_checkpoint(base, "llama", std=0.2, name="close", num_hidden_layers=1)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 100, lo=2, hi=30, seed=5)]
    want = tokens_of(make_llm(target).generate(prompts, greedy(24), use_tqdm=False))
    llm = make_llm(target, speculative_config={"method": "draft_model", "model": str(close),
                                               "num_speculative_tokens": K, "disable_by_acceptance": True})
    policy = llm.engine.policy
    assert policy is not None and not policy.free and policy.shadow is None
    policy.probe_every = 4  # explore after 4 steps without drafts (the prior alone says "no" here)
    policy.guard = GoodputGuard(min_efficiency=0.0)  # measured wall times must not block drafting here
    calls = [0]
    real = policy._optimise

    def alternate(batch, candidates, **kw):  # every other round: nobody drafts
        calls[0] += 1
        return [0] * len(candidates) if calls[0] % 2 else real(batch, candidates, **kw)

    monkeypatch.setattr(policy, "_optimise", alternate)
    assert tokens_of(llm.generate(prompts, greedy(24), use_tqdm=False)) == want
    spec = llm.engine.stats.spec
    assert spec.chosen_k[0] > 0 and spec.num_drafts > 0  # both kinds of rounds happened
    assert policy.acceptance.num_scored > 0 and policy.draft.of(1) > 0


def test_async_transitions_are_marked_and_timed(llama_dir, prompts, want, monkeypatch):
    """On an asynchronous engine the plain step right after a synchronous verify restarts the
    pipeline and one before it drains it: both are reported not ``steady`` (the cost model charges a
    restart to the verify), chained decode steps are steady, and every record counts the tokens it
    emitted. (A draft model verifies synchronously; host proposers' verifies chain: test_chained_verify.py.)"""
    from tandem.spec_decode.step_record import StepKind

    llm = make_llm(llama_dir, async_scheduling=True,
                   speculative_config={"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": K,
                                       "disable_by_acceptance": True})
    eng = llm.engine
    asked, rounds = [0], [0]
    choose = GoodputPolicy.choose

    def every_sixth(self, batch, candidates, drained=False):  # a verify now and then, chained decode steps between
        asked[0] += 1  # (asked by will_draft, then by the proposal round it let happen)
        return asked[0] % 6 in (0, 1)

    def only_when_asked(self, batch, candidates):  # a proposal round after a verify drafts nothing
        ks = choose(self, batch, candidates)
        rounds[0] += 1
        return ks if rounds[0] % 2 == 1 else [0] * len(ks)

    monkeypatch.setattr(StepCostModel, "overhead", lambda self, b: (0.0, 0.0))  # a verify always pays
    monkeypatch.setattr(GoodputPolicy, "wants_any", every_sixth)
    eng.policy.guard = GoodputGuard(min_efficiency=0.0)  # measured wall times must not block drafting here
    monkeypatch.setattr(GoodputPolicy, "choose", only_when_asked)
    records = []
    observe = eng.speculator.observe
    eng.speculator.observe = lambda rec: (records.append(rec), observe(rec))[1]
    assert tokens_of(llm.generate(prompts, greedy(40), use_tqdm=False)) == want
    kinds = [(r.kind, r.steady) for r in records]
    assert (StepKind.DECODE, True) in kinds and (StepKind.VERIFY, True) in kinds
    assert all(r.kind is StepKind.DECODE for r in records if not r.steady)
    # a verify, then a plain step that launched the next one ahead (the chain resumed): a restart
    restarts = [b for a, b, c in zip(records, records[1:], records[2:])
                if a.kind is StepKind.VERIFY and b.kind is StepKind.DECODE and c.kind is StepKind.DECODE and c.steady]
    assert restarts and all(not r.steady for r in restarts)
    assert all(r.num_tokens == len(r.requests) + sum(r.accepted) for r in records)
    assert all(len(r.drafted) == len(r.accepted) == len(r.requests) for r in records if r.kind is StepKind.VERIFY)
    assert sum(r.num_tokens for r in records) == sum(len(t) for t in want)


def test_policy_is_on_by_default_on_cpu(llama_dir, prompts, want):
    """Without ``disable_by_acceptance`` the goodput policy (and its guard) runs on CPU too: drafting
    every step lost up to 0.62x there (docs/performance.md section 15). Output is unchanged."""
    from tandem import LLM

    llm = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": K})
    assert llm.engine.policy is not None and llm.engine.policy.guard is not None
    assert tokens_of(llm.generate(prompts, greedy(40), use_tqdm=False)) == want
    assert sum(llm.engine.stats.spec.chosen_k) > 0  # the policy decided every proposal round
