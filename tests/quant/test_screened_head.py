"""The screened LM head (models/quant/screened_head.py): its error bound holds, its argmax is the exact
argmax (near-ties included), rows do not depend on their batch, and an engine serving a GGUF whose
head is Q8_0 gives the same tokens with it as with the float head — while rows that need real logits
(sampling, logprobs, penalties) still get them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine_utils import greedy, make_llm, random_prompts, tokens_of
from quant_checkpoints import TINY_K
from tiny_models import write_tiny_gguf, write_tiny_hf_checkpoint
from tandem import SamplingParams
from tandem.config import RunnerConfig
from tandem.engine.executor import argmax_only
from tandem.models.quant.screened_head import ScreenedHead
from tandem.models.quant.weights import QuantizedWeight, quantize_float


def q8_0(n: int, k: int, seed: int) -> QuantizedWeight:
    """A Q8_0-shaped weight as the GGUF loader gives it: codes q + 128, fp16 scales d, offset −128·d."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(1, 256, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[:, ::32] = 255  # q = 127 in every block, as Q8_0's d = max|w| / 127 makes it
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    return QuantizedWeight(codes, d, -128 * d, 32, 8, "Q8_0")


def q4_1(n: int, k: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.4).half().float()
    return QuantizedWeight(codes, d, m, 32, 4, "Q4_1")


def hidden_rows(k: int, seed: int) -> torch.Tensor:
    """Rows as a final norm leaves them, plus adversarial ones: one spike, tiny, huge, alternating."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(6, k, generator=g) * 2.5]
    spike = torch.zeros(1, k)
    spike[0, 7] = 40.0
    rows += [spike, torch.randn(1, k, generator=g) * 1e-3, torch.randn(1, k, generator=g) * 300,
             torch.tensor([[(-1.0) ** j * 3 for j in range(k)]])]
    return torch.cat(rows)


@pytest.fixture(params=["cpu_q8", "int4pack"])
def kernel(request, monkeypatch):
    """The screen's packed kernel: tandem's cpu_q4 byte layout (where it builds) or int4pack."""
    from tandem.models.quant import cpu_q4

    if request.param == "int4pack":
        monkeypatch.setattr(cpu_q4, "available", lambda: False)
    elif not cpu_q4.available():
        pytest.skip("cpu_q4 needs AVX-512 BF16 and a C compiler")
    return request.param


@pytest.mark.parametrize("make", [q8_0, q4_1])
def test_bound_holds_and_argmax_is_exact(make, kernel):
    qw = make(1024, 256, 0)
    w = qw.dequantize()
    head = ScreenedHead.build(w)
    assert head is not None and head.packed.kernel == kernel
    x = hidden_rows(256, 1)
    approx, eps = head.approximate(x)
    exact = x.double() @ w.double().t()
    assert ((approx.double() - exact).abs() <= eps.double()).all()
    assert (eps > 0).all()
    out = head.argmax_logits(x)
    assert torch.equal(out.argmax(1), exact.float().argmax(1))
    kept = torch.isfinite(out)
    assert kept.sum(1).max() < 200  # a screen, not the whole vocabulary
    assert torch.equal(out[kept], exact.float()[kept])  # candidates hold their correctly rounded logit


def test_near_ties_below_bf16_resolution_are_resolved_exactly(kernel):
    """Two vocabulary rows whose logits differ by ~1e-5 (far below the packed head's bf16 output):
    the screen keeps both and the exact recompute picks the larger, whichever order they come in."""
    qw = q8_0(512, 128, 3)
    codes = qw.codes.clone()
    codes[100] = codes[40]
    codes[100, 5] += 1  # row 100 = row 40 + d·x[5]
    scale = qw.scale.clone()
    scale[100] = scale[40]
    qw = QuantizedWeight(codes, scale, -128 * scale, 32, 8, "Q8_0")
    w = qw.dequantize()
    head = ScreenedHead.build(w)
    g = torch.Generator().manual_seed(4)
    for sign in (1.0, -1.0):
        x = (w[40] / w[40].norm() * 40 + torch.randn(128, generator=g) * 0.1)[None]  # rows 40, 100 on top
        x[0, 5] = sign * 1e-3
        exact = x.double() @ w.double().t()
        out = head.argmax_logits(x)
        assert int(out.argmax()) == int(exact.float().argmax())
        assert torch.isfinite(out[0, 40]) and torch.isfinite(out[0, 100])


def test_rows_do_not_depend_on_the_batch(kernel):
    qw = q8_0(768, 256, 5)
    head = ScreenedHead.build(qw.dequantize())
    x = hidden_rows(256, 6)
    together = head.argmax_logits(x)
    alone = torch.cat([head.argmax_logits(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(together, alone)


def test_non_finite_hidden_falls_back_to_the_float_head():
    qw = q8_0(256, 128, 7)
    w = qw.dequantize()
    head = ScreenedHead.build(w)
    x = torch.randn(2, 128)
    x[1, 3] = float("nan")
    out = head.argmax_logits(x)
    assert torch.equal(out[0], (x @ w.t())[0]) and torch.isnan(out[1]).any()


def test_build_declines_what_the_kernel_cannot_hold():
    assert ScreenedHead.build(q8_0(100, 128, 8).dequantize()) is None  # rows not a multiple of 16
    assert ScreenedHead.build(torch.randn(256, 100)) is None  # K not a multiple of 32
    assert ScreenedHead.build(q8_0(256, 128, 8).dequantize().double()) is None  # not a float32 head


def test_a_q8_0_head_is_reproduced_exactly_and_a_float_head_is_bounded(kernel):
    """The 8-bit requantization gives back a Q8_0 head's own codes (no rounding left to bound); a
    plain float head gets its rounding into the bound, and its argmax is still exact."""
    qw = q8_0(512, 256, 9)
    again = quantize_float(qw.dequantize(), 8, 32, True, "x")
    assert torch.equal(again.codes, qw.codes) and torch.equal(again.scale, qw.scale)
    w = torch.randn(512, 256) * 0.05
    fhead = ScreenedHead.build(w)
    x = hidden_rows(256, 10)
    exact = x.double() @ w.double().t()
    approx, eps = fhead.approximate(x)
    assert ((approx.double() - exact).abs() <= eps.double()).all()
    assert torch.equal(fhead.argmax_logits(x).argmax(1), exact.float().argmax(1))


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("screened")
    hf = write_tiny_hf_checkpoint(tmp, "llama", vocab_size=512, tie_word_embeddings=True, **TINY_K)
    return write_tiny_gguf(hf, tmp / "tiny-q8.gguf", qtype=Q.Q8_0)


def test_engine_tokens_match_the_float_head(q8_gguf):
    """Greedy tokens with the screened head equal the float head's: batch 1 (the scripted step),
    a batch, and n-gram speculation (verify rows)."""
    on = make_llm(q8_gguf, skip_tokenizer_init=True)
    off = make_llm(q8_gguf, skip_tokenizer_init=True, runner_config=RunnerConfig(screened_head=False))
    model = on.engine.executor.runner.model
    assert model.screened_head is not None and off.engine.executor.runner.model.screened_head is None
    exact = make_llm(q8_gguf, skip_tokenizer_init=True, quantization="none")  # the plain float path
    assert exact.engine.executor.runner.model.screened_head is None
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 512, seed=2)]
    for batch in (prompts[:1], prompts):
        assert tokens_of(on.generate(batch, greedy(32), use_tqdm=False)) == \
            tokens_of(off.generate(batch, greedy(32), use_tqdm=False))
    ngram = make_llm(q8_gguf, skip_tokenizer_init=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    rep = [{"prompt_token_ids": [7, 8, 9, 10] * 6}]
    assert tokens_of(ngram.generate(rep, greedy(32), use_tqdm=False)) == \
        tokens_of(off.generate(rep, greedy(32), use_tqdm=False))
    assert ngram.engine.speculator.stats.num_draft_tokens > 0


def test_rows_that_need_logits_get_the_float_head(q8_gguf, monkeypatch):
    """Logprobs, sampling and penalties read real logits: the engine asks for them, never the screen."""
    llm = make_llm(q8_gguf, skip_tokenizer_init=True)
    model = llm.engine.executor.runner.model
    calls = []
    orig = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h, a=False: calls.append(a) or orig(h, a))
    p = [{"prompt_token_ids": [5, 6, 7, 8]}]
    llm.generate(p, greedy(4), use_tqdm=False)
    assert calls and all(calls[1:])  # decode steps: argmax only
    for params in (greedy(4, logprobs=2), greedy(4, repetition_penalty=1.3), greedy(4, prompt_logprobs=1),
                   SamplingParams(temperature=0.8, max_tokens=4, seed=1)):
        calls.clear()
        llm.generate(p, params, use_tqdm=False)
        assert calls and not any(calls), params
    off = make_llm(q8_gguf, skip_tokenizer_init=True, runner_config=RunnerConfig(screened_head=False))
    a = llm.generate(p, greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    b = off.generate(p, greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_argmax_only_is_decided_per_step():
    from types import SimpleNamespace as NS

    def sched(*reqs):
        return NS(scheduled=[NS(request=r, samples=True, spec_token_ids=(1, 2)) for r in reqs])

    def req(**params):
        return NS(params=SamplingParams(**{"temperature": 0.0, **params}), num_output_tokens=3)

    assert argmax_only(sched(req(), req()))
    assert not argmax_only(sched(req(), req(logprobs=1)))
    assert not argmax_only(sched(req(temperature=0.7)))
    assert not argmax_only(sched(req(min_tokens=5)))  # rows 3 and 4 still mask EOS
    assert argmax_only(sched(req(min_tokens=3)))
    assert not argmax_only(sched(req(prompt_logprobs=0)))
