#!/usr/bin/env python
"""Weight-only quantized matmul kernels on the CPU, SmolLM2-135M's real weights (issue #17).

Reads the raw Q4_1 / Q8_0 blocks of the built-in GGUF (no dequantize-at-load) and times, for 1, 2, 4
and 6 activation rows (decode and k+1 verify), each candidate on every matmul of one forward — 30
layers x [qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576] + the tied LM head
576->49152, distinct tensors so weights come from DRAM as in a real step:

- ``fp32 F.linear`` and ``fp32 tandem linear`` (``tandem.models.layers.linear``: W @ x^T, split bmm
  for one row): today's path, on the GGUF dequantized to float32;
- ``int8pack``: ``aten._weight_int8pack_mm`` (int8, one scale per output row; requantized);
- ``int4pack gG``: ``aten._weight_int4pack_mm_for_cpu`` (uint4 with a scale and a zero per group of
  G along K; G = 32 is GGUF's Q4 block, mapped exactly, see below; G = 64/128 requantized);
- ``cpu_q4``: tandem's own kernel (``tandem/models/quant/cpu_q4.py``, C with AVX-512 BF16; with
  ``--isa avx2`` its AVX2 + FMA variant, ``cpu_q4_avx2.py``), the Q4 codes and float32 scales as
  served, bf16 activations;
- ``dyn4``: ``aten._dyn_quant_matmul_4bit`` (symmetric int4 weights, int8 dynamic activations);
- torchao's CPU weight-only configs, if ``import torchao`` works (``--torchao-path``).

bf16 variants cast the float32 activation to bf16 and the result back inside the timed call (the
engine runs float32 on CPU). All candidates of one (threads, rows) cell run interleaved in one
process, in alternating order; the table reports medians and ratios to the fp32 tandem path.

Grid mapping (checked numerically in the "grid" table): ``int4pack`` dequantizes
``w = (q - 8) * scale + zero``; GGUF Q4_1 is ``w = d * q + m`` and Q4_0 ``w = d * (q - 8)``, so
``scale = d, zero = m + 8 d`` (Q4_1) and ``scale = d, zero = 0`` (Q4_0) with the same codes q and
group 32. Q8_0 (``w = d * q``, int8 q, per-32 d) has no exact image: int8pack has one scale per row,
the int4 kernels 16 levels.

Usage: python benchmarks/cpu_quant_kernels.py [--rows 1,2,4,6] [--threads 2,1] [--repeats 5]
       [--isa native|avx2] [--step] [--layers 30] [--cell-budget 15] [--torchao-path DIR]
       [--json results/quant.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_GGUF = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Raw Q4_1 blocks are read from --gguf; the table is markdown on stdout.",
    )
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="SmolLM2-135M Q4_1 GGUF file")
    ap.add_argument("--rows", default="1,2,4,6", help="activation row counts (default 1,2,4,6)")
    ap.add_argument("--threads", default="2,1", help="torch intra-op thread counts (default 2,1)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed rounds per cell (slow candidates: 2 passes in all); one warm-up more")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers to use (default all 30)")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: re-run with ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2 and "
                         "TANDEM_CPU_ISA=avx2 (emulates an AVX2-only machine on an AVX-512 one)")
    ap.add_argument("--torchao-path", default=None,
                    help="directory to prepend to sys.path for torchao (e.g. a side venv's site-packages)")
    ap.add_argument("--no-torchao", action="store_true", help="skip torchao even if importable")
    ap.add_argument("--cell-budget", type=float, default=15.0,
                    help="seconds after which a (threads, rows) cell starts no new round (at least one round)")
    ap.add_argument("--ctx", type=int, default=250, help="context length of the whole-step reference")
    ap.add_argument("--step", action="store_true",
                    help="also time tandem's own fp32 forward (LLM(...) load: +20-40 s) and print the "
                         "projected per-step speed-up of each candidate")
    ap.add_argument("--json", type=Path, default=None, help="also write all numbers here")
    return ap.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.isa == "avx2" and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
    # Both are read once, when torch / MKL initialise: set them and start again.
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", TANDEM_CPU_ISA="avx2")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from functools import partial  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tandem.loader.gguf import reverse_llama_permute  # noqa: E402
from tandem.models.layers import linear as tandem_linear  # noqa: E402

aten = torch.ops.aten
KINDS = ("qkv", "o", "gate_up", "down")
ALL_KINDS = (*KINDS, "lm_head")
HEADS, KV_HEADS = 9, 3


# ---- GGUF blocks ---------------------------------------------------------------------------------

@dataclass
class QW:
    """One GGUF-quantized matrix [N, K] as codes and per-32 block parameters (float32 tensors).

    Q4_1: w = d*q + m (q uint8 0..15); Q4_0: w = d*(q - 8); Q8_0: w = d*q (q int8)."""
    fmt: str
    q: torch.Tensor          # [N, K] int16
    d: torch.Tensor          # [N, K/32] float32 (exact fp16 values)
    m: torch.Tensor | None   # Q4_1 only

    def dequant(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // 32, 32)
        if self.fmt == "Q4_1":
            w = self.d[..., None] * q + self.m[..., None]
        elif self.fmt == "Q4_0":
            w = self.d[..., None] * (q - 8)
        else:
            w = self.d[..., None] * q
        return w.reshape(n, k)

    def rows(self, perm: Callable[[torch.Tensor], torch.Tensor]) -> QW:
        return QW(self.fmt, perm(self.q), perm(self.d), perm(self.m) if self.m is not None else None)


def parse_blocks(raw: np.ndarray, fmt: str, n: int, k: int) -> QW:
    """Raw GGUF bytes [n, bytes per row] -> QW (llama.cpp block layouts, ggml-common.h)."""
    nb = k // 32
    if fmt == "Q4_1":       # {fp16 d, fp16 m, 16 bytes: q[j] low nibble, q[j+16] high nibble}
        b = raw.reshape(n, nb, 20)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]
        m = b[..., 2:4].copy().view(np.float16)[..., 0]
        qs = b[..., 4:20]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    elif fmt == "Q4_0":     # {fp16 d, 16 bytes}
        b = raw.reshape(n, nb, 18)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]
        m = None
        qs = b[..., 2:18]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    elif fmt == "Q8_0":     # {fp16 d, 32 x int8}
        b = raw.reshape(n, nb, 34)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]
        m = None
        q = b[..., 2:34].copy().view(np.int8)
    else:
        raise ValueError(fmt)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    return QW(fmt, torch.from_numpy(q.reshape(n, k).astype(np.int16)), t(d), t(m) if m is not None else None)


def load_gguf(path: Path, layers: int) -> tuple[dict[str, list[QW]], dict[str, float]]:
    """Per kind, one QW per layer (qkv and gate_up concatenated row-wise like tandem's PackedLinear)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> QW:
        t = tensors[name]
        k, n = (int(s) for s in t.shape)  # ne order: [in, out]
        return parse_blocks(np.asarray(t.data), t.tensor_type.name, n, k)

    # Sanity: our block parsing equals gguf's dequantize (what tandem's loader calls).
    check = {}
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        ref = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        check[name] = float((get(name).dequant() - ref.reshape(get(name).q.shape)).abs().max())
    cat = lambda ws: QW(ws[0].fmt, *(torch.cat([getattr(w, a) for w in ws]) if getattr(ws[0], a) is not None  # noqa: E731
                                        else None for a in ("q", "d", "m")))
    out: dict[str, list[QW]] = {k: [] for k in ALL_KINDS}
    for i in range(layers):
        p = f"blk.{i}."
        q = get(p + "attn_q.weight").rows(lambda r: reverse_llama_permute(r, HEADS))
        kk = get(p + "attn_k.weight").rows(lambda r: reverse_llama_permute(r, KV_HEADS))
        out["qkv"].append(cat([q, kk, get(p + "attn_v.weight")]))
        out["o"].append(get(p + "attn_output.weight"))
        out["gate_up"].append(cat([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")]))
        out["down"].append(get(p + "ffn_down.weight"))
    out["lm_head"].append(get("token_embd.weight"))  # tied embeddings: the LM head reads token_embd
    return out, check


# ---- candidates ----------------------------------------------------------------------------------

def int8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (w.abs().amax(1) / 127).clamp_min(1e-12)
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def int4_grid(src: QW, w: torch.Tensor, gs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Codes [N,K] in 0..15, scale and zero [N,K/gs] for w = (q-8)*scale + zero. Exact map when the
    GGUF block is a 4-bit one of size gs; otherwise asymmetric min/max requantization of w."""
    n, k = w.shape
    if gs == 32 and src.fmt == "Q4_1":
        return src.q, src.d, src.m + 8 * src.d, True
    if gs == 32 and src.fmt == "Q4_0":
        return src.q, src.d, torch.zeros_like(src.d), True
    g = w.view(n, k // gs, gs)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).view(n, k)
    return q, scale, lo + 8 * scale, False


def sym4_grid(src: QW, w: torch.Tensor, gs: int = 32) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Codes 0..15 and scale for w = (q-8)*scale (Q4_0's grid): exact for Q4_0, requantized otherwise."""
    if src.fmt == "Q4_0" and gs == 32:
        return src.q, src.d, True
    n, k = w.shape
    g = w.view(n, k // gs, gs)
    # ggml's quantize_row_q4_0: the value of largest magnitude maps to code 0 (-8), d = it / -8.
    extreme = g.gather(-1, g.abs().argmax(-1, keepdim=True))[..., 0]
    scale = torch.where(extreme == 0, torch.ones_like(extreme), extreme / -8)
    q = (torch.round(g / scale[..., None]).clamp(-8, 7) + 8).view(n, k)
    return q, scale, False


@dataclass
class Candidate:
    name: str
    calls: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    grid: dict[str, str] = field(default_factory=dict)   # kind -> "exact" / "requant"
    note: str = ""
    step: Callable[[int], object] | None = None           # whole-forward reference (rows -> run)


def nb(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _cast_call(op: Callable[..., torch.Tensor], act: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    return op(x.to(act)).float() if act != torch.float32 else op(x)


def prep_fp32(kind_ws: dict[str, list[torch.Tensor]], tandem: bool) -> Candidate:
    c = Candidate("fp32 tandem linear" if tandem else "fp32 F.linear")
    for kind, ws in kind_ws.items():
        fn = tandem_linear if tandem else F.linear
        c.calls[kind] = [partial(lambda x, w, fn=fn: fn(x, w), w=w) for w in ws]
        c.nbytes[kind] = sum(nb(w) for w in ws)
        c.grid[kind] = "exact"
    return c


def prep_int8(kind_ws: dict[str, list[torch.Tensor]]) -> tuple[Candidate, Candidate]:
    """int8pack with bf16 and with fp32 activations (same int8 codes)."""
    out = []
    for act in (torch.bfloat16, torch.float32):
        out.append(Candidate(f"int8pack {'bf16' if act == torch.bfloat16 else 'fp32'}"))
    for kind, ws in kind_ws.items():
        for c, act in zip(out, (torch.bfloat16, torch.float32), strict=True):
            c.calls[kind], c.nbytes[kind], c.grid[kind] = [], 0, "requant"
        for w in ws:
            q, s32 = int8_rowwise(w)
            for c, act in zip(out, (torch.bfloat16, torch.float32), strict=True):
                s = s32.to(act)
                c.nbytes[kind] += nb(q, s)
                c.calls[kind].append(partial(
                    lambda x, q, s, act: _cast_call(lambda a: aten._weight_int8pack_mm(a, q, s), act, x),
                    q=q, s=s, act=act))
    return out[0], out[1]


def prep_bf16(kind_ws: dict[str, list[torch.Tensor]]) -> Candidate:
    """Reference, not a quantized kernel: bf16 weights (half of fp32's bytes), F.linear in bf16."""
    c = Candidate("bf16 F.linear (ref)")
    for kind, ws in kind_ws.items():
        wb = [w.to(torch.bfloat16) for w in ws]
        c.calls[kind] = [partial(lambda x, w: F.linear(x.to(torch.bfloat16), w).float(), w=w) for w in wb]
        c.nbytes[kind], c.grid[kind] = sum(nb(w) for w in wb), "rounded to bf16"
    return c


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, act: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    packed = aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(act)  # [K/gs, N, 2]
    return packed, sz


def prep_int4(kinds: dict[str, list[tuple[QW, torch.Tensor]]], gs: int, act: torch.dtype) -> Candidate:
    c = Candidate(f"int4pack g{gs} {'bf16' if act == torch.bfloat16 else 'fp32'}")
    for kind, pairs in kinds.items():
        if pairs[0][1].shape[1] % gs:
            c.note = f"g{gs}: only K divisible by {gs}"
            continue
        calls, total, exact = [], 0, True
        for src, w in pairs:
            q, scale, zero, ex = int4_grid(src, w, gs)
            exact &= ex
            packed, sz = pack_int4(q, scale, zero, act)
            total += nb(packed, sz)
            calls.append(partial(lambda x, p, sz: _cast_call(
                lambda a: aten._weight_int4pack_mm_for_cpu(a, p, gs, sz), act, x), p=packed, sz=sz))
        c.calls[kind], c.nbytes[kind] = calls, total
        c.grid[kind] = "exact" if exact and act == torch.float32 else ("scales bf16" if exact else "requant")
    return c


def pack_dyn4(q: torch.Tensor, scale: torch.Tensor, gs: int) -> torch.Tensor:
    n, k = q.shape
    q = q.to(torch.uint8)
    two = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()   # even k in the low nibble
    return aten._dyn_quant_pack_4bit_weight(two, scale.contiguous(), None, gs, k, n)


def prep_dyn4(kinds: dict[str, list[tuple[QW, torch.Tensor]]], gs: int = 32) -> Candidate:
    c = Candidate(f"dyn4 g{gs} fp32 (int8 act)")
    for kind, pairs in kinds.items():
        calls, total = [], 0
        for src, w in pairs:
            q, scale, _ = sym4_grid(src, w, gs)
            n, k = w.shape
            blob = pack_dyn4(q, scale, gs)
            total += nb(blob)
            calls.append(partial(lambda x, b, k, n: aten._dyn_quant_matmul_4bit(x, b, gs, k, n), b=blob, k=k, n=n))
        c.calls[kind], c.nbytes[kind], c.grid[kind] = calls, total, "requant (sym)"
    return c


def prep_cpu_q4(kinds: dict[str, list[tuple[QW, torch.Tensor]]]) -> Candidate:
    """tandem's own kernel (``models/quant/cpu_q4.py``, AVX-512 BF16 or AVX2 + FMA): the Q4 codes exactly,
    float32 scale and offset, bf16 activations, float32 out. 4-bit formats only (the Q8_0 head is skipped)."""
    from tandem.models.quant import cpu_q4
    from tandem.models.quant.weights import QuantizedWeight

    c = Candidate(f"cpu_q4 g32 bf16 (tandem, {cpu_q4.variant() or 'not built'})")
    if not cpu_q4.available():
        c.note = "cpu_q4 unavailable here (needs AVX-512 BF16 or AVX2 + FMA, and a C compiler)"
        return c
    for kind, pairs in kinds.items():
        if pairs[0][0].fmt not in ("Q4_0", "Q4_1"):
            c.note = "4-bit formats only"
            continue
        calls, total = [], 0
        for src, _ in pairs:
            off = src.m if src.fmt == "Q4_1" else -8 * src.d
            packed = cpu_q4.pack(QuantizedWeight(codes=src.q.to(torch.uint8), scale=src.d, offset=off, group=32,
                                                 bits=4, source=src.fmt))
            total += nb(packed)
            calls.append(partial(lambda x, p: cpu_q4.mm(x, p, 32), p=packed))
        c.calls[kind], c.nbytes[kind], c.grid[kind] = calls, total, "exact (activations bf16)"
    return c


def prep_torchao(kind_ws: dict[str, list[torch.Tensor]], which: str) -> Candidate:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if which == "int4":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        cfg, act, name = PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False), torch.bfloat16, \
            "torchao Int4 opaque g32 bf16"
    else:
        cfg, act, name = Int8WeightOnlyConfig(set_inductor_config=False), torch.float32, "torchao Int8WeightOnly fp32"
    c = Candidate(name)
    for kind, ws in kind_ws.items():
        calls, total = [], 0
        for w in ws:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=act)
            with torch.no_grad():
                lin.weight.copy_(w)
            quantize_(lin, cfg)
            qw = lin.weight
            total += sum(nb(getattr(qw, a)) for a in qw.__tensor_flatten__()[0])
            calls.append(partial(lambda x, qw: _cast_call(lambda a: F.linear(a, qw), act, x), qw=qw))
        c.calls[kind], c.nbytes[kind], c.grid[kind] = calls, total, "requant"
    return c


STEP = "tandem fp32 forward (whole step)"


def prep_step(ctx: int, max_rows: int) -> Candidate:
    """tandem's own fp32 forward (runner.forward_logits) of ``m`` new tokens after a ``ctx``-token
    context: what a decode (m = 1) or a verify (m = k+1) step runs, linears + LM head included."""
    import math

    from tandem import LLM
    from tandem.worker.batch import SeqChunk

    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", max_model_len=2048,
              kv_cache_memory_bytes=256 << 20)
    runner = llm.engine.runner
    blocks = list(range(math.ceil((ctx + max_rows) / llm.engine.block_size)))
    ids = torch.randint(100, 20000, (ctx + max_rows,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward_logits([SeqChunk(ids[:ctx], 0, blocks)], [ctx - 1])

    def run(m: int) -> object:  # each call rewrites the same KV slots
        return runner.forward_logits([SeqChunk(ids[ctx:ctx + m], ctx, blocks)], list(range(m)))

    return Candidate(STEP, step=run, note=f"context {ctx}")


def composite(name: str, layers_from: Candidate, head_from: Candidate) -> Candidate:
    c = Candidate(name)
    for kind in ALL_KINDS:
        src = head_from if kind == "lm_head" else layers_from
        c.calls[kind], c.nbytes[kind], c.grid[kind] = src.calls[kind], src.nbytes[kind], src.grid[kind]
    return c


# ---- checks --------------------------------------------------------------------------------------

def rel_err(c: Candidate, kind: str, w_ref: torch.Tensor, x: torch.Tensor) -> float:
    y = c.calls[kind][0](x).double()
    ref = x.double() @ w_ref.double().t()
    return float((y - ref).norm() / ref.norm())


def grid_table(src_by_fmt: dict[str, QW]) -> list[dict]:
    """Max |W_eff - W_gguf| / max|W_gguf| of each kernel's grid for each GGUF block format.

    W_eff of int4pack (fp32 scales) and int8pack is read back through the kernel itself
    (x = identity); the bf16-scale and dyn4 grids are evaluated from their formulas."""
    rows = []
    for fmt, src in src_by_fmt.items():
        w = src.dequant()
        n, k = w.shape
        eye = torch.eye(k)
        wmax = float(w.abs().max())

        def rec(name: str, w_eff: torch.Tensor, exact_map: str) -> None:
            diff = (w_eff.float() - w).abs()
            rows.append({"format": fmt, "grid": name, "mapping": exact_map,
                         "max_rel": float(diff.max()) / wmax,
                         "bit_equal": float((w_eff.float() == w).float().mean())})

        q, scale, zero, ex = int4_grid(src, w, 32)
        packed, sz = pack_int4(q, scale, zero, torch.float32)
        rec("int4pack g32, fp32 scale/zero", aten._weight_int4pack_mm_for_cpu(eye, packed, 32, sz).t(),
            "scale=d, zero=m+8d" if fmt == "Q4_1" else "scale=d, zero=0" if ex else "requantized")
        sb, zb = scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()
        rec("int4pack g32, bf16 scale/zero",
            ((q.float().view(n, -1, 32) - 8) * sb[..., None] + zb[..., None]).view(n, k),
            "same, scales rounded to bf16" if ex else "requantized")
        q8, s8 = int8_rowwise(w)
        rec("int8pack per-row, fp32 scale", aten._weight_int8pack_mm(eye, q8, s8).t(), "requantized")
        qs, ss, exs = sym4_grid(src, w, 32)
        rec("dyn4 g32 symmetric", ((qs.float().view(n, -1, 32) - 8) * ss[..., None]).view(n, k),
            "scale=d" if exs else "requantized")
    return rows


# ---- timing --------------------------------------------------------------------------------------

@torch.inference_mode()
def one_pass(c: Candidate, xs: dict[int, torch.Tensor], layers: int) -> tuple[float, dict[str, float]]:
    pc = time.perf_counter
    if c.step is not None:
        t0 = pc()
        c.step(xs[576].shape[0])
        return pc() - t0, {}
    per = dict.fromkeys(c.calls, 0.0)
    t_start = pc()
    for i in range(layers):
        for kind in KINDS:
            calls = c.calls.get(kind)
            if calls is None:
                continue
            x = xs[1536 if kind == "down" else 576]
            t0 = pc()
            calls[i](x)
            per[kind] += pc() - t0
    if "lm_head" in c.calls:
        t0 = pc()
        c.calls["lm_head"][0](xs[576])
        per["lm_head"] += pc() - t0
    total = pc() - t_start
    return total, {k: v / (layers if k != "lm_head" else 1) for k, v in per.items()}


def time_cell(cands: list[Candidate], m: int, repeats: int, layers: int, budget_s: float) -> dict[str, dict]:
    """Interleaved passes, alternating order. A candidate whose warm-up pass took > 4x the fp32 tandem
    path's is "slow": its warm-up counts as a sample and it gets one more pass. After the first round,
    no new round starts once the cell has run ``budget_s`` (on a loaded machine 2-thread passes stall)."""
    t_cell = time.perf_counter()
    g = torch.Generator().manual_seed(m)
    xs = {576: torch.randn(m, 576, generator=g), 1536: torch.randn(m, 1536, generator=g)}
    warm = {c.name: one_pass(c, xs, layers) for c in cands}
    base = warm["fp32 tandem linear"][0]
    slow = {c.name for c in cands if warm[c.name][0] > 4 * base}
    samples: dict[str, list] = {c.name: [warm[c.name]] if c.name in slow else [] for c in cands}
    for r in range(repeats):
        if r >= 1 and time.perf_counter() - t_cell > budget_s:
            break
        order = cands if r % 2 == 0 else cands[::-1]
        for c in order:
            if c.name in slow and len(samples[c.name]) >= 2:
                continue
            samples[c.name].append(one_pass(c, xs, layers))
    out = {}
    for c in cands:
        s = samples[c.name]
        out[c.name] = {
            "full": len(c.calls) == len(ALL_KINDS),
            "total_ms": statistics.median(t for t, _ in s) * 1e3,
            "total_min_ms": min(t for t, _ in s) * 1e3,
            "per_us": {k: statistics.median(p[k] for _, p in s) * 1e6 for k in c.calls},
            "n": len(s),
            "slow": c.name in slow,
        }
    return out


# ---- main ----------------------------------------------------------------------------------------

def main() -> None:
    args = ARGS or parse_args()
    if args.torchao_path:
        sys.path.insert(0, args.torchao_path)
    t_begin = time.perf_counter()
    torch.manual_seed(0)
    if not args.gguf.exists():
        sys.exit(f"{args.gguf} not found (tandem downloads it on first use: "
                 "python -c \"from tandem import LLM; LLM('smollm2-135m-instruct', device='cpu')\")")
    srcs, check = load_gguf(args.gguf, args.layers)
    print(f"  read GGUF blocks in {time.perf_counter() - t_begin:.1f} s", file=sys.stderr)
    deq = {k: [s.dequant() for s in v] for k, v in srcs.items()}
    pairs = {k: list(zip(srcs[k], deq[k], strict=True)) for k in ALL_KINDS}

    def prep(label: str, fn: Callable[[], Candidate]) -> Candidate:
        t0 = time.perf_counter()
        c = fn()
        print(f"  prepared {label} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return c

    cands: list[Candidate] = [prep_fp32(deq, tandem=True), prep_fp32(deq, tandem=False)]
    unavailable: dict[str, str] = {}
    t0 = time.perf_counter()
    i8b, i8f = prep_int8(deq)
    print(f"  prepared int8pack in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    i4b = prep("int4pack g32 bf16", lambda: prep_int4(pairs, 32, torch.bfloat16))
    cands += [i8b, i8f, i4b, prep("cpu_q4", lambda: prep_cpu_q4(pairs))]
    for gs, act in ((32, torch.float32), (64, torch.bfloat16), (128, torch.bfloat16)):
        cands.append(prep(f"int4pack g{gs}", lambda gs=gs, act=act: prep_int4(pairs, gs, act)))
    bf = prep("bf16", lambda: prep_bf16(deq))
    cands += [composite("int4pack g32 bf16 + fp32 head", i4b, cands[0]),
              composite("int4pack g32 bf16 + int8pack bf16 head", i4b, i8b), bf]
    kleidi = getattr(getattr(torch.backends, "kleidiai", None), "is_available", lambda: None)()
    try:
        cands.append(prep("dyn4", lambda: prep_dyn4(pairs)))
    except Exception as e:  # noqa: BLE001 — report whatever this build says
        unavailable["dyn4 (_dyn_quant_matmul_4bit)"] = f"{type(e).__name__}: {e}"
    torchao_version = None
    if not args.no_torchao:
        try:
            import torchao
            torchao_version = torchao.__version__
            for which in ("int4", "int8"):
                cands.append(prep(f"torchao {which}", lambda which=which: prep_torchao(deq, which)))
        except Exception as e:  # noqa: BLE001
            unavailable["torchao"] = f"{type(e).__name__}: {str(e)[:200]}"
    if args.step:
        cands.append(prep("tandem forward", lambda: prep_step(args.ctx, max(int(r) for r in args.rows.split(",")))))
    prep_s = time.perf_counter() - t_begin

    # Accuracy on layer 0 (and the LM head): 6 random rows, float64 product of the GGUF weights.
    x6 = {k: torch.randn(6, k, generator=torch.Generator().manual_seed(1)) for k in (576, 1536)}
    acc = {c.name: {k: rel_err(c, k, deq[k][0], x6[1536 if k == "down" else 576]) for k in c.calls} for c in cands
           if c.step is None}
    synth_q40 = None
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize
        w0 = deq["gate_up"][0][:512]
        raw = quantize(w0.numpy(), GGMLQuantizationType.Q4_0)
        synth_q40 = parse_blocks(raw, "Q4_0", *w0.shape)
    except Exception as e:  # noqa: BLE001
        unavailable["Q4_0 grid check"] = str(e)
    grid_src = {"Q4_1": QW("Q4_1", *(t[:512] for t in (srcs["gate_up"][0].q, srcs["gate_up"][0].d,
                                                         srcs["gate_up"][0].m)))}
    if synth_q40 is not None:
        grid_src["Q4_0"] = synth_q40
    lm = srcs["lm_head"][0]
    grid_src["Q8_0"] = QW("Q8_0", lm.q[:4096], lm.d[:4096], None)
    grid = grid_table(grid_src)

    info = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": _cpu_model(), "cores": os.cpu_count(),
        "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
        "MKL_ENABLE_INSTRUCTIONS": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
        "kleidiai": kleidi, "torchao": torchao_version, "default_threads": torch.get_num_threads(),
        "layers": args.layers, "gguf": str(args.gguf), "parse_vs_gguf_dequantize_maxabs": check,
        "prep_s": prep_s,
    }
    print(f"# cpu_quant_kernels — {info['date']}, {info['cpu']} ({info['cores']} cores), torch {info['torch']} "
          f"(dispatch {info['capability']}; ATEN_CPU_CAPABILITY={info['ATEN_CPU_CAPABILITY']}, "
          f"MKL_ENABLE_INSTRUCTIONS={info['MKL_ENABLE_INSTRUCTIONS']}), KleidiAI {kleidi}, torchao "
          f"{torchao_version}, {args.layers} layers + LM head; block parse == gguf.dequantize: {check}")
    for k, v in unavailable.items():
        print(f"- not available: **{k}**: {v}")

    results = []
    for th in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(th)
        for m in (int(r) for r in args.rows.split(",")):
            la0 = os.getloadavg()[0]
            cell = time_cell(cands, m, args.repeats, args.layers, args.cell_budget)
            results.append({"threads": th, "rows": m, "load1": (la0 + os.getloadavg()[0]) / 2, "cands": cell})
            print(f"  measured threads={th} rows={m} (load {la0:.2f})", file=sys.stderr)

    print_tables(cands, results, acc, grid, args.layers)
    print(f"\n(total {time.perf_counter() - t_begin:.0f} s, of which preparing weights {prep_s:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"info": info, "unavailable": unavailable, "results": results,
                                         "accuracy": acc, "grid": grid,
                                         "nbytes": {c.name: c.nbytes for c in cands}}, indent=1))


def _cpu_model() -> str:
    """Model name and the SIMD flags that matter here, from /proc/cpuinfo."""
    name, flags = platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} [{' '.join(simd)}]"


def print_tables(cands: list[Candidate], results: list[dict], acc: dict, grid: list[dict], layers: int) -> None:
    base = "fp32 tandem linear"
    threads = sorted({r["threads"] for r in results}, reverse=True)
    rows = sorted({r["rows"] for r in results})
    cell = {(r["threads"], r["rows"]): r for r in results}

    print(f"\n## Layer set ({layers} layers' qkv/o/gate_up/down + LM head), median ms per pass "
          "(x = speed-up vs fp32 tandem linear's median) [best pass ms, weight GB/s in the best pass]; "
          "† = slow, 2 passes")
    for th in threads:
        loads = ", ".join(f"{cell[(th, m)]['load1']:.2f}" for m in rows)
        print(f"\n### {th} thread(s) — 1-min load average per column: {loads}\n")
        print("| candidate | " + " | ".join(f"{m} row{'s' if m > 1 else ''}" for m in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for c in cands:
            if len(c.calls) != len(ALL_KINDS):
                continue
            vals = []
            for m in rows:
                r = cell[(th, m)]["cands"]
                t, b = r[c.name]["total_ms"], r[base]["total_ms"]
                dag = "†" if r[c.name]["slow"] else ""
                gbs = sum(c.nbytes.values()) / (r[c.name]["total_min_ms"] * 1e6)
                vals.append(f"{t:.1f}{dag} ({b / t:.2f}x) [{r[c.name]['total_min_ms']:.1f}, {gbs:.1f}]")
            print(f"| {c.name} | " + " | ".join(vals) + " |")

    step = next((c for c in cands if c.step is not None), None)
    if step is not None and layers != 30:
        print("\n(projection skipped: it needs all 30 layers in the layer set)")
    elif step is not None:
        print(f"\n## Projection (not a measurement of a quantized engine): tandem's fp32 forward ({step.note}, "
              "timed interleaved with the above) minus the fp32 tandem layer set plus the candidate's layer set. "
              "Projected ms per step (speed-up vs the measured fp32 step)")
        for th in threads:
            print(f"\n### {th} thread(s)\n")
            print("| | " + " | ".join(f"{m} row{'s' if m > 1 else ''}" for m in rows) + " |")
            print("|---|" + "---|" * len(rows))
            meas = {m: cell[(th, m)]["cands"][STEP]["total_ms"] for m in rows}
            other = {m: meas[m] - cell[(th, m)]["cands"][base]["total_ms"] for m in rows}
            print("| measured fp32 step | " + " | ".join(f"{meas[m]:.1f}" for m in rows) + " |")
            print("| of which not in linears + LM head | " + " | ".join(
                f"{other[m]:.1f} ({100 * other[m] / meas[m]:.0f} %)" for m in rows) + " |")
            for c in cands:
                if len(c.calls) != len(ALL_KINDS) or c.name == base or c.grid.get("lm_head") is None:
                    continue
                r = {m: cell[(th, m)]["cands"][c.name]["total_ms"] for m in rows}
                print(f"| {c.name} | " + " | ".join(
                    f"{other[m] + r[m]:.1f} ({meas[m] / (other[m] + r[m]):.2f}x)" for m in rows) + " |")

    print("\n## Per matmul, median µs per call (mean over the layers of one pass)")
    for th in threads:
        print(f"\n### {th} thread(s)\n")
        print("| candidate | rows | " + " | ".join(ALL_KINDS) + " |")
        print("|---|---|" + "---|" * len(ALL_KINDS))
        for c in cands:
            if c.name.endswith("head") or c.step is not None:
                continue
            for m in rows:
                p = cell[(th, m)]["cands"][c.name]["per_us"]
                print(f"| {c.name} | {m} | " + " | ".join(f"{p[k]:.0f}" if k in p else "n/a" for k in ALL_KINDS) + " |")

    print("\n## Weight bytes and accuracy (layer 0 + LM head; relative Frobenius error of a 6-row product "
          "vs the float64 product of the GGUF-dequantized weights)\n")
    print("| candidate | weights MB | bits/weight | grid (Q4_1 layers / Q8_0 head) | rel err layers (max) | "
          "rel err LM head |")
    print("|---|---|---|---|---|---|")
    nparams = None
    for c in cands:
        if c.step is not None:
            continue
        if nparams is None:
            nparams = {k: v // 4 for k, v in c.nbytes.items()}  # fp32 first
        tot = sum(c.nbytes.values())
        npar = sum(nparams[k] for k in c.nbytes)
        lay = [acc[c.name][k] for k in KINDS if k in acc[c.name]]
        head = acc[c.name].get("lm_head")
        g_l = sorted({c.grid[k] for k in KINDS if k in c.grid})
        print(f"| {c.name} | {tot / 1e6:.1f} | {8 * tot / npar:.2f} | {'/'.join(g_l)} / {c.grid.get('lm_head', 'n/a')} | "
              f"{max(lay):.2e} | " + (f"{head:.2e}" if head is not None else "n/a") + " |")
    print("\n(GGUF file: Q4_1 = 5.0 bits/weight, Q8_0 = 8.5 bits/weight.)")

    print("\n## Grid check: can the kernel's weight grid hold the GGUF blocks exactly? "
          "(max |W_kernel − W_gguf| / max |W_gguf|; Q4_1: layer 0 gate_up rows 0–511; Q4_0: the same rows "
          "requantized by gguf.quants; Q8_0: LM head rows 0–4095)\n")
    print("| GGUF | kernel grid | mapping | max rel diff | bit-equal weights |")
    print("|---|---|---|---|---|")
    for g in grid:
        print(f"| {g['format']} | {g['grid']} | {g['mapping']} | {g['max_rel']:.1e} | {100 * g['bit_equal']:.2f} % |")


if __name__ == "__main__":
    main()
