"""Hugging Face quantized checkpoints → :class:`QuantizedWeight`: GPTQ, AWQ (GEMM) and compressed-tensors.

Bit layouts, as the producing tools write them (all int32 words, value ``j`` of a word at bits
``[bits·j, bits·j + bits)``):

- **GPTQ** (AutoGPTQ / GPTQModel): ``qweight`` ``[K·bits/32, N]`` packed along K (input rows);
  ``qzeros`` ``[G, N·bits/32]`` packed along N; ``scales`` ``[G, N]`` fp16; ``g_idx`` ``[K]`` (the group
  of each input row; with act-order ``desc_act`` it is a permutation-sorted, non-monotonic map).
  ``W[k, n] = scales[g, n] · (q[k, n] − z[g, n])``, ``g = g_idx[k]``. Format ``gptq`` (v1) stores
  ``z − 1`` in ``qzeros`` (AutoGPTQ ``pack``: ``zeros -= 1``; its kernels add 1 back); ``gptq_v2``
  (GPTQModel) stores ``z``. Symmetric checkpoints have ``z = 2^(bits−1)`` everywhere (stored 7 in v1).
- **AWQ GEMM** (AutoAWQ ``WQLinear_GEMM``): ``qweight`` ``[K, N/8]`` packed along N in the interleaved
  order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``i`` holds column ``8c + order[i]``); ``qzeros``
  ``[K/g, N/8]`` packed the same way; ``scales`` ``[K/g, N]``. ``W[k, n] = s · (q − z)``.
- **compressed-tensors** ``pack-quantized`` (llm-compressor W4A16 / W8A16): ``weight_packed``
  ``[N, ceil(K·bits/32)]`` packed along K, each value stored with an offset of ``2^(bits−1)`` (signed
  ``q`` → unsigned code); ``weight_scale`` ``[N, K/g]`` (group) or ``[N, 1]`` (channel);
  ``weight_shape`` = ``[N, K]``; symmetric: ``W = s · q``.

GPTQ act-order becomes ``perm`` (columns sorted by group, see weights.py); when the groups are not
all ``group_size`` wide after sorting, the weight keeps one scale per column (group 1), which no kernel
takes, so it is dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.errors import ConfigError
from tandem.models.quant.weights import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
HF_METHODS = ("gptq", "awq", "compressed-tensors")
# Tensor suffixes of one quantized linear, per method; the first one is the one that must be there.
PARTS: dict[str, tuple[str, ...]] = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}


@dataclass(frozen=True)
class HFQuantScheme:
    """What ``quantization_config`` says, validated. ``group`` None: per output channel."""

    method: str
    bits: int
    group: int | None
    symmetric: bool
    zeros_minus_one: bool  # GPTQ v1 stores z - 1

    @staticmethod
    def from_config(qc: Any) -> HFQuantScheme:
        key = "quantization_config"
        if not isinstance(qc, dict):
            raise ConfigError(key, f"expected an object, got {type(qc).__name__}")
        method = str(qc.get("quant_method", "")).lower()
        if method not in HF_METHODS:
            raise ConfigError(f"{key}.quant_method", f"{qc.get('quant_method')!r} is not supported",
                              allowed=HF_METHODS)
        if method == "compressed-tensors":
            return _ct_scheme(qc)
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size", 128))
        allowed_bits = (4, 8) if method == "gptq" else (4,)
        if bits not in allowed_bits:
            raise ConfigError(f"{key}.bits", f"{method} with {bits!r} bits is not supported", allowed=allowed_bits)
        if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
            raise ConfigError(f"{key}.group_size", f"expected a positive integer or -1, got {group!r}")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ConfigError(f"{key}.version", f"AWQ {version!r} packing is not supported", allowed=["gemm"])
            if qc.get("zero_point", True) is not True:
                raise ConfigError(f"{key}.zero_point", "AWQ without zero points is not supported", allowed=[True])
            return HFQuantScheme("awq", 4, None if group == -1 else group, False, False)
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"{key}.checkpoint_format", f"GPTQ format {fmt!r} is not supported",
                              allowed=["gptq", "gptq_v2"])
        return HFQuantScheme("gptq", int(bits), None if group == -1 else group, bool(qc.get("sym", True)),
                             zeros_minus_one=fmt == "gptq")


def _ct_scheme(qc: dict[str, Any]) -> HFQuantScheme:
    key = "quantization_config"
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ConfigError(f"{key}.format", f"compressed-tensors format {fmt!r} is not supported",
                          allowed=["pack-quantized"])
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{key}.config_groups", "expected a non-empty object of quantization schemes")
    schemes = set()
    for name, g in groups.items():
        where = f"{key}.config_groups.{name}"
        w = (g or {}).get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            raise ConfigError(f"{where}.weights", "missing")
        if (g.get("input_activations") or None) is not None:
            raise ConfigError(f"{where}.input_activations",
                              "activation quantization (W8A8, W4A8) is not supported; weight-only schemes only")
        if w.get("type", "int") != "int":
            raise ConfigError(f"{where}.weights.type", f"{w.get('type')!r} is not supported", allowed=["int"])
        if w.get("num_bits") not in (4, 8):
            raise ConfigError(f"{where}.weights.num_bits", f"{w.get('num_bits')!r} is not supported", allowed=[4, 8])
        if w.get("symmetric", True) is not True:
            raise ConfigError(f"{where}.weights.symmetric", "asymmetric compressed-tensors weights are not "
                                                            "supported", allowed=[True])
        strategy = w.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise ConfigError(f"{where}.weights.strategy", f"{strategy!r} is not supported",
                              allowed=["group", "channel"])
        gs = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0):
            raise ConfigError(f"{where}.weights.group_size", f"expected a positive integer, got {gs!r}")
        schemes.add((w["num_bits"], gs))
    bits, group = sorted(schemes, key=str)[0]
    # Per-layer bits and group are read from the tensors' shapes; the scheme keeps the first for logs.
    return HFQuantScheme("compressed-tensors", int(bits), group, True, False)


# ---- unpacking --------------------------------------------------------------------------------------

def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int32 values of ``bits`` each, value ``j`` of a word at bits ``bits·j``,
    expanded along ``dim`` (0: rows, 1: columns)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == 0:
        vals = (p.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, per, C]
        return vals.reshape(p.shape[0] * per, p.shape[1])
    vals = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    return vals.reshape(p.shape[0], p.shape[1] * per)


def _from_kn(codes_kn: torch.Tensor, scales_gn: torch.Tensor, zeros_gn: torch.Tensor, g_idx: torch.Tensor | None,
             bits: int, group: int, source: str) -> QuantizedWeight:
    """[K, N] codes with per-(group, n) scales/zeros -> QuantizedWeight [N, K] (act-order handled)."""
    k, _ = codes_kn.shape
    s = scales_gn.float()
    off = -(s * zeros_gn.float())
    codes = codes_kn.t().to(torch.uint8)
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group):
        if k % group:
            raise ValueError(f"{source}: group {group} does not divide K={k}")
        return QuantizedWeight(codes=codes.contiguous(), scale=s.t().contiguous(), offset=off.t().contiguous(),
                               group=group, bits=bits, source=source)
    g = g_idx.long()
    perm = torch.argsort(g, stable=True)
    counts = torch.bincount(g, minlength=s.shape[0])
    if bool((counts == group).all()) and k % group == 0:
        gs = g[perm][::group]  # the group of each run of `group` sorted columns
        return QuantizedWeight(codes=codes[:, perm].contiguous(), scale=s[gs].t().contiguous(),
                               offset=off[gs].t().contiguous(), group=group, bits=bits, source=source, perm=perm)
    # Irregular groups: one scale per column (exact; no kernel takes group 1, so it is dequantized).
    return QuantizedWeight(codes=codes.contiguous(), scale=s[g].t().contiguous(), offset=off[g].t().contiguous(),
                           group=1, bits=bits, source=source)


def gptq_weight(parts: dict[str, torch.Tensor], scheme: HFQuantScheme) -> QuantizedWeight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    bits = scheme.bits
    codes = unpack_int32(qweight, bits, dim=0)  # [K, N]
    zeros = unpack_int32(qzeros, bits, dim=1)[:, :scales.shape[1]]
    if scheme.zeros_minus_one:
        zeros = zeros + 1
    k = codes.shape[0]
    group = scheme.group or k
    g_idx = parts.get("g_idx")
    return _from_kn(codes, scales, zeros, g_idx, bits, group, f"gptq{'' if scheme.zeros_minus_one else '_v2'}")


def awq_weight(parts: dict[str, torch.Tensor], scheme: HFQuantScheme) -> QuantizedWeight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    reverse = torch.argsort(torch.tensor(AWQ_ORDER))  # column c*8 + j is in nibble reverse[j]

    def unpack(p: torch.Tensor) -> torch.Tensor:
        v = unpack_int32(p, 4, dim=1).view(p.shape[0], -1, 8)
        return v[:, :, reverse].reshape(p.shape[0], -1)

    codes, zeros = unpack(qweight), unpack(qzeros)
    k = codes.shape[0]
    return _from_kn(codes, scales, zeros, None, 4, scheme.group or k, "awq")


def compressed_tensors_weight(parts: dict[str, torch.Tensor], scheme: HFQuantScheme) -> QuantizedWeight:
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    shape = parts.get("weight_shape")
    n = packed.shape[0]
    k = int(shape.flatten()[1]) if shape is not None else None
    if k is None:
        raise ValueError("compressed-tensors: weight_shape is missing")
    bits = _ct_bits(packed.shape[1], k)
    codes = unpack_int32(packed, bits, dim=1)[:, :k]
    s = scale.float().reshape(n, -1)
    zp = parts.get("weight_zero_point")
    z = (zp.float().reshape(n, -1) if zp is not None and zp.numel() == s.numel() else torch.zeros_like(s))
    if zp is not None and zp.numel() != s.numel():
        raise ValueError("compressed-tensors: packed zero points (asymmetric) are not supported")
    if parts.get("weight_g_idx") is not None:
        raise ValueError("compressed-tensors: act-order (weight_g_idx) is not supported")
    group = k // s.shape[1]
    half = 1 << (bits - 1)
    return QuantizedWeight(codes=codes.to(torch.uint8).contiguous(), scale=s.contiguous(),
                           offset=(-(half + z) * s).contiguous(), group=group, bits=bits,
                           source=f"compressed-tensors w{bits}a16")


def _ct_bits(packed_cols: int, k: int) -> int:
    for bits in (4, 8):
        if packed_cols == -(-k * bits // 32):
            return bits
    raise ValueError(f"compressed-tensors: {packed_cols} packed columns fit neither 4 nor 8 bits for K={k}")


DECODERS = {"gptq": gptq_weight, "awq": awq_weight, "compressed-tensors": compressed_tensors_weight}
