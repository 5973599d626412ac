#!/usr/bin/env python
"""Int4 skinny matmuls on the GPU: tandem's W4 ``gemv`` vs the bf16 ``gemv`` and cuBLAS (issue #17).

For the decoder matmul shapes of Llama-3.1-8B, Llama-3.2-1B and SmolLM2-135M with int4 weights in
asymmetric groups of 128 (``W4Weight``: 0.53 bytes per weight with bf16 scales and offsets), rows
M ∈ --rows: µs per call and the fraction of the copy bandwidth (4.26 TB/s measured on the H200) that
the packed bytes read in that time would be — the int4 floor — each timed as a CUDA graph cycling
through enough weight copies to be cold (``gpu_gemv.timed``). ``--sweep-rows 1,4`` tries a grid of
(BLOCK_N, runs per K step, num_warps, num_stages, SPLIT) per shape at those row counts and prints the
best four of each kernel (4-tuples: the per-row kernel; how to tune ``triton_w4.w4_config`` and
``row_config``; ``--sweep-out`` keeps every result). Each row count also times the tensor-core
kernel (as batch-invariant mode runs it) and, up to 4 rows, the per-row kernel. Checks each W4
result against the float32 product with the weight its codes describe (relative error; bf16 output
rounding is ~2e-3).

Usage: python benchmarks/gpu_w4_gemv.py [--rows 1,4,16] [--sweep-rows 1] [--models 8B]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gemv import SHAPES, sweep, timed  # noqa: E402

COPY_BW = 4.26e12  # bytes/s, H200 device-to-device copy, measured 2026-11-30 (gpu_suite.py)


def main() -> None:
    from tandem.models.quant.w4_weight import W4Weight
    from tandem.models.quant.weights import quantize_float
    from tandem.worker.triton_gemv import gemv
    from tandem.worker import triton_w4

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--sweep-rows", default="")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--sweep-models", default="8B", help="comma-separated SHAPES names swept (each config compiles)")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated SHAPES names measured")
    ap.add_argument("--sweep-grid", default="",
                    help="python list of configs to sweep (default: a grid around w4_config)")
    ap.add_argument("--sweep-out", default="", help="append every sweep result here (JSON lines)")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, group {args.group}")
    table = []
    for name, (hid, inter, qkv) in SHAPES.items():
        if name not in args.models.split(","):
            continue
        for mat, (n, k) in {"qkv": (qkv, hid), "o": (hid, hid), "gate_up": (2 * inter, hid),
                            "down": (hid, inter)}.items():
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
            for m in rows_list:
                x = torch.randn(m, k, device=dev, dtype=dt)
                want = x.float() @ wexact.T
                err = float((gemv(x, one).float() - want).norm() / want.norm())
                cu = timed(lambda i: F.linear(x, wbf[i % bcopies]), bcopies * 2)
                g16 = timed(lambda i: gemv(x, wbf[i % bcopies], dot=m > 16), bcopies * 2)
                g4 = timed(lambda i: gemv(x, w4s[i % copies]), copies * 2)
                tc = timed(lambda i: gemv(x, w4s[i % copies], invariant=True), copies * 2)  # the tensor-core kernel
                rowk = (timed(lambda i: gemv(x, w4s[i % copies], config=triton_w4.row_config(n, k)), copies * 2)
                        if m <= 4 else float("nan"))  # the per-row kernel
                row = dict(model=name, mat=mat, n=n, k=k, m=m, cublas=cu, gemv_bf16=g16, gemv_w4=g4, tc=tc, rowk=rowk,
                           floor_frac=w4_bytes / COPY_BW / (g4 * 1e-6), err=err, cfg=triton_w4.w4_config(n, k))
                table.append(row)
                print(f"{name:8s} {mat:8s} {n:6d}x{k:6d} M={m:2d}: cuBLAS bf16 {cu:7.2f} µs | gemv bf16 {g16:7.2f} µs | "
                      f"gemv W4 {g4:7.2f} µs = {row['floor_frac']:.1%} of the int4 floor (tensor cores {tc:.2f}, per row {rowk:.2f}) | rel err {err:.1e} | {row['cfg']}", flush=True)
                if m in sweep_rows and name in args.sweep_models.split(","):
                    base = triton_w4.w4_config(n, k)
                    if args.sweep_grid:
                        grid = eval(args.sweep_grid)  # noqa: S307 - a list literal from the command line
                    else:  # tensor-core configs (5-tuples) around the default, then per-row ones (4-tuples)
                        sp = base[4]
                        grid = sorted({(bn, rb, wp, 3, s2) for bn in (64, 128) for rb in (1, 2, 4) for wp in (4, 8)
                                       for s2 in {max(1, sp // 2), sp, sp * 2} if bn == 128 or wp == 4}
                                      | {(128, 1, 4, 2, sp), (128, 1, 4, 4, sp), (128, 2, 4, 4, sp), (64, 2, 4, 4, sp),
                                         (64, 4, 4, 2, sp)})
                        if m <= 2:
                            grid += [(bn, rb, wp, 3) for bn in (8, 16) for rb in (4, 8) for wp in (4, 8)]
                    best = sweep(lambda cfg: lambda i: gemv(x, w4s[i % copies], config=cfg), grid, copies * 2)
                    if args.sweep_out:
                        with open(args.sweep_out, "a") as f:
                            f.write(json.dumps(dict(model=name, mat=mat, n=n, k=k, m=m, results=best)) + "\n")
                    for kind in (5, 4):
                        print(f"   sweep best ({'tensor cores' if kind == 5 else 'per row'}):",
                              ", ".join(f"{c} {u:.2f} µs ({w4_bytes / COPY_BW / (u * 1e-6):.1%})"
                                        for u, c in [b for b in best if len(b[1]) == kind][:4]), flush=True)
            w4s, wbf = [], []  # free the copies before the next shape
            torch.cuda.empty_cache()
    print("\n| model | matmul | M | cuBLAS bf16 µs | gemv bf16 µs | gemv W4 µs | W4 % of int4 floor | W4 tensor-core kernel µs | W4 per-row kernel µs | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['model']} | {r['mat']} {r['n']}x{r['k']} | {r['m']} | {r['cublas']:.2f} | {r['gemv_bf16']:.2f} | "
              f"{r['gemv_w4']:.2f} | {r['floor_frac']:.1%} | {r['tc']:.2f} | {r['rowk']:.2f} | {r['err']:.1e} |")


if __name__ == "__main__":
    main()
