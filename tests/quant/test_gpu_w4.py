"""Int4 weights on CUDA (W4Linear, the skinny kernel's W4 tiles): the kernel equals the same kernel on
the dequantized weight bit for bit; GPTQ / AWQ / compressed-tensors checkpoints named with
``quantization`` are served packed and stay close to their float reference; greedy speculation on an
int4 target equals that target without speculation. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine_utils import greedy, random_prompts, tokens_of
from quant_checkpoints import write_quantized

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
PROMPT = [5, 9, 17, 33, 40, 41, 7, 8, 99, 12, 60, 61]


@pytest.mark.parametrize("rows", [1, 2, 4, 6, 16])
def test_w4_gemv_equals_dequantized_weight_bitwise(rows):
    from tandem.models.quant.w4_weight import W4Weight
    from tandem.models.quant.weights import quantize_float
    from tandem.worker.triton_gemv import gemv

    g = torch.Generator(device=CUDA).manual_seed(0)
    n, k = 1536, 1024
    w = W4Weight.pack(quantize_float(torch.randn(n, k, device=CUDA, generator=g) / 32, 4, 128, False, "t"),
                      torch.bfloat16, CUDA)
    w2 = W4Weight.pack(quantize_float(torch.randn(2 * n, k, device=CUDA, generator=g) / 32, 4, 128, False, "t"),
                       torch.bfloat16, CUDA)
    wf, wf2 = w.dequantize(), w2.dequantize()
    x = torch.randn(rows, k, device=CUDA, generator=g).to(torch.bfloat16)
    b = torch.randn(n, device=CUDA, generator=g).to(torch.bfloat16)
    nw = (torch.rand(k, device=CUDA, generator=g) + 0.5).to(torch.bfloat16)
    assert torch.equal(gemv(x, w, b), gemv(x, wf, b))
    assert torch.equal(gemv(x, w, norm_weight=nw, eps=1e-5), gemv(x, wf, norm_weight=nw, eps=1e-5))
    assert torch.equal(gemv(x, w2, norm_weight=nw, eps=1e-5, gated=True),
                       gemv(x, wf2, norm_weight=nw, eps=1e-5, gated=True))
    r1 = torch.randn(rows, n, device=CUDA, generator=g).to(torch.bfloat16)
    r2 = r1.clone()
    gemv(x, w, residual=r1)
    gemv(x, wf, residual=r2)
    assert torch.equal(r1, r2)
    if rows > 1:  # each row exactly as a 1-row product
        assert torch.equal(gemv(x, w)[rows - 1], gemv(x[rows - 1:], w)[0])


def _logits(path, quantization):
    from tandem.config import RunnerConfig
    from tandem.engine.model_loader import build_model
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.loader.checkpoint import open_checkpoint, resolve_quantization
    from tandem.worker.batch import SeqChunk
    from tandem.worker.runner import make_runner

    ckpt = open_checkpoint(str(path))
    quant = resolve_quantization(quantization, ckpt, CUDA)
    model = build_model(ckpt.arch, ckpt.weights(packed=quant is not None), torch.bfloat16, CUDA, 128, quant,
                        named=quantization is not None)
    runner = make_runner(model, allocate_kv_cache(ckpt.arch, 8, 4, torch.bfloat16, CUDA), 4, CUDA, RunnerConfig())
    out = runner.forward([SeqChunk(PROMPT, 0, list(range(8)))], list(range(len(PROMPT)))).logits
    return out.float(), model


def _w4_modules(model) -> int:
    from tandem.models.quant.cuda_w4 import W4Linear

    return sum(isinstance(m, W4Linear) for m in model.modules())


@pytest.mark.parametrize("method,kw,packed", [
    ("gptq", dict(sym=False), True),
    ("gptq", dict(sym=True, act_order=True, v1=False), False),  # act-order: dequantized on CUDA
    ("awq", dict(), True),
    ("compressed-tensors", dict(group=128), True),
    ("gptq", dict(bits=8, sym=True), False),  # 8-bit: dequantized on CUDA
])
def test_checkpoints_served_packed_when_named(tmp_path, method, kw, packed):
    qdir, rdir, _ = write_quantized(tmp_path, method, **kw)
    ref, _ = _logits(rdir, None)
    got, model = _logits(qdir, method)
    assert (_w4_modules(model) > 0) == packed
    err = float((got - ref).norm() / ref.norm())
    assert err < 3e-2, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    _, unnamed = _logits(qdir, None)  # not named: dequantized to bf16 (opt-in until measured)
    assert _w4_modules(unnamed) == 0


def test_greedy_speculation_on_an_int4_target_equals_no_speculation(tmp_path):
    from tandem import LLM

    qdir, _, _ = write_quantized(tmp_path, "gptq", sym=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 100, lo=4, hi=30, seed=3)]
    kw = dict(device="cuda", dtype="bfloat16", quantization="gptq", kv_cache_memory_bytes=64 << 20)
    plain = LLM(str(qdir), **kw)
    assert _w4_modules(plain.engine.model) > 0
    want = [tokens_of(plain.generate(p, greedy(24), use_tqdm=False))[0] for p in prompts]  # batch 1
    spec = LLM(str(qdir), speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                              "disable_by_acceptance": False}, **kw)
    got = [tokens_of(spec.generate(p, greedy(24), use_tqdm=False))[0] for p in prompts]
    assert got == want
    assert spec.engine.stats.spec.num_draft_tokens > 0


@pytest.mark.parametrize("rows", [1, 16, 20, 64, 300])
def test_w4_linear_every_row_count(rows):
    """Per-row kernel (≤ 16), 16-row tensor-core tiles (≤ 256), dequantize + cuBLAS above."""
    from tandem.models.quant.cuda_w4 import W4Linear
    from tandem.models.quant.weights import quantize_float

    g = torch.Generator(device=CUDA).manual_seed(1)
    qw = quantize_float(torch.randn(1024, 2048, device=CUDA, generator=g) / 45, 4, 128, False, "t")
    b = torch.randn(1024, device=CUDA, generator=g)
    lin = W4Linear(qw, b, torch.bfloat16, CUDA)
    x = torch.randn(rows, 2048, device=CUDA, generator=g).to(torch.bfloat16)
    want = x.float() @ lin.dequantized().float().T + b.to(torch.bfloat16).float()
    got = lin(x).float()
    assert float((got - want).norm() / want.norm()) < 1e-2
