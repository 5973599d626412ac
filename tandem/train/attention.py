"""Dense attention for training: the frozen target over padded batches, and the head's TTT attention.

Training batches are padded ``[B, L]`` grids of whole sequences (right padding), flattened to
``B·L`` rows for the model code, which is per-token everywhere except in attention:

- ``PaddedCausalAttention`` is an ``AttentionBackend`` the target's forward accepts through
  ``ForwardContext``: rope (+ q/k norm) as inference does, no KV cache, then SDPA per batch with a
  causal mask (flash kernels on CUDA). Right padding never leaks into real rows: row ``t`` sees keys
  ``≤ t`` only. Sliding-window layers (Gemma 3) get an explicit banded mask.
- ``ttt_attention`` is the head's attention at unroll step ``j`` (EAGLE-3's ``cache_hidden``): row
  ``t`` attends causally to the step-0 keys of rows ``≤ t`` and to its own keys of steps ``1..j``
  (the "diagonal"), which is what inference's chain step ``j`` sees (the catch-up positions, then
  its own earlier chain positions). Step-0 scores are one batched matmul; diagonal scores are
  elementwise q·k sums concatenated before the softmax. Query rows are processed in chunks so the
  ``[B, kvh, g, rows, L]`` score block stays within a memory bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.models.forward_context import KVCache
from tandem.worker.attention import split_qkv

if TYPE_CHECKING:
    from tandem.models.decoder import Attention

# Elements of one float32 score block [B, heads, rows, keys] before query rows are chunked.
SCORE_BLOCK_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class PaddedBatchMeta:
    batch: int  # B sequences
    length: int  # L padded length; rows are b * L + t


class PaddedCausalAttention:
    """Causal self-attention over a padded batch for the frozen target (no KV cache)."""

    def forward(self, attn: Attention, qkv: torch.Tensor, positions: torch.Tensor, meta: PaddedBatchMeta,
                kv_cache: KVCache | None) -> torch.Tensor:  # [B·L, H·D]
        q, k, v = split_qkv(attn, qkv, positions)
        b, n = meta.batch, meta.length
        q = q.view(b, n, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = k.view(b, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = v.view(b, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        if attn.num_kv_heads != attn.num_heads:
            g = attn.num_heads // attn.num_kv_heads
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        window = attn.sliding_window
        if window is not None and n > window:
            i = torch.arange(n, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
        return o.transpose(1, 2).reshape(b * n, attn.num_heads * attn.head_dim)


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, ks: list[torch.Tensor],
                  vs: list[torch.Tensor], scale: float, block_elements: int = SCORE_BLOCK_ELEMENTS
                  ) -> torch.Tensor:
    """Attention of unroll step ``j = len(ks)``.

    ``q`` [B, L, H, D] (roped at positions ``t + j``), ``k0``/``v0`` [B, L, KVH, D] (step 0, roped at
    ``t``), ``ks``/``vs``: the keys/values of steps ``1..j`` at the same rows (step ``i`` roped at
    ``t + i``). Returns [B, L, H, D]."""
    b, n, h, d = q.shape
    kvh = k0.shape[2]
    g = h // kvh
    qg = q.view(b, n, kvh, g, d).permute(0, 2, 3, 1, 4)  # [B, kvh, g, L, D]
    k0t = k0.permute(0, 2, 3, 1).unsqueeze(2)  # [B, kvh, 1, D, L]
    v0t = v0.permute(0, 2, 1, 3).unsqueeze(2)  # [B, kvh, 1, L, D]
    diag_k = [k.permute(0, 2, 1, 3).unsqueeze(2) for k in ks]  # [B, kvh, 1, L, D]
    diag_v = [v.permute(0, 2, 1, 3).unsqueeze(2) for v in vs]
    rows = max(1, min(n, block_elements // max(1, b * h * n)))
    outs = []
    for s in range(0, n, rows):
        e = min(n, s + rows)
        qc = qg[:, :, :, s:e]  # [B, kvh, g, r, D]
        scores = torch.matmul(qc, k0t) * scale  # [B, kvh, g, r, L]
        causal = torch.arange(n, device=q.device)[None, :] <= torch.arange(s, e, device=q.device)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(qc * k[:, :, :, s:e]).sum(-1, keepdim=True) * scale for k in diag_k]  # [B, kvh, g, r, 1]
        scores = torch.cat([scores, *diag], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        o = torch.matmul(probs[..., :n], v0t)
        for i, v in enumerate(diag_v):
            o = o + probs[..., n + i:n + i + 1] * v[:, :, :, s:e]
        outs.append(o)
    o = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]  # [B, kvh, g, L, D]
    return o.permute(0, 3, 1, 2, 4).reshape(b, n, h, d)


def ttt_attention_reference(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, ks: list[torch.Tensor],
                            vs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The same attention as a slow loop over batches, rows and heads (the test's reference)."""
    b, n, h, _ = q.shape
    g = h // k0.shape[2]
    out = torch.zeros_like(q)
    for bi in range(b):
        for t in range(n):
            for hi in range(h):
                kv = hi // g
                keys = [k0[bi, s, kv] for s in range(t + 1)] + [k[bi, t, kv] for k in ks]
                vals = [v0[bi, s, kv] for s in range(t + 1)] + [v[bi, t, kv] for v in vs]
                w = torch.softmax(torch.stack([q[bi, t, hi] @ key * scale for key in keys]), dim=0)
                out[bi, t, hi] = sum(wi * vi for wi, vi in zip(w, vals))
    return out
