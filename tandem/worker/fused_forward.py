"""Fused CUDA execution of a ``CausalLM`` forward (Llama / Mistral / Qwen2 / Qwen3 shapes).

Same parameters, same function as ``CausalLM.forward`` (the reference, see tests/test_gpu.py), in
fewer kernels: per layer ``add_rmsnorm → qkv matmul → rope + KV write → attention → o matmul →
add_rmsnorm → gate_up matmul → silu_mul → down matmul`` (9–10 launches instead of ~35). The residual
stream is kept in a separate tensor updated in place by the fused add+norm, so the adds round in the
model dtype exactly as ``x = x + f(x)`` does.

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
from tandem.worker.triton_ops import rmsnorm, rope_write_kv, silu_mul


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
) -> torch.Tensor:  # final-normed hidden [T, H]
    m = model.model
    arch = model.arch
    t = input_ids.shape[0]
    heads, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    x = F.embedding(input_ids, m.embed_tokens.weight)  # [T, H]
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
        k_cache, v_cache = kv_caches[i]
        qn, kn = attn.q_norm, attn.k_norm
        rope_write_kv(
            qkv, positions, attn.rotary.cos, attn.rotary.sin, meta.slot_mapping, k_cache, v_cache,
            heads, kvh, d,
            q_norm=qn.weight if qn is not None else None, k_norm=kn.weight if kn is not None else None,
            eps=qn.eps if qn is not None else 1e-6,
        )
        q = qkv[:, : attn.q_size].view(t, heads, d)
        o = paged_attention(q, k_cache, v_cache, meta, attn.scale, attn.sliding_window)
        x = F.linear(o.view(t, attn.q_size), attn.o_proj.weight, attn.o_proj.bias)
        pn = layer.post_attention_layernorm
        h = rmsnorm(x, pn.weight, pn.eps, residual=residual)
        mlp = layer.mlp
        gu = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
        x = F.linear(silu_mul(gu, mlp.intermediate), mlp.down_proj.weight)
    if residual is None:  # zero layers
        return rmsnorm(x, m.norm.weight, m.norm.eps)
    return rmsnorm(x, m.norm.weight, m.norm.eps, residual=residual)
