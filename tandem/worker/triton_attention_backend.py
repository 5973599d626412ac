"""The Triton attention backend (CUDA): what the CUDA runner hands the model as ``ctx.attention``.

``fused_rope=True`` (the fast path): rope on q and k, the optional per-head q/k RMSNorm (Qwen3) and
the K/V write in one launch over the packed qkv projection (``triton_ops.rope_write_kv``), then the
paged-attention kernel. ``fused_rope=False``: q/k norm and rope in torch ops (any head dim, Gemma's
offset norms), K/V written by one Triton launch, same attention kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.models.forward_context import KVCache
from tandem.worker.attention import split_qkv
from tandem.worker.attn_metadata import AttentionMetadata
from tandem.worker.triton_attention import paged_attention_triton, write_kv_triton
from tandem.worker.triton_ops import rope_write_kv

if TYPE_CHECKING:
    from tandem.models.decoder import Attention


class TritonAttention:
    def __init__(self, fused_rope: bool, fixed_tiles: bool = False) -> None:
        self.fused_rope = fused_rope
        self.fixed_tiles = fixed_tiles  # batch-invariant mode: the same query tiles for every step

    def forward(self, attn: Attention, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:  # [T, H * D]
        t = qkv.shape[0]
        k_cache, v_cache = kv_cache
        if self.fused_rope:
            qn, kn = attn.q_norm, attn.k_norm
            rope_write_kv(
                qkv, positions, attn.rotary.cos, attn.rotary.sin, meta.slot_mapping, k_cache, v_cache,
                attn.num_heads, attn.num_kv_heads, attn.head_dim,
                q_norm=qn.weight if qn is not None else None, k_norm=kn.weight if kn is not None else None,
                eps=qn.eps if qn is not None else 1e-6,
            )
            q = qkv[:, : attn.q_size].view(t, attn.num_heads, attn.head_dim)
        else:
            q, k, v = split_qkv(attn, qkv, positions)
            write_kv_triton(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention_triton(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start, meta.query_lens,
            meta.block_size, attn.scale, meta.max_query_len, meta.num_kv_splits, attn.sliding_window,
            fixed_tiles=self.fixed_tiles,
        )
        return o.view(t, attn.q_size)
