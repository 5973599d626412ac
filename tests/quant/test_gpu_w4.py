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


@pytest.mark.parametrize("config", [None, (4, 1), (8, 4), (2, 2, 2), (4, 2, 1, 2)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 40, 70])
def test_w4_gemv_matches_the_float_weight(rows, config):
    """The int4 kernel against the float32 product with the weight its codes describe, every fusion,
    with and without split-K ((warps, split[, tiles per warp[, depth]]); 8 x 4: nine steps of K in splits of
    three, the last one empty; 2 x 2 x 2: two tiles per warp; 4 x 2 x 1 x 2: two steps of codes in
    flight; 70 rows: two launches); each row equals that row alone, bit for bit (batch-invariant mode
    relies on it)."""
    from tandem.models.quant.w4_weight import W4Weight
    from tandem.models.quant.weights import quantize_float
    from tandem.worker.triton_gemv import gemv

    g = torch.Generator(device=CUDA).manual_seed(0)
    n, k = 1536, 576  # K = 576 in groups of 64: nine 64-code chunks, one group per K step
    w = W4Weight.pack(quantize_float(torch.randn(n, k, device=CUDA, generator=g) / 32, 4, 64, False, "t"),
                      torch.bfloat16, CUDA)
    w2 = W4Weight.pack(quantize_float(torch.randn(2 * n, k, device=CUDA, generator=g) / 32, 4, 64, False, "t"),
                       torch.bfloat16, CUDA)

    def exact(p: W4Weight) -> torch.Tensor:  # codes · scale + offset in float32, never rounded
        kk = p.k // p.group
        return (p.codes().float().view(-1, kk, p.group) * p.scale[:, :kk, None].float()
                + p.offset[:, :kk, None].float()).view(-1, p.k)

    wf, wf2 = exact(w), exact(w2)
    x = torch.randn(rows, k, device=CUDA, generator=g).to(torch.bfloat16)
    b = torch.randn(n, device=CUDA, generator=g).to(torch.bfloat16)
    nw = (torch.rand(k, device=CUDA, generator=g) + 0.5).to(torch.bfloat16)

    def close(got, want, what):
        err = float((got.float() - want).norm() / want.norm())
        assert err < 6e-3, (what, err)  # bf16 output rounding: ~2^-9 relative

    xf = x.float()
    close(gemv(x, w, b, config=config), xf @ wf.T + b.float(), "bias")
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)) * nw.float()
    close(gemv(x, w, norm_weight=nw, eps=1e-5, config=config), h @ wf.T, "norm")
    want = torch.nn.functional.silu(h @ wf2[:n].T) * (h @ wf2[n:].T)
    close(gemv(x, w2, norm_weight=nw, eps=1e-5, gated=True, config=config), want, "gated")
    r = torch.randn(rows, n, device=CUDA, generator=g).to(torch.bfloat16)
    want = r.float() + xf @ wf.T
    gemv(x, w, residual=r, config=config)
    close(r, want, "residual")
    whole = gemv(x, w, invariant=True, config=config)
    for i in range(rows):
        assert torch.equal(whole[i], gemv(x[i:i + 1], w, invariant=True, config=config)[0]), i
    again = gemv(x, w, invariant=True, config=config)  # split-K sums in a fixed order: same bits
    assert torch.equal(whole, again)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("rows", [1, 5])
def test_w4_gemv_every_group(rows, group, dtype):
    """Codes become MMA operands from the bits (bf16 and fp16 halves) for every group size (16 and 32:
    several groups per 64-code chunk)."""
    from tandem.models.quant.w4_weight import W4Weight
    from tandem.models.quant.weights import quantize_float
    from tandem.worker.triton_gemv import gemv

    g = torch.Generator(device=CUDA).manual_seed(2)
    n, k = 512, 1024
    w = W4Weight.pack(quantize_float(torch.randn(n, k, device=CUDA, generator=g) / 32, 4, group, False, "t"),
                      dtype, CUDA)
    kk = k // group
    wf = (w.codes().float().view(n, kk, group) * w.scale[:, :kk, None].float()
          + w.offset[:, :kk, None].float()).view(n, k)
    x = torch.randn(rows, k, device=CUDA, generator=g).to(dtype)
    want = x.float() @ wf.T
    for invariant in (False, True):
        got = gemv(x, w, invariant=invariant).float()
        assert float((got - want).norm() / want.norm()) < 6e-3, (invariant, group)


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
    ("gptq", dict(sym=False), 8),  # 2 layers x (qkv, o, gate_up, down)
    # act-order: down_proj (K = 256, two groups) is permuted and dequantized on CUDA; K = 128 layers
    # have one group, so no permutation
    ("gptq", dict(sym=True, act_order=True, v1=False), 6),
    ("awq", dict(), 8),
    ("compressed-tensors", dict(group=128), 8),
    ("gptq", dict(bits=8, sym=True), 0),  # 8-bit: dequantized on CUDA
])
def test_checkpoints_served_packed_when_named(tmp_path, method, kw, packed):
    qdir, rdir, _ = write_quantized(tmp_path, method, **kw)
    ref, _ = _logits(rdir, None)
    got, model = _logits(qdir, method)
    assert _w4_modules(model) == packed
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


def test_w4_only_for_16_bit_models():
    """The MMA kernel takes bf16 / fp16 operands: a float32 model's int4 linears dequantize at load."""
    from tandem.models.quant.cuda_w4 import W4Linear
    from tandem.models.quant.kernels import make_quant_linear
    from tandem.models.quant.weights import quantize_float

    qw = quantize_float(torch.randn(64, 256, device=CUDA), 4, 128, False, "t")
    assert isinstance(make_quant_linear(qw, None, torch.empty(1, device=CUDA, dtype=torch.bfloat16)), W4Linear)
    assert make_quant_linear(qw, None, torch.empty(1, device=CUDA, dtype=torch.float32)) is None


@pytest.mark.parametrize("rows", [1, 16, 20, 64, 300])
def test_w4_linear_every_row_count(rows):
    """The int4 kernel (16-row tiles) up to 256 rows, dequantize + cuBLAS above."""
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
