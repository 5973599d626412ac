"""Rejection sampling: greedy rules, bookkeeping, determinism, and a statistical proof that the
emitted tokens follow the target distribution (with a negative control showing the test has power)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem.sample import rejection
from tandem.spec_decode.cost_model import (
    cost_model_speedup,
    expected_tokens_from_position_rates,
    expected_tokens_per_step,
)
from tandem.sample.logits import probs_from_logits
from tandem.sample.rejection import RejectionOutput, greedy_verify, rejection_sample
from tandem.sample.rows import SamplingRow
from tandem.sample.sampler import sample
from tandem.sample.seeded import SeededStream
from tandem.sampling_params import SamplingParams as SP

V = 8


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_hot_rows(argmaxes: list[int], vocab: int = V) -> torch.Tensor:
    """Peaked (not exactly one-hot) target rows whose argmax is given."""
    p = torch.full((len(argmaxes), vocab), 0.5 / (vocab - 1))
    p[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.5
    return p


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit over cells with positive expected mass; cells with zero mass must be empty."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    exp = probs[support] / probs[support].sum() * counts[support].sum()
    return float(chisquare(counts[support], exp).pvalue)


# ---------------------------------------------------------------- greedy and bookkeeping


def test_greedy_all_accepted_plus_bonus():
    out = rejection_sample(one_hot_rows([3, 5, 2]), [[3, 5]], None, [True], [gen(0)])
    assert out == RejectionOutput([[3, 5, 2]], [2])


@pytest.mark.parametrize("j", [0, 1, 2])
def test_greedy_mismatch_at_position(j: int):
    target = [3, 5, 1, 6]
    drafts = [3, 5, 1]
    drafts[j] = 7
    out = rejection_sample(one_hot_rows(target), [drafts], None, [True], [gen(0)])
    assert out.num_accepted == [j]
    assert out.token_ids == [target[:j] + [target[j]]]


def test_greedy_k0_and_mixed_k_per_request():
    # requests: k=2 all accepted, k=0, k=3 mismatch at 1, k=1 mismatch at 0
    targets = [[1, 2, 3], [4], [5, 6, 7, 0], [2, 2]]
    drafts = [[1, 2], [], [5, 0, 7], [3]]
    probs = one_hot_rows([t for ts in targets for t in ts])
    g = gen(0)
    out = rejection_sample(probs, drafts, None, [True] * 4, [g] * 4)
    assert out.token_ids == [[1, 2, 3], [4], [5, 6], [2]]
    assert out.num_accepted == [2, 0, 1, 0]
    # draft probabilities do not matter for greedy requests
    q = torch.softmax(torch.randn(6, V, generator=gen(1)), -1)
    assert rejection_sample(probs, drafts, q, [True] * 4, [g] * 4) == out


def test_greedy_consumes_no_randomness():
    g = gen(0)
    state = g.get_state()
    rejection_sample(one_hot_rows([1, 2, 3]), [[1, 2]], None, [True], [g])
    assert torch.equal(g.get_state(), state)


def test_greedy_verify_equals_rejection_sample_on_greedy_rows():
    """The engine's all-greedy fast path gives rejection_sample's tokens and counts (ties included)."""
    g = gen(5)
    for trial in range(50):
        ks = [int(k) for k in torch.randint(0, 5, (4,), generator=g)]
        logits = torch.randint(0, 3, (sum(ks) + 4, V), generator=g).float()  # many exact ties
        best = logits.argmax(-1).tolist()
        drafts, r = [], 0
        for k in ks:  # drafts that mostly follow the target, with some misses
            drafts.append([best[r + j] if torch.rand(1, generator=g).item() < 0.7 else
                           int(torch.randint(0, V, (1,), generator=g)) for j in range(k)])
            r += k + 1
        rows = [SamplingRow(SP(temperature=0.0), [1], [], {0}, None) for _ in range(logits.shape[0])]
        want = rejection_sample(probs_from_logits(logits, rows), drafts, None, [True] * 4, [gen(0)] * 4)
        assert greedy_verify(logits, drafts) == want, trial
    with pytest.raises(ValueError, match="sum"):
        greedy_verify(torch.zeros(3, V), [[1, 2, 3]])


def test_random_accepts_when_p_equals_q_and_rejects_zero_mass_drafts():
    p = torch.softmax(torch.randn(3, V, generator=gen(2)), -1)
    for seed in range(20):
        out = rejection_sample(p, [[4, 1]], p[:2].clone(), [False], [gen(seed)])
        assert out.num_accepted == [2] and out.token_ids[0][:2] == [4, 1]
    # one-hot q: a draft with p_j(d) = 1 is always accepted; with p_j(d) = 0 always rejected
    p = torch.zeros(2, V)
    p[0, 3] = 1.0
    p[1, :] = 1.0 / V
    for seed in range(20):
        assert rejection_sample(p, [[3]], None, [False], [gen(seed)]).num_accepted == [1]
    p = torch.full((2, V), 1.0 / (V - 1))
    p[0, 6] = 0.0
    for seed in range(20):
        out = rejection_sample(p, [[6]], None, [False], [gen(seed)])
        assert out.num_accepted == [0] and out.token_ids[0][0] != 6


def test_random_k0_matches_plain_sampler():
    probs = torch.softmax(torch.randn(1, 40, generator=gen(3)), -1)
    for seed in range(30):
        plain = sample(probs, [SamplingRow(SP(seed=seed), [], [], (), gen(seed))], gen(0)).item()
        spec = rejection_sample(probs, [[]], None, [False], [gen(seed)])
        assert spec == RejectionOutput([[plain]], [0])


def test_seeded_request_is_batch_independent():
    torch.manual_seed(4)
    p_req = torch.softmax(torch.randn(4, V), -1)
    q_req = torch.softmax(torch.randn(3, V), -1)
    d_req = [2, 5, 1]
    for seed in range(25):
        alone = rejection_sample(p_req, [d_req], q_req, [False], [gen(seed)])
        shared = gen(777)
        p_other = torch.softmax(torch.randn(2 + 3, V), -1)
        q_other = torch.softmax(torch.randn(1 + 2, V), -1)
        probs = torch.cat([p_other[:2], p_req, p_other[2:]])
        q = torch.cat([q_other[:1], q_req, q_other[1:]])
        out = rejection_sample(
            probs, [[0], d_req, [3, 3]], q, [False, False, True], [shared, gen(seed), shared]
        )
        assert out.token_ids[1] == alone.token_ids[0]
        assert out.num_accepted[1] == alone.num_accepted[0]


def test_input_validation():
    p = one_hot_rows([1, 2])
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p, [[1, 2]], None, [False], [gen(0)])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, [[1]], torch.ones(2, V) / V, [False], [gen(0)])
    with pytest.raises(ValueError, match="one entry per request"):
        rejection_sample(p, [[1]], None, [False, True], [gen(0)])
    with pytest.raises(ValueError, match="draft token ids"):
        rejection_sample(p, [[V]], None, [False], [gen(0)])
    with pytest.raises(ValueError, match="synthetic"):
        rejection_sample(p, [[1]], None, [False], [gen(0)], synthetic_acceptance_rate=1.5)
    assert rejection_sample(torch.zeros(0, V), [], None, [], []) == RejectionOutput([], [])


# ---------------------------------------------------------------- statistical correctness

PARAMS = SP(temperature=0.8, top_k=6, top_p=0.95)


def target(logits: torch.Tensor) -> torch.Tensor:
    """Target distribution through the real pipeline (temperature, top-k, top-p)."""
    return probs_from_logits(logits, [SamplingRow(PARAMS, [], [])] * logits.shape[0])


def build_trials(num: int, one_hot_q: bool, per_request_generators: bool | str, seed: int = 0):
    """num requests with k=2 drafts; p_1 and q_1 depend on the first draft token, as in real use."""
    torch.manual_seed(seed)
    p0 = target(torch.tensor([[2.0, 1.6, 1.2, 0.9, 0.5, 0.2, -0.3, -0.5]]))[0]
    assert (p0 == 0).sum() >= 2  # filters are active
    P1 = target(torch.randn(V, V) * 1.5)  # [first token, V]
    p2 = target(torch.randn(1, V))[0]
    if one_hot_q:
        # draft token source, heavy on the target's favourite (a large bias if recovery were p)
        q0 = torch.tensor([0.55, 0.2, 0.1, 0.05, 0.0, 0.0, 0.0, 0.10])
    else:
        # mass on tokens the target dislikes or has filtered out
        q0 = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.25, 0.25, 0.15, 0.15])
    Q1 = torch.softmax(torch.randn(V, V) * 2.0, -1)
    d0 = torch.multinomial(q0, num, replacement=True)
    d1 = torch.multinomial(Q1[d0], 1).squeeze(1)
    probs = torch.stack([p0.expand(num, V), P1[d0], p2.expand(num, V)], 1).reshape(3 * num, V)
    draft_probs = None if one_hot_q else torch.stack([q0.expand(num, V), Q1[d0]], 1).reshape(2 * num, V)
    drafts = torch.stack([d0, d1], 1).tolist()
    positions = None
    if per_request_generators == "seeded":  # seeded requests, each at its own output position
        gens: list[Any] = [SeededStream(100_000 * (seed + 1) + i) for i in range(num)]
        positions = [i % 7 for i in range(num)]
    elif per_request_generators:
        gens = [gen(100_000 * (seed + 1) + i) for i in range(num)]
    else:
        gens = [gen(seed + 12345)] * num
    out = rejection_sample(probs, drafts, draft_probs, [False] * num, gens, positions=positions)
    return p0, q0, P1, p2, out


def check_target_distribution(p0, q0, P1, p2, out, one_hot_q: bool) -> None:
    toks = out.token_ids
    acc = np.array(out.num_accepted)
    assert all(len(t) == a + 1 for t, a in zip(toks, acc))
    first = np.array([t[0] for t in toks])
    assert chi2_pvalue(np.bincount(first, minlength=V), p0.numpy()) > 1e-3
    # (first, second) among steps that accepted the first draft: P(accept at 0, d0 = x) is
    # min(p0, q0)(x) (one-hot q: q0(x)·p0(x) with q0 the draft token source), then second ~ P1[x].
    accept0 = q0 * p0 if one_hot_q else torch.minimum(p0, q0)
    joint = accept0[:, None] * P1  # [V, V]
    sel = acc >= 1
    pairs = np.array([t[0] * V + t[1] for t, s in zip(toks, sel) if s])
    assert len(pairs) > 2000
    assert chi2_pvalue(np.bincount(pairs, minlength=V * V), joint.numpy()) > 1e-3
    bonus = np.array([t[2] for t, a in zip(toks, acc) if a == 2])
    assert len(bonus) > 300
    assert chi2_pvalue(np.bincount(bonus, minlength=V), p2.numpy()) > 1e-3


@pytest.mark.parametrize("one_hot_q", [False, True], ids=["draft_probs", "one_hot_q"])
def test_emitted_tokens_follow_target(one_hot_q: bool):
    trials = build_trials(30_000, one_hot_q, per_request_generators=True, seed=1)
    check_target_distribution(*trials, one_hot_q=one_hot_q)


def test_negative_control_plain_target_recovery_is_detected(monkeypatch):
    # Resampling from p_j instead of norm(max(p_j − q_j, 0)) double-counts tokens the draft likes.
    monkeypatch.setattr(rejection, "_recover", lambda p, q: p)
    p0, _, _, _, out = build_trials(30_000, False, per_request_generators=False, seed=2)
    first = np.array([t[0] for t in out.token_ids])
    assert chi2_pvalue(np.bincount(first, minlength=V), p0.numpy()) < 1e-6


@pytest.mark.parametrize("one_hot_q", [False, True], ids=["draft_probs", "one_hot_q"])
def test_seeded_requests_follow_target(one_hot_q: bool):
    check_target_distribution(*build_trials(20_000, one_hot_q, "seeded", seed=4), one_hot_q=one_hot_q)


def test_seeded_request_with_deterministic_drafts_emits_its_plain_samples():
    """The same seed gives the same tokens with speculation (any k, any drafts) as without."""
    torch.manual_seed(6)
    steps = 40
    logits = torch.randn(steps + 8, V) * 1.5  # the target's distribution at output position n
    probs = torch.softmax(logits, -1)
    for seed in range(10):
        stream = SeededStream(seed)
        plain = [sample(probs[n:n + 1], [SamplingRow(SP(seed=seed), [], [0] * n, (), stream)], gen(0)).item()
                 for n in range(steps)]
        g = gen(seed)
        out: list[int] = []
        while len(out) < steps:
            n = len(out)
            k = int(torch.randint(0, 5, (1,), generator=g))
            # drafts: the plain tokens with some changed (so both accepts and rejections happen)
            drafts = [plain[n + j] if n + j < steps and torch.rand(1, generator=g).item() < 0.6
                      else int(torch.randint(0, V, (1,), generator=g)) for j in range(k)]
            res = rejection_sample(probs[n:n + k + 1], [drafts], None, [False], [stream], positions=[n])
            out.extend(res.token_ids[0])
        assert out[:steps] == plain, seed
    with pytest.raises(ValueError, match="positions"):
        rejection_sample(probs[:2], [[1]], None, [False], [SeededStream(0)])


def test_shared_generator_also_follows_target():
    check_target_distribution(*build_trials(20_000, False, per_request_generators=False, seed=3), one_hot_q=False)


# ---------------------------------------------------------------- synthetic acceptance


@pytest.mark.parametrize("greedy", [False, True])
def test_synthetic_acceptance_rate(greedy: bool):
    rate, k, num = 0.6, 4, 5000
    p = torch.zeros(num * (k + 1), V)
    p[:, :2] = 0.5  # recovered tokens come from p itself: token 0 (= the draft) stays possible
    drafts = [[0] * k] * num
    out = rejection_sample(
        p, drafts, None, [greedy] * num, [gen(9)] * num, synthetic_acceptance_rate=rate
    )
    acc = np.array(out.num_accepted)
    for i in range(k):
        reached = (acc >= i).sum()
        assert abs((acc > i).sum() / reached - rate) < 0.03, i
    recovered = np.array([t[-1] for t, a in zip(out.token_ids, acc) if a < k])
    if greedy:
        assert (recovered == 0).all()  # argmax p_j (lowest id on the tie)
    else:
        assert 0.4 < (recovered == 0).mean() < 0.6  # from p, not from the residual (never 0)
    assert all(t[:a] == [0] * a for t, a in zip(out.token_ids, acc))


def test_synthetic_extremes():
    p = one_hot_rows([1, 2, 3])
    assert rejection_sample(p, [[5, 5]], None, [False], [gen(0)], synthetic_acceptance_rate=1.0).num_accepted == [2]
    assert rejection_sample(p, [[1, 2]], None, [True], [gen(0)], synthetic_acceptance_rate=0.0).num_accepted == [0]


# ---------------------------------------------------------------- cost model


def test_cost_model_known_values():
    assert expected_tokens_per_step(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)  # 3.3616
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(0.5, 0) == 1.0
    assert cost_model_speedup(0.8, 4, 0.0, 0.0) == pytest.approx(3.3616)
    assert cost_model_speedup(0.8, 4, 0.05, 0.1) == pytest.approx(3.3616 / 1.3)
    assert cost_model_speedup(1.0, 3, 0.1, 0.0) == pytest.approx(4 / 1.3)
    assert cost_model_speedup(0.0, 2, 0.1, 0.0) == pytest.approx(1 / 1.2)
    # continuity at α → 1
    assert cost_model_speedup(1 - 1e-9, 5, 0.02, 0.05) == pytest.approx(cost_model_speedup(1.0, 5, 0.02, 0.05))
    assert expected_tokens_from_position_rates([0.8] * 4) == pytest.approx(expected_tokens_per_step(0.8, 4))
    assert expected_tokens_from_position_rates([]) == 1.0
    for bad in [(-0.1, 2, 0.1, 0.0), (1.1, 2, 0.1, 0.0), (0.5, -1, 0.1, 0.0), (0.5, 2, -0.1, 0.0)]:
        with pytest.raises(ValueError):
            cost_model_speedup(*bad)
    assert math.isfinite(cost_model_speedup(0.999999, 10, 0.1, 0.1))


def test_coupled_verification_through_plain_sampling_is_rejection_sampling():
    """The executor verifies deterministic drafts from each row's plain sample (``sample`` +
    ``accept_matching``): the same tokens and counts as ``rejection_sample`` with one-hot q, for
    greedy, seeded and shared-generator requests in one step, whatever the drafts."""
    rng = np.random.default_rng(4)
    params = [SP(temperature=0.0), SP(temperature=0.9, seed=3), SP(temperature=1.2), SP(temperature=0.7, seed=8),
              SP(temperature=1.0)]
    streams: list[Any] = [None, SeededStream(3), None, SeededStream(8), None]
    for trial in range(20):
        ks = [int(k) for k in rng.integers(0, 4, len(params))]
        logits = torch.tensor(rng.normal(size=(sum(ks) + len(ks), V)) * 2, dtype=torch.float32)
        rows: list[SamplingRow] = []
        for p, g, k in zip(params, streams, ks):
            rows.extend(SamplingRow(p, [], [], (), g) for _ in range(k + 1))
        probs = probs_from_logits(logits, rows)
        top = probs.argmax(dim=-1).tolist()
        drafts, r = [], 0
        for k in ks:  # mostly the row's likeliest token (often accepted), sometimes another
            drafts.append([top[r + j] if rng.random() < 0.7 else int(rng.integers(V)) for j in range(k)])
            r += k + 1
        starts = [int(x) for x in rng.integers(0, 50, len(ks))]
        positions = [starts[i] + j for i, k in enumerate(ks) for j in range(k + 1)]
        got = rejection.accept_matching(sample(probs, rows, gen(100 + trial), positions=positions).tolist(), drafts)
        shared = gen(100 + trial)  # the engine's generator, in the same state as for ``sample``
        want = rejection_sample(probs, drafts, None, [p.greedy for p in params],
                                [g or shared for g in streams], positions=starts)
        assert got == want, trial


# ---------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pipeline_on_cuda():
    from tandem.sample.logits import process_logits
    from tandem.sample.logprobs import compute_logprobs

    dev = torch.device("cuda")
    torch.manual_seed(5)
    params = [SP(temperature=0.0), SP(temperature=0.7, top_k=5, repetition_penalty=1.2),
              SP(top_p=0.8, min_p=0.05, presence_penalty=0.3, logit_bias={1: -math.inf}), SP()]
    rows = [SamplingRow(p, [1, 2, 3], [4, 4], (0,)) for p in params]
    logits = torch.randn(4, 64)
    cpu = probs_from_logits(process_logits(logits, rows), rows)
    gpu = probs_from_logits(process_logits(logits.to(dev), rows), rows)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-4)
    # cuda generators and a CPU generator (drawn on its own device, then moved) both work
    for g in (torch.Generator(dev).manual_seed(0), gen(0)):
        toks = sample(gpu, [SamplingRow(p, [], [], (), g) for p in params], g)
        assert toks.device.type == "cuda" and toks[0].item() == gpu[0].argmax().item()
    lp = compute_logprobs(logits.to(dev), torch.zeros(4, dtype=torch.long, device=dev), [2, None, 0, 5])
    assert lp[1] is None and len(lp[3]) >= 5
    # rejection on the device: greedy rule and the target distribution of the first token
    out = rejection_sample(one_hot_rows([3, 5, 2]).to(dev), [[3, 4]], None, [True], [gen(0)])
    assert out == RejectionOutput([[3, 5]], [1])
    num = 20_000
    p0 = target(torch.tensor([[2.0, 1.6, 1.2, 0.9, 0.5, 0.2, -0.3, -0.5]]))[0]
    q0 = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.25, 0.25, 0.15, 0.15])
    d0 = torch.multinomial(q0, num, replacement=True, generator=gen(6))
    probs = p0.expand(2 * num, V).contiguous().to(dev)
    g = torch.Generator(dev).manual_seed(1)
    out = rejection_sample(probs, d0[:, None].tolist(), q0.expand(num, V).to(dev), [False] * num, [g] * num)
    first = np.array([t[0] for t in out.token_ids])
    assert chi2_pvalue(np.bincount(first, minlength=V), p0.numpy()) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_rows_on_cuda_are_lossless_and_keyed():
    """On CUDA, seeded rows' uniforms (computed on the host from their keys) and the inverse-CDF draw
    on the device: rejection sampling with probabilistic drafts still emits the target's
    distribution, and a seeded request's tokens do not depend on the other rows of the step."""
    dev = torch.device("cuda")
    num = 20_000
    p0 = target(torch.tensor([[2.0, 1.6, 1.2, 0.9, 0.5, 0.2, -0.3, -0.5]]))[0]
    q0 = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.25, 0.25, 0.15, 0.15])
    d0 = torch.multinomial(q0, num, replacement=True, generator=gen(7))
    probs = p0.expand(2 * num, V).contiguous().to(dev)
    streams: list[Any] = [SeededStream(9_000_000 + i) for i in range(num)]
    out = rejection_sample(probs, d0[:, None].tolist(), q0.expand(num, V).to(dev), [False] * num, streams,
                           positions=[3] * num)
    first = np.array([t[0] for t in out.token_ids])
    assert chi2_pvalue(np.bincount(first, minlength=V), p0.numpy()) > 1e-3
    # request 5 alone, and behind a default-generator request: the same tokens
    alone = rejection_sample(probs[10:12], [d0[5:6].tolist()], q0.expand(1, V).to(dev), [False], [streams[5]],
                             positions=[3])
    mixed = rejection_sample(probs[:4], [[1], d0[5:6].tolist()], q0.expand(2, V).to(dev), [False, False],
                             [torch.Generator(dev).manual_seed(3), streams[5]], positions=[0, 3])
    assert alone.token_ids[0] == mixed.token_ids[1] == out.token_ids[5]
