"""Tiny quantized checkpoints written the way the producing tools write them, plus numpy references.

Packers follow the published layouts (see tandem/models/quant/hf_formats.py for the sources):

- GPTQ (AutoGPTQ ``QuantLinear.pack``): ``qweight[i, n]`` holds input rows ``per·i + j`` at bits
  ``bits·j``; ``qzeros[g, c]`` holds columns ``per·c + j``; v1 stores ``zero − 1``; ``g_idx[k]`` is the
  group of input row k (act-order: ``inv_perm[k] // group_size``).
- AWQ (AutoAWQ ``WQLinear_GEMM.from_linear``): ``qweight[k, c]`` nibble ``i`` holds column
  ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``qzeros`` likewise.
- compressed-tensors ``pack_to_int32``: signed q + 2^(bits−1), packed along the input dim.

Every packer starts from integer codes, scales and zeros, and :func:`reference` computes the float
weights from those integers directly — independent of the unpacking code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tiny_models import write_tiny_hf_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Big enough for group 128 (K = 128 or 256) and N % 16 == 0 everywhere.
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
TINY_K = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def rtn(w: np.ndarray, bits: int, g_idx: np.ndarray, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest: codes [N, K] (0..2^b−1), fp16-exact scales [N, G], integer zeros [N, G]."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    q = np.zeros((n, k), np.int64)
    scale = np.zeros((n, groups), np.float32)
    zero = np.zeros((n, groups), np.int64)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        wg = w[:, cols]
        if sym:
            s = 2 * np.abs(wg).max(1) / maxq
            z = np.full(n, (maxq + 1) // 2)
        else:
            lo, hi = np.minimum(wg.min(1), 0), np.maximum(wg.max(1), 0)
            s = (hi - lo) / maxq
            z = np.clip(np.round(-lo / s), 1, maxq).astype(np.int64)  # >= 1: GPTQ v1 stores z - 1
        s = s.astype(np.float16).astype(np.float32)
        q[:, cols] = np.clip(np.round(wg / s[:, None]) + z[:, None], 0, maxq)
        scale[:, g], zero[:, g] = s, z
    return q, scale, zero


def reference(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """W[n, k] = scale[n, g_idx[k]] · (q[n, k] − zero[n, g_idx[k]])."""
    return (scale[:, g_idx] * (q - zero[:, g_idx])).astype(np.float32)


def pack_along(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Pack unsigned ``bits``-wide values into int32 along ``axis``: value j of a word at bits·j."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    word = np.zeros(v.shape[:-1], np.uint32)
    for j in range(per):
        word |= v[..., j] << np.uint32(bits * j)
    return np.moveaxis(word.view(np.int32), -1, axis)


def gptq_tensors(q, scale, zero, g_idx, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    zeros = zero.T - 1 if v1 else zero.T  # [G, N]
    zeros = zeros & ((1 << bits) - 1)  # v1's "zero − 1" of a zero point of 0 wraps (as AutoGPTQ's uint32)
    return {
        "qweight": torch.from_numpy(pack_along(q.T, bits, axis=0)),
        "qzeros": torch.from_numpy(pack_along(zeros, bits, axis=1)),
        "scales": torch.from_numpy(scale.T.astype(np.float16)),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }


def awq_tensors(q, scale, zero) -> dict[str, torch.Tensor]:
    def pack(a: np.ndarray) -> np.ndarray:  # [R, N] -> [R, N/8] in AWQ's interleaved order
        r, n = a.shape
        out = np.zeros((r, n // 8), np.uint32)
        for c in range(n // 8):
            for i, col in enumerate(AWQ_ORDER):
                out[:, c] |= a[:, 8 * c + col].astype(np.uint32) << np.uint32(4 * i)
        return out.view(np.int32)
    return {"qweight": torch.from_numpy(pack(q.T)), "qzeros": torch.from_numpy(pack(zero.T)),
            "scales": torch.from_numpy(scale.T.astype(np.float16))}


def ct_tensors(q, scale, zero, bits: int) -> dict[str, torch.Tensor]:
    signed = q - zero.repeat(q.shape[1] // zero.shape[1], axis=1)  # symmetric: zero = 2^(b-1)
    stored = signed + (1 << (bits - 1))
    return {"weight_packed": torch.from_numpy(pack_along(stored, bits, axis=1)),
            "weight_scale": torch.from_numpy(scale.astype(np.float16)),
            "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}


def write_quantized(tmp_path: Path, method: str, *, bits: int = 4, group: int = 128, sym: bool = False,
                    act_order: bool = False, v1: bool = True, strategy: str = "group", seed: int = 0,
                    name: str | None = None, family: str = "llama") -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A tiny llama in ``method``'s packing, and the same model with the reference float weights.

    Returns (quantized dir, reference float dir, {hf weight name: reference W})."""
    tag = name or f"{method}-{bits}-{group}-{sym}-{act_order}-{v1}-{strategy}-{family}"
    base = write_tiny_hf_checkpoint(tmp_path, family, name=f"{tag}-float", seed=seed, **TINY)
    tensors = load_file(str(base / "model.safetensors"))
    rng = np.random.default_rng(seed)
    qdir, rdir = tmp_path / tag, tmp_path / f"{tag}-ref"
    shutil.copytree(base, qdir)
    shutil.copytree(base, rdir)
    out: dict[str, torch.Tensor] = {}
    refs: dict[str, np.ndarray] = {}
    for key, t in tensors.items():
        mod = key.rsplit(".", 2)
        if not (key.endswith(".weight") and mod[-2] in LINEARS and key.startswith("model.layers.")):
            out[key] = t
            continue
        w = t.float().numpy()
        n, k = w.shape
        g = k if (group == -1 or strategy == "channel") else group
        g_idx = np.arange(k) // g
        if act_order:
            inv = np.argsort(rng.permutation(k))
            g_idx = inv // g
        q, scale, zero = rtn(w, bits, g_idx, sym or method == "compressed-tensors")
        prefix = key[: -len(".weight")]
        refs[key] = reference(q, scale, zero, g_idx)
        if method == "gptq":
            parts = gptq_tensors(q, scale, zero, g_idx, bits, v1)
        elif method == "awq":
            parts = awq_tensors(q, scale, zero)
        else:
            parts = ct_tensors(q, scale, zero, bits)
        out.update({f"{prefix}.{p}": v.contiguous() for p, v in parts.items()})
    save_file(out, str(qdir / "model.safetensors"))
    ref_tensors = {k: (torch.from_numpy(refs[k]) if k in refs else v) for k, v in tensors.items()}
    save_file(ref_tensors, str(rdir / "model.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(method, bits, group, sym, act_order, v1, strategy)
    (qdir / "config.json").write_text(json.dumps(cfg))
    return qdir, rdir, refs


def quantization_config(method: str, bits: int, group: int, sym: bool, act_order: bool, v1: bool,
                        strategy: str) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy,
               "group_size": group if strategy == "group" else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"]}


def k_quant_blocks(rows: int, cols: int, qtype, seed: int = 0) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K blocks with small super-block scales (weights of ~0.05)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(seed).integers(0, 256, (rows * (cols // block), size), dtype=np.uint8)
    supers = ((208, 1e-4),) if qtype == GGMLQuantizationType.Q6_K else ((0, 3e-4), (2, 3e-4))  # d (, dmin)
    for off, value in supers:
        data[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return data.reshape(rows, cols // block * size)
