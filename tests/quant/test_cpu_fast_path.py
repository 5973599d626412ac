"""The packed CPU decode step's shortcuts compute the same bits as the plain ops they replace, and the
opt-in fp16 LM head (``lm_head_dtype``) is what it says (docs/performance.md §17)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tiny_models import write_tiny_hf_checkpoint
from tandem.config import ModelConfig
from tandem.errors import ConfigError
from tandem.models.forward_context import ResidualStream
from tandem.models.layers import GatedMLP, RMSNorm, Rotary, _rotate_half
from tandem.models.quant.int4pack import Int4PackLinear
from tandem.models.quant.weights import quantize_float
from tandem.models.torch_kernels import TORCH_KERNELS
from tandem.worker.attention import _HostMeta
from tandem.worker.batch import SeqChunk
from tandem.worker.input_packer import layout, pack, step_tensors


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_cpu_rms_norm_is_the_composite_bitwise(rows):
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    x = torch.randn(rows, 576) * 3
    h = x.float()
    ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)
    assert torch.equal(norm(x), ref)


def test_rotate_qk_together_equals_rotary_forward_bitwise():
    torch.manual_seed(0)
    rot = Rotary(64, 10000.0, 512)
    pos = torch.tensor([3, 17, 400])
    q, k = torch.randn(3, 9, 64), torch.randn(3, 3, 64)
    rq, rk = rot(pos, q, k)
    both = rot.rotate(pos, torch.cat([q, k], dim=1))
    assert torch.equal(both[:, :9], rq) and torch.equal(both[:, 9:], rk)
    # and the reference formula itself
    cos, sin = rot.cos[pos][:, None], rot.sin[pos][:, None]
    assert torch.equal(rq, q * cos + _rotate_half(q) * sin)


def _int4(n: int, k: int, seed: int) -> Int4PackLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return Int4PackLinear(quantize_float(w, 4, 32, False, "int4"), None)


def test_low_precision_handoff_is_bitwise_the_cast_path():
    """linear_add / norm_gated_mlp_in with a packed module: bf16 output consumed by type promotion
    gives exactly ``forward``'s cast-then-add result."""
    torch.manual_seed(1)
    h, inter = 64, 96
    mlp = GatedMLP(h, inter, "silu")
    mlp.gate_up_proj, mlp.down_proj = _int4(2 * inter, h, 2), _int4(h, inter, 3)
    norm = RMSNorm(h, 1e-6)
    x = torch.randn(3, h)
    assert mlp.gate_up_proj.lowp and mlp.down_proj.lowp
    got = TORCH_KERNELS.norm_gated_mlp_in(ResidualStream(x), norm, mlp)
    ref = mlp.act_mul(mlp.gate_up_proj.forward(norm(x)))
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    stream = TORCH_KERNELS.linear_add(ref, mlp.down_proj, ResidualStream(x.clone()))
    assert torch.equal(stream.x, x + mlp.down_proj.forward(ref))


def test_int4pack_forward_is_unchanged_for_3d_input_and_after_to():
    lin = _int4(32, 64, 4)
    x = torch.randn(2, 3, 64)
    out = lin(x)
    assert out.shape == (2, 3, 32)
    assert torch.equal(out.reshape(6, 32), lin(x.reshape(6, 64)))
    lin.to(torch.device("cpu"))  # _apply drops the cached buffer tuple; results stay the same
    assert lin._args is None
    assert torch.equal(lin(x.reshape(6, 64)), out.reshape(6, 32))


def _meta(block_ids: list[int], seq_len: int, block_size: int = 4):
    chunks = [SeqChunk([1], seq_len - 1, block_ids)]
    w = len(block_ids)
    buf = np.empty(layout(1, 1, w)[-1] + 1, dtype=np.int64)
    length, t, _, _ = pack(block_size, buf, chunks, [1], 1, None, w, [0])
    _, _, meta = step_tensors(torch.from_numpy(buf[:length]), t, 1, w, block_size, 1)
    return _HostMeta(meta)


def test_slot_range_only_for_consecutive_blocks():
    host = _meta([5, 6, 7], 10)
    assert host.slot_range(0) == range(20, 30)
    assert host.context_slots[0].tolist() == list(range(20, 30))
    gap = _meta([5, 7, 8], 10)
    assert gap.slot_range(0) is None
    assert gap.context_slots[0].tolist() == [20, 21, 22, 23, 28, 29, 30, 31, 32, 33]


def test_lm_head_dtype_is_checked():
    with pytest.raises(ConfigError) as err:
        ModelConfig("m", lm_head_dtype="bfloat16")
    assert err.value.key == "lm_head_dtype"
    assert ModelConfig("m").lm_head_dtype == "auto"


def test_fp16_lm_head_is_opt_in_close_and_row_invariant(tmp_path):
    from tandem import LLM, SamplingParams

    path = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2)
    ref = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20)
    half = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, lm_head_dtype="float16")
    assert ref.engine.model.lm_head_lowp is None
    w16 = half.engine.model.lm_head_lowp
    assert w16 is not None and w16.dtype == torch.float16
    hidden = torch.randn(5, w16.shape[1])
    with torch.inference_mode():
        exact = ref.engine.model.compute_logits(hidden)
        got = half.engine.model.compute_logits(hidden)
        rows = torch.cat([half.engine.model.compute_logits(hidden[r:r + 1]) for r in range(5)])
    assert got.dtype == torch.float32
    assert torch.equal(got, rows)  # a verify row's logits are the decode's
    assert torch.allclose(got, exact, rtol=0, atol=2e-3 * exact.abs().max().item())
    assert torch.equal(got, F.linear(hidden.half(), w16).float())
    out = half.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4),
                        use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
