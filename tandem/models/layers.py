"""Building blocks shared by the model families: norms, rotary embedding, packed linears, MLP.

Numerics follow Hugging Face transformers operation for operation (float32 accumulation in norms,
rope tables built as ``pos * inv_freq`` in float32) so greedy outputs match HF token for token in
float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models import cpu_skinny


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: ``w * (x / rms(x))``; Gemma-style (``offset=True``): ``(x / rms(x)) * (1 + w)``."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset and x.device.type == "cpu":
            # ATen's CPU rms_norm is this same sequence of ops (fp32 upcast, pow, mean, + eps, rsqrt,
            # mul, cast back, · weight): bitwise equal, in one call instead of eight
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotary position embedding (HF "rotate_half" layout) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_factor = 1.0
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                inv_freq = inv_freq / float(scaling["factor"])
            elif kind not in ("default", None):
                raise NotImplementedError(f"rope scaling type {kind!r} is not supported yet")
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] = (self.cos, self.sin)
        self._rot_positions: torch.Tensor | None = None
        self._rot: tuple[torch.Tensor, torch.Tensor] = (self.cos, self.sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, h, d], k: [T, kvh, d]
        # On CPU every layer of a forward shares one table lookup (the runner builds a new positions
        # tensor per step). Not on CUDA, where a captured graph must contain the lookup itself.
        cached = self._positions is positions and self._cos_sin[0].dtype == q.dtype
        if q.is_cuda or not cached:
            self._cos_sin = (self.cos[positions].to(q.dtype)[:, None, :],
                             self.sin[positions].to(q.dtype)[:, None, :])
            self._positions = None if q.is_cuda else positions
        cos, sin = self._cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` for x [T, heads, d] (q and k heads side by side) in four
        ops: ``rotate_half(x) * sin`` is ``roll(x, d/2) * sin'`` with ``sin'`` = sin with its first half
        negated (exactly: -(a·b) = a·(-b) in floating point). CPU only (the table is cached per
        ``positions`` tensor, as in ``forward``)."""
        if self._rot_positions is not positions or self._rot[0].dtype != x.dtype:
            half = x.shape[-1] // 2
            cos = self.cos[positions].to(x.dtype)
            sin = self.sin[positions].to(x.dtype)
            self._rot = (cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :])
            self._rot_positions = positions
        cos, sin_signed = self._rot
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# On CPU, BLAS's sgemm for x @ W^T with few rows of x runs far below memory bandwidth (measured on
# the 2-core CI machine, cold cache, W 3072x576: 1 row 6.8 GB/s, 5 rows 3.4 GB/s), while W @ x^T
# streams W once at ~8 GB/s whatever the row count. Decode (1 row) and verify (k+1 rows) steps
# are all small-row matmuls, so this is what keeps verifying k+1 tokens about as cheap as one.
# A single row is a GEMV, which MKL runs on one thread; splitting W's rows into a batch of
# _GEMV_SPLIT matrices lets bmm spread them over the intra-op threads (SmolLM2's linears + LM head
# on 2 threads: 75.5 → 46.4 ms per token; on 1 thread 82.4 → 77.6 ms; benchmarks/cpu_gemv_split.py).
_SMALL_ROWS = 16
_GEMV_SPLIT = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the CPU small-row paths described above; float32 steps of 2-8 rows (a batch's
    decode, a verify) on ``cpu_skinny``, which streams W once for all of them."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= _SMALL_ROWS:
        if skinny_applies(x, weight):
            y = cpu_skinny.mm(x, weight)
            return y + bias if bias is not None else y
        out_f, in_f = weight.shape
        if x.shape[0] == 1 and out_f % _GEMV_SPLIT == 0 and weight.is_contiguous():
            w = weight.view(_GEMV_SPLIT, out_f // _GEMV_SPLIT, in_f)
            out = torch.bmm(w, x.t().unsqueeze(0).expand(_GEMV_SPLIT, in_f, 1)).view(1, out_f)
        else:
            out = (weight @ x.t()).t()
        return out + bias if bias is not None else out
    return F.linear(x, weight, bias)


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``cpu_skinny`` computes ``x Wᵀ`` for this 2-D CPU x: float32 both, 2 to MAX_ROWS rows,
    a contiguous weight, nothing to differentiate, the kernel built."""
    return (2 <= x.shape[0] <= cpu_skinny.MAX_ROWS and x.dtype is torch.float32 and weight.dtype is torch.float32
            and weight.is_contiguous() and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and cpu_skinny.available())


class Linear(nn.Linear):
    """nn.Linear (same parameter names) using :func:`linear`.

    No random init: every weight is loaded (``load_weights`` fails on a missing one), and skipping
    it keeps the untouched float pages of a linear that a quantized kernel module replaces out of RSS."""

    lowp = False  # no low-precision output path (the packed quantized modules have one: torch_kernels.py)

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    """One matmul for several HF projections (q/k/v → qkv, gate/up → gate_up).

    ``shards`` maps each HF sub-name to its output size; weights load shard by shard.
    """

    lowp = False

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__()
        self.shards = dict(shards)
        out = sum(shards.values())
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        self.offsets: dict[str, tuple[int, int]] = {}
        o = 0
        for name, size in shards.items():
            self.offsets[name] = (o, size)
            o += size

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        start, size = self.offsets[shard]
        target = self.weight if param == "weight" else self.bias
        if target is None:
            raise KeyError(f"{shard}.{param}: this layer has no bias")
        if tensor.shape[0] != size or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(f"{shard}.{param}: shape {tuple(tensor.shape)} does not fit {size} rows")
        with torch.no_grad():
            target[start:start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def activation(name: str):  # type: ignore[no-untyped-def]
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise NotImplementedError(f"activation {name!r} is not supported")


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act = activation(act)
        self.intermediate = intermediate

    def act_mul(self, gu: torch.Tensor) -> torch.Tensor:  # [T, 2I] packed gate | up → [T, I]
        """``act(gate) * up``; the layer kernels run the projections around it."""
        return self.act(gu[..., : self.intermediate]) * gu[..., self.intermediate:]
