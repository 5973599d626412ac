"""Quantized tiny models end to end on CPU: each format's checkpoint, served packed, gives logits close
to the same model with the reference float weights, and greedy speculation on a quantized target
equals that target without speculation."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine_utils import greedy, make_llm, random_prompts, tokens_of
from quant_checkpoints import TINY_K, k_quant_blocks, write_quantized
from tiny_models import hf_to_gguf_name, write_tiny_gguf, write_tiny_hf_checkpoint
from tandem.config import RunnerConfig
from tandem.engine.model_loader import build_model
from tandem.kv.kv_cache import allocate_kv_cache
from tandem.loader.checkpoint import open_checkpoint, resolve_quantization
from tandem.models.quant.kernels import is_quantized
from tandem.worker.batch import SeqChunk
from tandem.worker.runner import make_runner

CPU = torch.device("cpu")
PROMPT = [5, 9, 17, 33, 40, 41, 7, 8, 99, 12, 60, 61]
# Logits of a packed model vs the same weights in float32: bf16 activations and bf16 scale/zero in the
# int4pack / int8pack kernels. Measured 1.4e-3 .. 1.1e-2 relative (Frobenius) on these models.
LOGITS_RTOL = 3e-2


def logits(path, quantization=None):
    ckpt = open_checkpoint(str(path))
    quant = resolve_quantization(quantization, ckpt, CPU)
    model = build_model(ckpt.arch, ckpt.weights(packed=quant is not None), torch.float32, CPU, 128, quant)
    runner = make_runner(model, allocate_kv_cache(ckpt.arch, 8, 4, torch.float32, CPU), 4, CPU, RunnerConfig())
    out = runner.forward([SeqChunk(PROMPT, 0, list(range(8)))], list(range(len(PROMPT)))).logits
    return out, model


def packed_modules(model) -> int:
    return sum(1 for m in model.modules() if is_quantized(m))


def assert_close_logits(got, ref):
    err = float((got - ref).norm() / ref.norm())
    assert err < LOGITS_RTOL, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("method,kw", [
    ("gptq", dict(sym=False, act_order=False, v1=True)),
    ("gptq", dict(sym=False, act_order=True, v1=True)),
    ("gptq", dict(sym=True, act_order=True, v1=False)),
    ("gptq", dict(bits=8, sym=True)),
    ("awq", dict()),
    ("compressed-tensors", dict(group=128)),
    ("compressed-tensors", dict(bits=8, strategy="channel")),
    ("gptq", dict(family="qwen2")),  # q/k/v biases move into the packed qkv module
])
def test_hf_quantized_checkpoint_logits_match_reference(tmp_path, method, kw):
    qdir, rdir, _ = write_quantized(tmp_path, method, **kw)
    ref, _ = logits(rdir)
    got, model = logits(qdir)  # detected from quantization_config
    assert packed_modules(model) == 4 * 2  # qkv, o, gate_up, down per layer
    assert_close_logits(got, ref)
    exact, model = logits(qdir, "none")  # dequantized at load: the reference weights
    assert packed_modules(model) == 0
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_1", "Q4_K", "Q5_K"])
def test_gguf_packed_logits_match_dequantized(tmp_path, qtype):
    t = getattr(Q, qtype)
    hf = write_tiny_hf_checkpoint(tmp_path, "llama", **TINY_K)
    raw = None
    if qtype.endswith("_K"):  # gguf cannot quantize K-quants: random blocks for every linear
        shapes = open_checkpoint(str(hf)).parameter_shapes()
        raw = {hf_to_gguf_name(n, "llama"): (k_quant_blocks(*s, t, seed=i), t)
               for i, (n, s) in enumerate(shapes.items()) if n.startswith("model.layers.") and len(s) == 2}
    path = write_tiny_gguf(hf, tmp_path / f"tiny-{qtype}.gguf", qtype=None if raw else t, raw=raw)
    ref, _ = logits(path, "none")
    got, model = logits(path)
    assert packed_modules(model) == 8
    assert_close_logits(got, ref)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_the_fly_quantization_of_a_float_checkpoint(tmp_path, method):
    """Packed int8 / int4 logits match the float model whose linears hold the same rounded weights
    (the kernel's error), and stay near the unquantized model (round-to-nearest error, much larger for
    int4 on these random Gaussian weights: measured 2.5e-2 / 2.4e-1)."""
    from tandem.models.quant.attach import ON_THE_FLY
    from tandem.models.quant.weights import quantize_float

    path = write_tiny_hf_checkpoint(tmp_path, "llama", **TINY_K)
    ref, float_model = logits(path)
    got, model = logits(path, method)
    assert packed_modules(model) == 8
    bits, group, sym = ON_THE_FLY[method]
    rounded, rmodel = logits(path)
    with torch.no_grad():
        for name, module in rmodel.named_modules():
            if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
                module.weight.copy_(quantize_float(module.weight, bits, group, sym, method).dequantize())
    runner = make_runner(rmodel, allocate_kv_cache(rmodel.arch, 8, 4, torch.float32, CPU), 4, CPU, RunnerConfig())
    rounded = runner.forward([SeqChunk(PROMPT, 0, list(range(8)))], list(range(len(PROMPT)))).logits
    assert_close_logits(got, rounded)
    assert float((got - ref).norm() / ref.norm()) < (0.06 if method == "int8" else 0.5)


@pytest.fixture(scope="module")
def quant_dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant-spec")
    qdir, rdir, _ = write_quantized(tmp, "gptq", act_order=True, name="target")
    return qdir, rdir


@pytest.fixture(scope="module")
def quant_reference(quant_dirs):
    prompts = random_prompts(4, 100, seed=3) + [[7, 8, 9, 7, 8, 9, 7, 8]]
    llm = make_llm(quant_dirs[0])
    assert packed_modules(llm.engine.model) == 8
    return prompts, tokens_of(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(20)))


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "draft_model", "num_speculative_tokens": 3},
])
def test_greedy_speculation_on_a_quantized_target_equals_no_speculation(quant_dirs, quant_reference, spec):
    """Quantized (GPTQ, packed int4) target; the draft is the float reference model."""
    prompts, ref = quant_reference
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(quant_dirs[1])}
    llm = make_llm(quant_dirs[0], speculative_config=spec)
    assert tokens_of(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(20))) == ref


def test_quantized_draft_model(quant_dirs, quant_reference):
    """speculative_config.quantization: the draft quantized on the fly (int8), the target GPTQ."""
    prompts, ref = quant_reference
    spec = {"method": "draft_model", "model": str(quant_dirs[1]), "num_speculative_tokens": 3,
            "quantization": "int8"}
    llm = make_llm(quant_dirs[0], speculative_config=spec)
    assert tokens_of(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(20))) == ref


def test_gguf_q4_k_m_mix_with_float_shards(tmp_path):
    """As llama.cpp's Q4_K_M writes it: Q6_K attn_v / ffn_down next to Q4_K attn_q / attn_k. With
    cpu_q4 (groups of 16) every linear is packed, qkv stacked at group 16; without it the Q6_K weights
    have no packed kernel and load as float, and the shared qkv matmul runs in float."""
    from tandem.models.quant import cpu_q4

    hf = write_tiny_hf_checkpoint(tmp_path, "llama", **TINY_K)
    shapes = open_checkpoint(str(hf)).parameter_shapes()
    raw = {}
    for i, (n, s) in enumerate(shapes.items()):
        if n.startswith("model.layers.") and len(s) == 2:
            t = Q.Q6_K if n.endswith(("v_proj.weight", "down_proj.weight")) else Q.Q4_K
            raw[hf_to_gguf_name(n, "llama")] = (k_quant_blocks(*s, t, seed=i) if t == Q.Q4_K
                                                else random_q6_k(*s, seed=i), t)
    path = write_tiny_gguf(hf, tmp_path / "mix.gguf", raw=raw)
    ref, _ = logits(path, "none")
    got, model = logits(path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    if cpu_q4.available():
        assert packed_modules(model) == 8 and qkv.group == 16
    else:
        assert packed_modules(model) == 4  # o_proj and gate_up per layer; qkv (mixed) and down (Q6_K) are float
        assert not is_quantized(qkv) and qkv.weight.abs().sum() > 0
    assert_close_logits(got, ref)


def random_q6_k(rows: int, cols: int, seed: int = 0):
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[Q.Q6_K]
    data = np.random.default_rng(seed).integers(0, 256, (rows * (cols // block), size), dtype=np.uint8)
    data[:, 192:208] = 2  # int8 sub-block scales
    data[:, 208:210] = np.frombuffer(np.float16(3e-3).tobytes(), dtype=np.uint8)  # d
    return data.reshape(rows, cols // block * size)
