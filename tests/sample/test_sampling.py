"""Logits processing, probabilities, sampling and logprobs: each parameter has a test that fails if
the parameter is ignored."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from tandem.errors import SamplingParamsError
from tandem.sample.logits import probs_from_logits, process_logits, validate_for_vocab
from tandem.sample.logprobs import Logprob, compute_logprobs, prompt_logprobs
from tandem.sample.rows import SamplingRow, rows_for_request
from tandem.sample.sampler import sample
from tandem.sampling_params import SamplingParams as SP


def row(params: SP | None = None, prompt=(), output=(), eos=(), gen=None) -> SamplingRow:
    return SamplingRow(params or SP(), list(prompt), list(output), tuple(eos), gen)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()[None, :]


P4 = [0.5, 0.3, 0.15, 0.05]


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of integer counts to probs (expected rescaled in float64)."""
    obs = counts.double().numpy()
    exp = probs.double().numpy()
    return float(chisquare(obs, exp / exp.sum() * obs.sum()).pvalue)


# ---------------------------------------------------------------- process_logits


def test_default_params_fast_path_returns_input():
    logits = torch.randn(3, 7)
    rows = [row(output=[1, 2]), row(prompt=[3]), row()]
    assert process_logits(logits, rows) is logits


@pytest.mark.parametrize("kw,outputs", [
    ({}, 0), ({"temperature": 0.0}, 3), ({"min_tokens": 2, "max_tokens": 8}, 2),
    ({"min_tokens": 2, "max_tokens": 8}, 1), ({"logit_bias": {1: 2.0}}, 0), ({"repetition_penalty": 1.3}, 2),
    ({"frequency_penalty": 0.5}, 2), ({"presence_penalty": -0.5}, 2),
])
def test_processes_logits_says_exactly_when_rows_change(kw, outputs):
    """``processes_logits`` is what asynchronous decode trusts to skip the host: it must be True for
    every row ``process_logits`` would edit (and False leaves the logits untouched)."""
    from tandem.sample.logits import processes_logits

    params = SP(**kw)
    logits = torch.randn(1, 7)
    r = row(params, prompt=[1, 2], output=[1, 3, 1][:outputs], eos=(4,))
    out = process_logits(logits, [r])
    assert (out is not logits) == processes_logits(params, outputs)
    if out is not logits:
        assert not torch.equal(out, logits)


def test_logit_bias_adds_and_bans():
    logits = torch.zeros(2, 5)
    rows = [row(SP(logit_bias={1: 2.5, 3: -math.inf})), row()]
    out = process_logits(logits, rows)
    assert out[0].tolist() == [0.0, 2.5, 0.0, -math.inf, 0.0]
    assert out[1].tolist() == [0.0] * 5
    assert logits.abs().sum() == 0  # input untouched
    probs = probs_from_logits(out, rows)
    assert probs[0, 3] == 0
    # a banned token is never sampled, even when it would otherwise dominate
    logits = torch.tensor([[0.0, 0.0, 10.0]]).repeat(500, 1)
    rows = [row(SP(logit_bias={2: -math.inf}))] * 500
    toks = sample(probs_from_logits(process_logits(logits, rows), rows), rows, gen(0))
    assert not (toks == 2).any()
    assert set(toks.tolist()) == {0, 1}


def test_logit_bias_out_of_vocab():
    params = SP(logit_bias={3: 1.0, 10: 1.0})
    with pytest.raises(SamplingParamsError) as e:
        validate_for_vocab(params, 8)
    assert e.value.field == "logit_bias"
    assert "10" in str(e.value)
    validate_for_vocab(params, 11)
    validate_for_vocab(SP(), 8)
    # process_logits ignores the out-of-vocab id instead of crashing
    out = process_logits(torch.zeros(1, 8), [row(params)])
    assert out[0, 3] == 1.0 and out.sum() == 1.0


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SP(min_tokens=3, stop_token_ids=(4,))
    logits = torch.zeros(4, 6)
    rows = [
        row(params, output=[], eos=(5,)),
        row(params, output=[1, 1], eos=(5,)),
        row(params, output=[1, 1, 1], eos=(5,)),  # reached: nothing masked
        row(SP(min_tokens=3, ignore_eos=True), output=[1], eos=(5,)),  # still masked (vLLM)
    ]
    out = process_logits(logits, rows)
    for i in (0, 1):
        assert out[i, 5] == -math.inf and out[i, 4] == -math.inf
        assert torch.isfinite(out[i, :4]).all()
    assert torch.isfinite(out[2]).all()
    assert out[3, 5] == -math.inf
    # EOS is never sampled while too short, even if it is the model's favourite
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 8.0, 8.0]]).repeat(300, 1)
    rows = [row(SP(min_tokens=2, stop_token_ids=(4,)), output=[0], eos=(5,))] * 300
    toks = sample(probs_from_logits(process_logits(logits, rows), rows), rows, gen(1))
    assert not ((toks == 4) | (toks == 5)).any()


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5]])
    rows = [row(SP(repetition_penalty=2.0), prompt=[0], output=[1, 1])]
    out = process_logits(logits, rows)
    # seen (prompt ∪ output): 0 (positive → /2), 1 (negative → ·2); others untouched
    assert out[0].tolist() == [0.5, -2.0, 2.0, 0.5, -0.5]


def test_frequency_and_presence_penalties_count_output_only():
    logits = torch.zeros(3, 5)
    out_ids = [2, 2, 2, 3]
    rows = [
        row(SP(frequency_penalty=0.5), prompt=[1], output=out_ids),
        row(SP(presence_penalty=0.5), prompt=[1], output=out_ids),
        row(SP(frequency_penalty=0.5, presence_penalty=1.0), prompt=[1], output=out_ids),
    ]
    out = process_logits(logits, rows)
    assert out[0].tolist() == [0.0, 0.0, -1.5, -0.5, 0.0]
    assert out[1].tolist() == [0.0, 0.0, -0.5, -0.5, 0.0]
    assert out[2].tolist() == [0.0, 0.0, -2.5, -1.5, 0.0]


def test_processing_order_bias_before_repetition_penalty():
    # bias first: 1 + (−2) = −1, then ·2 (negative) = −2. Reversed order would give 1/2 − 2 = −1.5.
    logits = torch.tensor([[1.0, 0.0]])
    rows = [row(SP(logit_bias={0: -2.0}, repetition_penalty=2.0), output=[0])]
    assert process_logits(logits, rows)[0, 0].item() == -2.0


def test_batched_processing_matches_per_row():
    torch.manual_seed(0)
    params = [
        SP(),
        SP(repetition_penalty=1.3, frequency_penalty=0.4),
        SP(presence_penalty=-0.7, logit_bias={0: 1.0}),
        SP(min_tokens=5, repetition_penalty=0.8, stop_token_ids=(1,)),
    ]
    rows = [
        row(p, prompt=torch.randint(0, 20, (6,)).tolist(), output=torch.randint(0, 20, (4,)).tolist(), eos=(2,))
        for p in params
    ]
    logits = torch.randn(4, 20)
    batched = process_logits(logits, rows)
    for i, r in enumerate(rows):
        assert torch.equal(batched[i], process_logits(logits[i : i + 1], [r])[0])


def test_rows_for_request_includes_earlier_drafts():
    rs = rows_for_request(SP(), [1, 2], [3], [7, 8])
    assert [list(r.output_token_ids) for r in rs] == [[3], [3, 7], [3, 7, 8]]
    assert len(rows_for_request(SP(), [1], [], [])) == 1
    # penalties see the drafts: row 2's history contains token 7
    out = process_logits(torch.zeros(3, 10), rows_for_request(SP(presence_penalty=1.0), [1], [], [7, 8]))
    assert out[:, 7].tolist() == [0.0, -1.0, -1.0]


def test_verify_rows_share_histories_but_penalise_like_explicit_lists():
    torch.manual_seed(7)
    prompt = torch.randint(0, 30, (40,)).tolist()
    output = torch.randint(0, 30, (12,)).tolist()
    drafts = [3, 3, 29, 0]
    params = [
        SP(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2),
        SP(frequency_penalty=-0.4),
        SP(),
        SP(repetition_penalty=0.7, min_tokens=14, stop_token_ids=(5,)),
    ]
    rows, explicit = [], []
    for p in params:
        rows += rows_for_request(p, prompt, output, drafts, (2,))
        explicit += [row(p, prompt, output + drafts[:j], (2,)) for j in range(len(drafts) + 1)]
    logits = torch.randn(len(rows), 30)
    assert torch.equal(process_logits(logits, rows), process_logits(logits, explicit))
    # the prompt passed as a tensor gives the same result
    as_tensor = [SamplingRow(r.params, torch.tensor(prompt), r.output_token_ids, r.eos_token_ids) for r in rows]
    assert torch.equal(process_logits(logits, as_tensor), process_logits(logits, explicit))


# ---------------------------------------------------------------- probs_from_logits


def test_temperature_zero_is_greedy_one_hot_with_lowest_tie():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    rows = [row(SP(temperature=0.0)), row(SP(temperature=0.0))]
    probs = probs_from_logits(logits, rows)
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    toks = sample(probs, rows, gen(0))
    assert toks.tolist() == [1, 0]


def test_temperature_scales_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for t in (0.5, 1.0, 2.0):
        probs = probs_from_logits(logits, [row(SP(temperature=t))])
        torch.testing.assert_close(probs, torch.softmax(logits / t, -1))
    sharp = probs_from_logits(logits, [row(SP(temperature=0.5))])
    flat = probs_from_logits(logits, [row(SP(temperature=2.0))])
    assert sharp.max() > flat.max()
    # sampled frequencies follow the tempered distribution
    n = 20000
    probs = probs_from_logits(logits.repeat(n, 1), [row(SP(temperature=2.0))] * n)
    counts = torch.bincount(sample(probs, [row(SP(temperature=2.0))] * n, gen(3)), minlength=4)
    assert chi2_pvalue(counts, torch.softmax(logits[0] / 2.0, -1)) > 1e-3


def test_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    probs = probs_from_logits(logits, [row(SP(top_k=2))])
    assert (probs[0] > 0).nonzero().flatten().tolist() == [1, 3]
    torch.testing.assert_close(probs[0, [1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    # disabled values: 0, -1, >= vocab
    for k in (0, -1, 5, 100):
        torch.testing.assert_close(probs_from_logits(logits, [row(SP(top_k=k))]), torch.softmax(logits, -1))


def test_top_k_keeps_ties_at_the_boundary():
    # HF/vLLM threshold semantics: everything equal to the k-th value survives (both code paths).
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    for params in (SP(top_k=2), SP(top_k=2, top_p=0.999)):
        probs = probs_from_logits(logits, [row(params)])
        assert (probs[0] > 0).tolist() == [True, True, True, True, False]


def test_top_p_keeps_smallest_nucleus():
    logits = logits_of(P4)
    probs = probs_from_logits(logits, [row(SP(top_p=0.75))])
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = probs_from_logits(logits, [row(SP(top_p=0.4))])  # always at least one token
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    probs = probs_from_logits(logits, [row(SP(top_p=0.9))])
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_top_p_applies_to_top_k_renormalised_distribution():
    # top_k=3 → [.5, .3, .15]/.95 = [.526, .316, .158]; mass before token 2 = .842 ≥ .83 → dropped.
    # (On the un-renormalised distribution it would be .8 < .83 → kept.)
    probs = probs_from_logits(logits_of(P4), [row(SP(top_k=3, top_p=0.83))])
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_cpu_top_p_from_candidates_is_the_sorted_filter():
    """The CPU's top-p shortcut (a top-k selection of candidates, no full sort) keeps exactly what
    the full stable sort keeps, ties at the cut included, and falls back to it when a nucleus does
    not fit among the candidates."""
    from tandem.sample import logits as lg

    g = gen(9)
    taken = fell_back = 0
    for trial in range(80):
        vocab = 3000
        raw = torch.randn(1, vocab, generator=g) * float(torch.empty(1).uniform_(1.0, 8.0, generator=g))
        top = raw.topk(40).indices[0]
        for a, b in torch.randint(0, 40, (12, 2), generator=g).tolist():  # equal probabilities near the cut
            raw[0, top[a]] = raw[0, top[b]]
        probs = torch.softmax(raw, dim=-1)
        top_p = torch.rand(1, generator=g) * 0.98 + 0.01
        quick = lg._top_p_from_candidates(probs, top_p)
        full = lg._top_k_top_p_sorted(probs, None, top_p)
        if quick is None:
            fell_back += 1
        else:
            taken += 1
            assert torch.equal(quick, full), trial
    assert taken > 10 and fell_back > 3, (taken, fell_back)
    flat = torch.full((1, 3000), 1 / 3000)  # every token in the nucleus: no shortcut
    assert lg._top_p_from_candidates(flat, torch.tensor([0.9])) is None


def test_min_p():
    probs = probs_from_logits(logits_of(P4), [row(SP(min_p=0.2))])  # threshold 0.1
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    probs = probs_from_logits(logits_of(P4), [row(SP(min_p=0.5))])  # threshold 0.25
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_mixed_batch_matches_per_row():
    torch.manual_seed(1)
    params = [
        SP(temperature=0.0),
        SP(temperature=0.7, top_k=5),
        SP(),
        SP(temperature=1.3, top_p=0.8, min_p=0.05),
        SP(top_k=3, top_p=0.9),
        SP(min_p=0.3),
    ]
    logits = torch.randn(len(params), 32)
    rows = [row(p) for p in params]
    batched = probs_from_logits(logits, rows)
    torch.testing.assert_close(batched.sum(-1), torch.ones(len(params)))
    for i, r in enumerate(rows):
        torch.testing.assert_close(batched[i], probs_from_logits(logits[i : i + 1], [r])[0])


# ---------------------------------------------------------------- sample


def test_sample_matches_distribution():
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    n = 30000
    rows = [row()] * n
    counts = torch.bincount(sample(p.repeat(n, 1), rows, gen(11)), minlength=5)
    assert chi2_pvalue(counts, p) > 1e-3


def test_inverse_cdf_never_picks_a_zero_weight_token():
    """The inverse-CDF draw at the ends of the uniform grid (0 and 1 − 2**-24) and in between, on
    normalised and unnormalised rows with zero-weight tokens first, inside and last: always a token
    of positive weight, and the grid's extremes land on the first and the last such token."""
    from tandem.sample.sampler import inverse_cdf

    rows = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0],
                         [0.0, 0.0, 2.0, 0.0, 1e-6],
                         [1e-7, 0.0, 0.0, 0.0, 0.0],
                         [0.25, 0.25, 0.0, 0.25, 0.25]])
    top = 1.0 - 2.0 ** -24
    assert inverse_cdf(rows, torch.zeros(4)).tolist() == [1, 2, 0, 0]
    assert inverse_cdf(rows, torch.full((4,), top)).tolist() == [3, 4, 0, 4]
    for u in torch.rand(200, generator=gen(5)):
        picks = inverse_cdf(rows, u.expand(4))
        assert bool((rows.gather(1, picks[:, None]) > 0).all())


def test_seeded_uniforms_are_on_the_grid_and_keyed():
    from tandem.sample.seeded import SeededStream

    a, b = SeededStream(7), SeededStream(8)
    us = [a.uniform(n, 0) for n in range(2000)]
    assert all(0.0 <= u <= 1.0 - 2.0 ** -24 and (u * 2 ** 24).is_integer() for u in us)
    assert a.uniform(3, 0) == SeededStream(7).uniform(3, 0) != b.uniform(3, 0) and a.uniform(3, 0) != a.uniform(3, 1)
    from scipy.stats import kstest

    assert kstest(us, "uniform").pvalue > 1e-3


def test_seed_reproducible_and_batch_independent():
    torch.manual_seed(0)
    vocab = 50
    probs_row = torch.softmax(torch.randn(vocab), -1)
    seeds = list(range(40))

    def token_alone(seed: int) -> int:
        r = row(SP(seed=seed), gen=gen(seed))
        return sample(probs_row[None, :], [r], gen(999)).item()

    alone = [token_alone(s) for s in seeds]
    assert alone == [token_alone(s) for s in seeds]  # reproducible
    assert len(set(alone)) > 5  # different seeds actually differ
    # the same seeded rows mixed with unseeded, greedy and other seeded rows, in another order
    others = torch.softmax(torch.randn(3, vocab), -1)
    for pos, s in enumerate(seeds):
        rows = [row(), row(SP(temperature=0.0)), row(SP(seed=1000 + s), gen=gen(1000 + s))]
        probs = torch.cat([others, probs_row[None, :]])
        rows.append(row(SP(seed=s), gen=gen(s)))
        perm = [(pos + j) % 4 for j in range(4)]
        toks = sample(probs[perm], [rows[j] for j in perm], gen(pos))
        assert toks[perm.index(3)].item() == alone[pos]


def test_seeded_sequence_reproducible():
    probs = torch.softmax(torch.randn(1, 30, generator=gen(5)), -1)
    r = row(SP(seed=7), gen=gen(7))
    a = [sample(probs, [r], gen(0)).item() for _ in range(20)]
    r = row(SP(seed=7), gen=gen(7))
    b = [sample(probs, [r], gen(123)).item() for _ in range(20)]
    assert a == b


def test_greedy_rows_consume_no_randomness():
    g = gen(0)
    state = g.get_state()
    probs = torch.softmax(torch.randn(3, 10), -1)
    sample(probs, [row(SP(temperature=0.0))] * 3, g)
    assert torch.equal(g.get_state(), state)


# ---------------------------------------------------------------- logprobs


def test_logprobs_values_ranks_and_count():
    torch.manual_seed(2)
    logits = torch.randn(3, 12)
    chosen = torch.tensor([4, 0, 7])
    out = compute_logprobs(logits, chosen, [3, None, 0])
    lsm = torch.log_softmax(logits, -1)
    assert out[1] is None
    entry = out[0]
    assert entry is not None
    top3 = lsm[0].topk(3).indices.tolist()
    assert set(entry) == {4} | set(top3)
    assert len(entry) == (3 if 4 in top3 else 4)
    for rank, tok in enumerate(top3, start=1):
        assert entry[tok].rank == rank
        assert entry[tok].logprob == pytest.approx(lsm[0, tok].item(), abs=1e-6)
    assert entry[4].logprob == pytest.approx(lsm[0, 4].item(), abs=1e-6)
    assert entry[4].rank == int((lsm[0] > lsm[0, 4]).sum()) + 1
    assert list(entry)[0] == 4  # chosen token first
    only = out[2]
    assert only is not None and list(only) == [7]
    assert only[7].rank == int((lsm[2] > lsm[2, 7]).sum()) + 1
    assert isinstance(only[7], Logprob) and only[7].decoded_token is None


def test_logprobs_from_raw_logits_not_processed():
    # The engine passes raw logits; penalties must not leak into the values returned.
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = compute_logprobs(logits, [2], [1])
    assert out[0][2].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item(), abs=1e-6)
    assert out[0][2].rank == 1


def test_prompt_logprobs_format():
    torch.manual_seed(3)
    prompt = [5, 1, 3, 2]
    logits = torch.randn(len(prompt) - 1, 8)
    out = prompt_logprobs(logits, prompt[1:], 2)
    assert len(out) == len(prompt) and out[0] is None
    lsm = torch.log_softmax(logits, -1)
    for pos in range(1, len(prompt)):
        entry = out[pos]
        assert entry is not None and prompt[pos] in entry
        assert entry[prompt[pos]].logprob == pytest.approx(lsm[pos - 1, prompt[pos]].item(), abs=1e-6)
        assert 2 <= len(entry) <= 3
    assert prompt_logprobs(torch.zeros(0, 8), [], 2) == [None]
    assert prompt_logprobs(logits, prompt[1:], 0, prepend_none=False)[0] is not None
