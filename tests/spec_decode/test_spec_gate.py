"""The acceptance gate (spec_decode/gate.py): shadow drafts scored exactly as greedy verification would
score them, draft / don't-draft decisions against the measured step-cost ratio, its config key, and
the engine with the gate on: same tokens as without speculation, drafting off (and decode steps
chained asynchronously) while speculation does not pay, back on when it does."""

from __future__ import annotations

import random

import pytest

from engine_utils import greedy, make_llm, random_prompts, tokens_of
from tandem.errors import ConfigError
from tandem.config.speculative import SpeculativeConfig
from tandem.spec_decode.gate import MIN_TIMED_STEPS, PRIOR_COST_RATIO, AcceptanceGate
from tandem.spec_decode.ngram import NgramProposer
from tiny_models import write_tiny_hf_checkpoint

K = 3


def _ngram() -> NgramProposer:
    return NgramProposer(1, 3, K)


def _simulate(tokens: list[int], start: int, draft) -> list[int]:  # type: ignore[no-untyped-def]
    """Tokens per verify of real greedy speculation that drafts at ``start`` over a known output."""
    out, p = [], start
    while p <= len(tokens):
        d = draft(tokens[:p], K)
        if not d:
            p += 1
            continue
        acc = 0
        while acc < len(d) and p + acc < len(tokens) and tokens[p + acc] == d[acc]:
            acc += 1
        if acc < len(d) and p + acc >= len(tokens):
            break  # not decided by the known tokens
        out.append(1 + acc)
        p += acc + 1
    return out


@pytest.mark.parametrize("seed", range(4))
def test_shadow_drafts_score_like_greedy_verification(seed):
    rng = random.Random(seed)
    motif = [rng.randrange(20) for _ in range(6)]
    tokens = [rng.randrange(20) for _ in range(8)]
    while len(tokens) < 120:  # repeats with noise: some drafts accepted in full, some partly, some not
        tokens += motif if rng.random() < 0.6 else [rng.randrange(20) for _ in range(rng.randrange(1, 5))]
    ng = _ngram()
    scores: list[int] = []
    gate = AcceptanceGate(ng.propose_one, alpha=1.0)  # alpha 1: the EMA is the last score
    gate._update = lambda st, t: scores.append(t) or setattr(st, "tokens_per_verify", float(t))  # type: ignore[method-assign]
    gate.record_verify("r", 3, 0)  # one verify that accepted nothing: 1 token per verify
    gate.prior_cost_ratio = 1.5
    start = 10
    assert not gate.wants("r", start)  # shadowed from position 10 on
    scores.clear()
    n = start
    while n < len(tokens):  # tokens arrive one or a few at a time, as decode / verify steps give them
        n = min(len(tokens), n + rng.choice([1, 1, 2, 4]))
        gate.observe("r", tokens[:n], K)
    want = _simulate(tokens, start, ng.propose_one)
    assert scores == want and len(want) > 10
    assert gate.num_shadow_drafts == len(want)
    assert 1 in want and K + 1 in want  # both outcomes occurred


def test_decisions_follow_the_cost_ratio():
    gate = AcceptanceGate(lambda toks, k: [], alpha=0.5)
    assert gate.cost_ratio == PRIOR_COST_RATIO  # nothing timed yet
    assert not gate.wants("a", 5) and not gate.is_drafting("a")  # no evidence: shadow drafts first
    for _ in range(MIN_TIMED_STEPS):
        gate.record_step(0.002, verified=True)
        assert gate.cost_ratio == PRIOR_COST_RATIO  # decode steps not timed yet
    for _ in range(MIN_TIMED_STEPS):
        gate.record_step(0.001, verified=False)
    assert gate.cost_ratio == pytest.approx(2.0)
    gate.record_verify("a", 4, 0)  # 1 token per verify < 2
    gate.record_verify("a", 0, 0)  # no drafts: not a verify, ignored
    assert gate.tokens_per_verify("a") == 1.0
    assert not gate.wants("a", 9) and not gate.is_drafting("a")
    gate.record_verify("a", 4, 4)  # EMA 0.5 * 1 + 0.5 * 5 = 3 >= 2
    assert gate.tokens_per_verify("a") == 3.0 and gate.wants("a", 12) and gate.is_drafting("a")
    gate.forget("a")
    assert gate.tokens_per_verify("a") is None and not gate.is_drafting("a")


def test_observe_ignores_drafting_and_unknown_requests():
    calls = []
    gate = AcceptanceGate(lambda toks, k: calls.append(len(toks)) or [1], alpha=1.0)
    gate.observe("nobody", [1, 2, 3], K)
    gate.record_verify("a", 2, 2)  # 3 tokens per verify: drafting
    assert gate.wants("a", 3)
    gate.observe("a", [1, 2, 3, 4], K)
    assert calls == [] and gate.num_shadow_drafts == 0


def test_new_requests_start_in_the_shadow():
    gate = AcceptanceGate(NgramProposer(1, 3, K).propose_one, alpha=1.0)
    toks = [1, 2, 3, 4, 1, 2, 3]
    assert not gate.wants("r", len(toks))  # shadow draft from 7 tokens: [4, 1, 2]
    gate.observe("r", toks + [4, 1], K)  # not decided yet
    assert gate.num_shadow_drafts == 0
    gate.observe("r", toks + [4, 1, 2], K)  # all 3 accepted: 4 tokens per verify
    assert gate.num_shadow_drafts == 1 and gate.tokens_per_verify("r") == 4.0
    assert gate.wants("r", 10) and gate.is_drafting("r")


def test_config_key():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "disable_by_acceptance": False})
    assert cfg.disable_by_acceptance is False
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).disable_by_acceptance is None
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_acceptance="yes")  # type: ignore[arg-type]
    assert e.value.key == "disable_by_acceptance"
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig(method="draft_model", model="x", num_speculative_tokens=3, disable_by_acceptance=True)
    assert e.value.key == "disable_by_acceptance" and "ngram" in str(e.value)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama_gate"), "llama")


def _spec(gate: bool) -> dict:
    return {"method": "ngram", "num_speculative_tokens": K, "disable_by_acceptance": gate}


def test_engine_gate_is_lossless_and_switches_drafting(llama_dir, monkeypatch):
    base = make_llm(llama_dir)
    gated = make_llm(llama_dir, async_scheduling=True, speculative_config=_spec(True))
    off = make_llm(llama_dir, speculative_config=_spec(False))
    assert gated.engine.gate is not None and off.engine.gate is None
    assert make_llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": K}).engine.gate is None  # CPU default
    prompts = [{"prompt_token_ids": p * 3} for p in random_prompts(3, 100, lo=3, hi=7, seed=11)]
    want = tokens_of(base.generate(prompts, greedy(40), use_tqdm=False))
    assert tokens_of(off.generate(prompts, greedy(40), use_tqdm=False)) == want

    eng = gated.engine
    # Speculation never pays: every request stays in the shadow (no verify at all).
    ratio = [100.0]
    monkeypatch.setattr(AcceptanceGate, "cost_ratio", property(lambda self: ratio[0]))
    got = tokens_of(gated.generate(prompts, greedy(40), use_tqdm=False))
    assert got == want
    drafts_never = eng.stats.spec.num_drafts
    assert drafts_never == 0
    assert eng.gate.num_shadow_drafts > 0
    assert eng.num_chained_steps > 0  # decode steps without drafts ran asynchronously

    # Speculation always pays: drafting throughout, as without the gate.
    ratio[0] = 0.0
    got = tokens_of(gated.generate(prompts, greedy(40), use_tqdm=False))
    assert got == want
    assert eng.stats.spec.num_drafts - drafts_never > 10 * len(prompts) // 2
    assert not eng.gate._states  # finished requests are forgotten
    assert eng.gate.verify_cost.count > 0 and eng.gate.decode_cost.count > 0  # both step kinds timed
