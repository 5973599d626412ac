"""The head's TTT attention (EAGLE-3's cache_hidden scheme) and the target's padded dense attention
against slow references."""

from __future__ import annotations

import pytest
import torch

from tandem.train.attention import (
    PaddedBatchMeta,
    PaddedCausalAttention,
    ttt_attention,
    ttt_attention_reference,
)


@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("block", [1 << 28, 40])  # one block; query rows chunked (40 elements per block)
def test_ttt_attention_matches_the_loop_reference(steps, block):
    g = torch.Generator().manual_seed(steps)
    b, n, h, kvh, d = 2, 7, 4, 2, 8
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    k0, v0 = (torch.randn(b, n, kvh, d, generator=g, dtype=torch.float64) for _ in range(2))
    ks = [torch.randn(b, n, kvh, d, generator=g, dtype=torch.float64) for _ in range(steps)]
    vs = [torch.randn(b, n, kvh, d, generator=g, dtype=torch.float64) for _ in range(steps)]
    got = ttt_attention(q, k0, v0, ks, vs, 0.3, block_elements=block)
    want = ttt_attention_reference(q, k0, v0, ks, vs, 0.3)
    torch.testing.assert_close(got, want)


def test_ttt_attention_row_sees_only_its_prefix_and_its_own_diagonal():
    # changing a later row's step-0 key, or another row's diagonal key, must not move row t
    g = torch.Generator().manual_seed(0)
    b, n, h, d = 1, 5, 2, 4
    q = torch.randn(b, n, h, d, generator=g)
    k0, v0 = torch.randn(b, n, h, d, generator=g), torch.randn(b, n, h, d, generator=g)
    k1, v1 = torch.randn(b, n, h, d, generator=g), torch.randn(b, n, h, d, generator=g)
    base = ttt_attention(q, k0, v0, [k1], [v1], 0.5)
    k0b, k1b = k0.clone(), k1.clone()
    k0b[:, 3:] += 5.0
    k1b[:, 3] += 5.0
    moved = ttt_attention(q, k0b, v0, [k1b], [v1], 0.5)
    torch.testing.assert_close(moved[:, :3], base[:, :3])
    assert not torch.allclose(moved[:, 3], base[:, 3])


class _Attn:  # the attributes of models.decoder.Attention the backend reads
    num_heads, num_kv_heads, head_dim, scale = 4, 2, 8, 8 ** -0.5
    q_size, kv_size = 32, 16
    q_norm = k_norm = None
    sliding_window = None

    @staticmethod
    def rotary(positions, q, k):
        return q, k


@pytest.mark.parametrize("window", [None, 3])
def test_padded_causal_attention_equals_per_sequence_attention(window):
    attn = _Attn()
    attn.sliding_window = window
    g = torch.Generator().manual_seed(1)
    b, n = 3, 6
    qkv = torch.randn(b * n, 64, generator=g, dtype=torch.float64)
    out = PaddedCausalAttention().forward(attn, qkv, torch.arange(n).repeat(b), PaddedBatchMeta(b, n), None)
    for bi in range(b):
        for t in range(n):
            row = qkv[bi * n + t]
            q = row[:32].view(4, 8)
            keys = qkv[bi * n: bi * n + t + 1, 32:48].view(t + 1, 2, 8)
            vals = qkv[bi * n: bi * n + t + 1, 48:].view(t + 1, 2, 8)
            lo = 0 if window is None else max(0, t - window + 1)
            for hi in range(4):
                w = torch.softmax(keys[lo:, hi // 2] @ q[hi] * attn.scale, 0)
                want = w @ vals[lo:, hi // 2]
                torch.testing.assert_close(out[bi * n + t, hi * 8:(hi + 1) * 8], want)
