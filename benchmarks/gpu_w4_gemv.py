#!/usr/bin/env python
"""Int4 skinny matmuls on the GPU: tandem's W4 kernel vs the bf16 ``gemv`` and cuBLAS (issue #17).

For the decoder matmul shapes of Llama-3.1-8B, Llama-3.2-1B and SmolLM2-135M with int4 weights in
asymmetric groups of 128 (``W4Weight``: 0.53 bytes per weight with bf16 scales and offsets), each with
the fusion a decode step runs it with (qkv: RMSNorm; o, down: residual add; gate_up: RMSNorm +
silu·mul over [gate | up]), rows M ∈ --rows: µs per call and the fraction of the copy bandwidth
(--bw, default: measured on this card by a 1 GiB copy) that the packed bytes read in that time would be — the
int4 floor — each timed as a CUDA graph cycling through enough weight copies to be cold
(``gpu_gemv.timed``). ``--sweep-rows 1`` also times a grid of ``triton_w4.W4Config`` (warps, split)
per shape and prints the best four (how ``w4_config`` was set). Checks each W4 result against the
float32 product with the weight its codes describe (relative error; bf16 output rounding is ~2e-3).

Usage: python benchmarks/gpu_w4_gemv.py [--rows 1,4,8,16] [--sweep-rows 1] [--models 8B]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gemv import SHAPES, sweep, timed  # noqa: E402

FUSION = {"qkv": "norm", "o": "res", "gate_up": "norm+gated", "down": "res"}


def main() -> None:
    from tandem.models.quant.w4_weight import W4Weight
    from tandem.models.quant.weights import quantize_float
    from tandem.worker import triton_w4
    from tandem.worker.triton_gemv import gemv

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--sweep-rows", default="")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated SHAPES names measured")
    ap.add_argument("--sweep-grid", default="[(w, s) for w in (2, 4, 8) for s in (1, 2, 4, 8, 16, 32)]",
                    help="python list of (warps, split) swept")
    ap.add_argument("--bw", type=float, default=0.0, help="copy bandwidth, bytes/s (the floor); 0: measured here")
    ap.add_argument("--json", default="", help="write the table here")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    if not args.bw:
        from _common import copy_bandwidth
        args.bw = copy_bandwidth(1 << 30, repeats=10, device="cuda")["median_GBps"] * 1e9
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, group {args.group}, "
          f"copy bandwidth {args.bw / 1e9:.0f} GB/s (the floor's)")
    table = []
    for name, (hid, inter, qkv) in SHAPES.items():
        if name not in args.models.split(","):
            continue
        for mat, (n, k) in {"qkv": (qkv, hid), "o": (hid, hid), "gate_up": (2 * inter, hid),
                            "down": (hid, inter)}.items():
            fusion = FUSION[mat]
            gated = "gated" in fusion
            group = next(g for g in (args.group, 64, 32, 16) if k % g == 0)  # SmolLM2's K = 576: 64
            one = W4Weight.pack(quantize_float(torch.randn(n, k, device=dev) / k ** 0.5, 4, group, False, "b"),
                                dt, dev)
            w4_bytes, bf_bytes = one.nbytes(), n * k * 2
            copies = max(2, -(-400_000_000 // w4_bytes))
            w4s = [one] + [W4Weight(torch.randint(-2 ** 31, 2 ** 31 - 1, one.qweight.shape, device=dev,
                                                  dtype=torch.int32), one.scale.clone(), one.offset.clone(),
                                    one.group, one.k) for _ in range(copies - 1)]
            kg = k // one.group
            wexact = (one.codes().float().view(n, kg, one.group) * one.scale[:, :kg, None].float()
                      + one.offset[:, :kg, None].float()).view(n, k)
            bcopies = max(2, -(-400_000_000 // bf_bytes))
            wbf = [one.dequantize()] + [torch.randn(n, k, device=dev, dtype=dt) for _ in range(bcopies - 1)]
            nw = (torch.rand(k, device=dev) + 0.5).to(dt)
            for m in rows_list:
                x = torch.randn(m, k, device=dev, dtype=dt)
                res = torch.randn(m, n // 2 if gated else n, device=dev, dtype=dt)

                def call(w, cfg=None, x=x, res=res):  # type: ignore[no-untyped-def]
                    if fusion == "res":
                        return gemv(x, w, residual=res, config=cfg)
                    return gemv(x, w, norm_weight=nw, eps=1e-5, gated=gated, config=cfg)

                xf = x.float()
                h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float()
                if fusion == "res":
                    r0 = res.clone()
                    want = r0.float() + xf @ wexact.T
                    call(one)
                    got = res.float()
                    res.copy_(r0)
                else:
                    want = (F.silu(h @ wexact[:n // 2].T) * (h @ wexact[n // 2:].T) if gated else h @ wexact.T)
                    got = call(one).float()
                err = float((got - want).norm() / want.norm())
                cu = timed(lambda i: F.linear(x, wbf[i % bcopies]), bcopies * 2)
                g16 = timed(lambda i: call(wbf[i % bcopies]), bcopies * 2)
                g4 = timed(lambda i: call(w4s[i % copies]), copies * 2)
                cfg = triton_w4.w4_config(n, k, one.group, gated)
                row = dict(model=name, mat=mat, n=n, k=k, m=m, cublas=cu, gemv_bf16=g16, gemv_w4=g4,
                           floor_frac=w4_bytes / args.bw / (g4 * 1e-6), err=err, cfg=tuple(cfg))
                table.append(row)
                print(f"{name:8s} {mat:8s} {n:6d}x{k:6d} M={m:2d}: cuBLAS bf16 {cu:7.2f} µs | gemv bf16 {g16:7.2f} µs | "
                      f"W4 {g4:7.2f} µs = {row['floor_frac']:.1%} of the int4 floor | rel err {err:.1e} | {tuple(cfg)}",
                      flush=True)
                if m in sweep_rows:
                    grid = eval(args.sweep_grid)  # noqa: S307 - a list literal from the command line
                    best = sweep(lambda c: lambda i: call(w4s[i % copies], c), grid, copies * 2)
                    row["sweep"] = [(round(u, 2), c) for u, c in best]
                    print("   sweep best:", ", ".join(f"{c} {u:.2f} µs ({w4_bytes / args.bw / (u * 1e-6):.1%})"
                                                      for u, c in best[:4]), flush=True)
            w4s, wbf = [], []  # free the copies before the next shape
            torch.cuda.empty_cache()
    print("\n| model | matmul (fusion) | M | cuBLAS bf16 µs | gemv bf16 µs | W4 µs | W4 % of int4 floor | config | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['model']} | {r['mat']} {r['n']}x{r['k']} ({FUSION[r['mat']]}) | {r['m']} | {r['cublas']:.2f} | "
              f"{r['gemv_bf16']:.2f} | {r['gemv_w4']:.2f} | {r['floor_frac']:.1%} | {r['cfg']} | {r['err']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
