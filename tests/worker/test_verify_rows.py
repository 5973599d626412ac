"""On the CPU a lone verify's hidden states are bitwise what decoding computes, packed or float.

Greedy speculation must not drift from plain decoding through rounding: with bf16 activations into
the int4 matmuls, a 1e-7 difference in attention became visible in the outputs. The packed matmuls
are row-invariant; the torch attention computes a batch-1 verify row by row over exactly a decode's
context and op shapes. Float linears are not row-invariant on CPU (the 1-row GEMV split and the
multi-row matmul round differently), so a lone verify runs them row by row
(``torch_kernels.LONE_VERIFY_KERNELS``): gemma-3-270m's GGUF keeps 9 Q6_K linears in float, and its
greedy output under n-gram speculation drifted on 3 of 16 HumanEval prompts before that."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import use_avx2_kernels
from tiny_models import random_quant_bytes, write_tiny_gguf, write_tiny_hf_checkpoint

from tandem.models.layers import Linear


@pytest.mark.parametrize("weights", ["int4", "gguf-mixed"])  # gguf-mixed: Q4_0 packed + Q3_K in float
@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: a sliding-window layer too
@pytest.mark.parametrize("rows", [4, 12])  # 12: more than a lone step holds (suffix decoding's k = 24)
def test_verify_rows_equal_decode_steps_bitwise(tmp_path, family, weights, rows):
    from gguf import GGMLQuantizationType as Q

    from tandem import LLM
    from tandem.worker.batch import SeqChunk

    # SmolLM2's attention shape (9 heads over 3 KV heads of 64): where the row-count dependence showed
    path = write_tiny_hf_checkpoint(tmp_path, family, std=0.2, num_hidden_layers=2, hidden_size=576,
                                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                    intermediate_size=256, max_position_embeddings=512)
    kw: dict = {"quantization": "int4"}
    if weights == "gguf-mixed":  # as gemma-3-270m's GGUF without cpu_q4: most linears packed, some float
        # (Q3_K is read by dequantizing; Q6_K, which gemma's file has, is packed where cpu_q4 builds)
        raw = {f"blk.{i}.ffn_down.weight": (random_quant_bytes(576, 256, Q.Q3_K, seed=i), Q.Q3_K) for i in range(2)}
        kw = {"tokenizer": str(path)}  # the tiny GGUF has no vocabulary of its own
        path = write_tiny_gguf(path, tmp_path / "m.gguf", qtype=Q.Q4_0, raw=raw)
    spec = {"method": "ngram", "num_speculative_tokens": rows - 1}  # a verify of ``rows`` rows (k + 1)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, block_size=4,
              speculative_config=spec, **kw)
    runner = llm.engine.runner
    if weights == "gguf-mixed":
        assert any(isinstance(m, Linear) for m in runner.model.model.layers.modules())
    final = (runner.model.arch.num_layers,)  # the final hidden state: what the (float) LM head reads
    blocks = list(range(60))
    prompt = [(7 * j) % 90 + 6 for j in range(181)]  # longer than the sliding window (8)
    runner.forward_logits([SeqChunk(prompt, 0, blocks)], [len(prompt) - 1])
    tail = [(11 + 12 * j) % 90 + 6 for j in range(rows)]
    # every row's logits wanted, as the executor asks for a verify's
    verify = runner.forward([SeqChunk(tail, len(prompt), blocks)], list(range(rows)), aux_layers=final).aux_hidden[0]
    verify = verify.clone()
    for r, t in enumerate(tail):  # decode the same tokens one by one (rewrites identical KV)
        row = runner.forward([SeqChunk([t], len(prompt) + r, blocks)], [0], aux_layers=final).aux_hidden[0]
        assert torch.equal(row[0], verify[r]), r


@pytest.mark.parametrize("isa", ["native", "avx2"])  # avx2: the kernels an AVX2-only machine runs
def test_a_batched_steps_rows_equal_each_requests_lone_steps_bitwise(tmp_path, monkeypatch, isa):
    """Several requests in one step (a verify beside decodes, contexts of different lengths): on the
    packed path each row's hidden state is bitwise its request's lone decode at that position — the
    C attention computes every row over exactly its own context (``cpu_attention.attend_rows``), not
    padded to the batch's longest. Then greedy speculation under concurrency cannot drift from plain
    decoding either (before: 1-2 of 8 SmolLM2 chats at batch 8 did)."""
    from tandem import LLM
    from tandem.worker.batch import SeqChunk

    if isa == "avx2" and not use_avx2_kernels(monkeypatch):
        pytest.skip("the AVX2 builds of cpu_q4 and the C attention need AVX2 + FMA and a C compiler")
    if isa == "avx2":
        from tandem.models.quant import cpu_q4

        assert cpu_q4.variant() == "avx2"

    path = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2, num_hidden_layers=2, hidden_size=576,
                                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                    intermediate_size=256, max_position_embeddings=512)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, block_size=4,
              quantization="int4", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    runner = llm.engine.runner
    if not runner.attention.cpu_kernel:
        pytest.skip("needs cpu_q4 and the C attention (AVX-512 or AVX2, a C compiler)")
    final = (runner.model.arch.num_layers,)
    prompts = [[(7 * j + 3 * i) % 90 + 6 for j in range(n)] for i, n in enumerate((181, 40, 97))]
    blocks = [list(range(i * 60, i * 60 + 60))[::-1] for i in range(3)]  # (not one slot range)
    for p, b in zip(prompts, blocks):
        runner.forward_logits([SeqChunk(p, 0, b)], [len(p) - 1])
    tails = [[(11 + 12 * j + i) % 90 + 6 for j in range(q)] for i, q in enumerate((4, 1, 2))]
    chunks = [SeqChunk(t, len(p), b) for t, p, b in zip(tails, prompts, blocks)]
    got = runner.forward(chunks, list(range(7)), aux_layers=final).aux_hidden[0].clone()
    at = 0
    for t, p, b in zip(tails, prompts, blocks):
        for r, tok in enumerate(t):  # each request alone, one token at a time (rewrites identical KV)
            row = runner.forward([SeqChunk([tok], len(p) + r, b)], [0], aux_layers=final).aux_hidden[0]
            assert torch.equal(row[0], got[at]), (len(p), r)
            at += 1
