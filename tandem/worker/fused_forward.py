"""Fused CUDA execution of a ``CausalLM`` forward (Llama / Mistral / Qwen2 / Qwen3 shapes).

Same parameters, same function as ``CausalLM.forward`` (the reference, see tests/test_gpu.py), in
fewer kernels. Two layer bodies:

- few rows (≤ ``gemv_rows``: batch-1 decode; up to 6 rows on small models, ``default_gemv_rows``),
  skinny Triton matmuls with the elementwise work fused in (``triton_gemv.py``, one program per row
  and column block): ``norm+qkv → rope + KV write → attention → o (+= residual) →
  norm+gate_up+silu·mul → down (+= residual)``, 6–7 launches per layer. On larger models 2+ rows
  cost ~rows × one row there, more than cuBLAS (benchmarks/gpu_gemv.py, docs/gpu_notes.md), so those
  steps take the cuBLAS body;
- more rows: ``add_rmsnorm → qkv matmul → rope + KV write → attention → o matmul → add_rmsnorm →
  gate_up matmul → silu_mul → down matmul`` with cuBLAS matmuls (9–10 launches instead of ~35).

The residual stream is kept in a separate tensor updated in place, so the adds round in the model
dtype exactly as ``x = x + f(x)`` does.

Not covered (``fused_supported`` is False, the runner uses ``CausalLM.forward``): Gemma3 (sandwich
norms, scaled embeddings, soft-capping), non-power-of-2 head dims, activations other than SiLU.
This module reads the model's modules; it never copies or re-lays out weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.loader.arch import ModelArch
from tandem.models.decoder import CausalLM, KVCache
from tandem.worker.attention import paged_attention
from tandem.worker.attn_metadata import AttentionMetadata
from tandem.worker.triton_gemv import MAX_ROWS, gemv
from tandem.worker.triton_ops import rmsnorm, rope_write_kv, silu_mul


# Models up to this hidden size run steps of up to SMALL_MODEL_GEMV_ROWS rows (a k <= 5 verify at batch
# 1, decode at batch <= 6) through the skinny matmuls, one program per row: their matmuls are a few
# µs of launch latency, not bandwidth, so k + 1 row programs cost little more than one, while the
# cuBLAS body has ~3 more kernels per layer. SmolLM2-135M shape on the H200: q=5 verify graph 0.776 ms
# skinny vs 0.902 ms cuBLAS (decode 0.465 ms); batch 8 decode 1.031 vs 0.917 ms, so not beyond 6 rows.
# Llama-3.2-1B (hidden 2048): skinny already loses at 2 rows (1.070 vs 1.045 ms) — cuBLAS above 1 row.
SMALL_MODEL_HIDDEN = 1024
SMALL_MODEL_GEMV_ROWS = 6


def default_gemv_rows(arch: ModelArch) -> int:
    """Most rows of a step that takes the skinny-matmul layer body (docs/gpu_notes.md, session 5)."""
    return SMALL_MODEL_GEMV_ROWS if arch.hidden_size <= SMALL_MODEL_HIDDEN else 1


def fused_supported(arch: ModelArch) -> bool:
    d = arch.head_dim
    return (
        not arch.is_gemma
        and arch.hidden_act in ("silu", "swish")
        and d >= 2 and d & (d - 1) == 0
        and not arch.final_logit_softcapping
    )


def fused_forward(
    model: CausalLM,
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    meta: AttentionMetadata,  # with device fields (Triton backend)
    kv_caches: list[KVCache],
    gemv_rows: int = 1,
    gemv_dot: bool = False,
) -> torch.Tensor:  # final-normed hidden [T, H]
    m = model.model
    t = input_ids.shape[0]
    x = F.embedding(input_ids, m.embed_tokens.weight)  # [T, H]
    if t <= min(gemv_rows, MAX_ROWS):
        return _skinny_layers(model, x, positions, meta, kv_caches, gemv_dot)
    residual: torch.Tensor | None = None
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        ln = layer.input_layernorm
        if residual is None:
            residual = x
            h = rmsnorm(x, ln.weight, ln.eps)
        else:
            h = rmsnorm(x, ln.weight, ln.eps, residual=residual)
        qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)  # [T, (H + 2 KVH) D]
        o = _attention(model, i, qkv, positions, meta, kv_caches[i])
        x = F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
        pn = layer.post_attention_layernorm
        h = rmsnorm(x, pn.weight, pn.eps, residual=residual)
        mlp = layer.mlp
        gu = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
        x = F.linear(silu_mul(gu, mlp.intermediate), mlp.down_proj.weight)
    if residual is None:  # zero layers
        return rmsnorm(x, m.norm.weight, m.norm.eps)
    return rmsnorm(x, m.norm.weight, m.norm.eps, residual=residual)


def _attention(model: CausalLM, i: int, qkv: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:  # [T, H * D]
    """Rope (+ Qwen3 q/k norm) and the KV write in one launch, then paged attention."""
    arch = model.arch
    attn = model.model.layers[i].self_attn
    heads, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    t = qkv.shape[0]
    k_cache, v_cache = kv_cache
    qn, kn = attn.q_norm, attn.k_norm
    rope_write_kv(
        qkv, positions, attn.rotary.cos, attn.rotary.sin, meta.slot_mapping, k_cache, v_cache,
        heads, kvh, d,
        q_norm=qn.weight if qn is not None else None, k_norm=kn.weight if kn is not None else None,
        eps=qn.eps if qn is not None else 1e-6,
    )
    q = qkv[:, : attn.q_size].view(t, heads, d)
    return paged_attention(q, k_cache, v_cache, meta, attn.scale, attn.sliding_window).view(t, attn.q_size)


def _skinny_layers(model: CausalLM, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[KVCache], dot: bool = False) -> torch.Tensor:
    """The decoder stack for few rows: norms, silu·mul and residual adds fused into the matmuls."""
    m = model.model
    residual = x  # updated in place by the o and down matmuls
    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        ln, pn = layer.input_layernorm, layer.post_attention_layernorm
        qkv = gemv(residual, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=ln.weight, eps=ln.eps, dot=dot)
        o = _attention(model, i, qkv, positions, meta, kv_caches[i])
        gemv(o, attn.o_proj.weight, attn.o_proj.bias, residual=residual, dot=dot)
        act = gemv(residual, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm_weight=pn.weight, eps=pn.eps,
                   gated=True, dot=dot)  # silu(gate) * up
        gemv(act, mlp.down_proj.weight, residual=residual, dot=dot)
    return rmsnorm(residual, m.norm.weight, m.norm.eps)
