#!/usr/bin/env python
"""Skinny matmuls on the GPU: tandem's Triton ``gemv`` (plain and fused variants) vs cuBLAS.

For the decoder matmul shapes of Llama-3.1-8B, Llama-3.2-1B and SmolLM2-135M and M = 1..16 rows,
prints µs per call and the weight-read bandwidth (weights bytes / time), each timed as a CUDA
graph of back-to-back calls that cycle through enough weight copies (> 4 × L2) to be cold, median of
several replays. Also checks every variant against a float32 reference (relative error).

For 2+ rows the per-row kernel runs one program per row and column block (each row computed exactly
as a 1-row product); the "tensor cores" column is ``triton_dot.py``'s kernel (``dot=True``: weight rows
× 16-row tiles of x, split-K; at 1 row as batch-invariant mode runs it). ``--sweep-rows 1,4`` tries a
grid of (BLOCK_N, BLOCK_K, num_warps) for the per-row kernel at those row counts and prints the best
per shape (how ``triton_gemv.gemv_config`` was set); ``--sweep-dot-rows 16`` tries a grid of (BLOCK_N,
BLOCK_K, num_warps, num_stages, SPLIT) for the tensor-core kernel with each shape's fusion (how
``triton_dot.dot_config`` was set), compiled first in ``--compile-workers`` processes.
``--models 8B,SmolLM2`` picks the shapes. ``--sweep-small 1,4,5,6`` times a grid of (BLOCK_N, BLOCK_K,
num_warps, deferred reduction) for the per-row kernel with each shape's fusion at all of those row
counts (a config is the same at every row count, so verify rows stay bitwise their decode) and prints
the best by the sum over the row counts, the best at the first row count, and the default.

Usage: python benchmarks/gpu_gemv.py [--sweep-rows 1,4] [--sweep-dot-rows 16] [--rows 1,2,4,8,16] [--models 8B]
       [--sweep-small 1,4,5,6]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (hidden, intermediate, q_size + 2 * kv_size)
    "8B": (4096, 14336, 4096 + 2 * 1024),
    "1B": (2048, 8192, 2048 + 2 * 512),
    "SmolLM2": (576, 1536, 576 + 2 * 192),
}


def timed(fn, calls: int, reps: int = 7) -> float:  # type: ignore[no-untyped-def]
    """Median µs per call of ``fn(i)`` for i in range(calls), captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def sweep(make, configs, calls: int) -> list[tuple[float, tuple[int, int, int]]]:  # type: ignore[no-untyped-def]
    """(µs, config) for each (BLOCK_N, BLOCK_K, num_warps) config, fastest first; ``make(config)`` is
    the per-call function ``timed`` captures. Configs that do not compile are reported and skipped."""
    best = []
    for cfg in configs:
        try:
            best.append((timed(make(cfg), calls, reps=3), cfg))
        except Exception as e:  # noqa: BLE001 - a config may not compile
            print("   cfg", cfg, "failed:", type(e).__name__)
    return sorted(best)


def dot_grid(k: int) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT) configs tried for the tensor-core kernel."""
    if k <= 2048:
        grid = itertools.product((16, 32, 64, 128), (64, 128), (4,), (2, 3, 4), (1, 2, 4))
    else:
        grid = itertools.product((64, 128), (128, 256), (4,), (3, 4), (1, 2, 4, 8))
    # shared memory: num_stages copies of the weight tile and x's tile (H200: 227 KiB a block)
    return [c for c in grid if c[1] * c[4] <= k and c[3] * (c[0] + 16) * c[1] * 2 <= 220_000]


def _fusion_kw(fusion: str, nw: torch.Tensor, res: torch.Tensor) -> dict:  # type: ignore[type-arg]
    return {"norm": dict(norm_weight=nw, eps=1e-5), "norm_gated": dict(norm_weight=nw, eps=1e-5, gated=True),
            "res": dict(residual=res)}[fusion]


def _compile(job: tuple[int, int, str, int, list[tuple[int, int, int, int, int]]]) -> int:
    """Worker: compile the tensor-core kernel for these configs (one launch each) into Triton's cache."""
    from tandem.worker.triton_gemv import gemv

    n, k, fusion, m, configs = job
    dev, dt = torch.device("cuda"), torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=dt)
    x = torch.randn(m, k, device=dev, dtype=dt)
    kw = _fusion_kw(fusion, torch.ones(k, device=dev, dtype=dt),
                    torch.zeros(m, n // 2 if fusion == "norm_gated" else n, device=dev, dtype=dt))
    done = 0
    for cfg in configs:
        try:
            if len(cfg) == 4:  # per-row kernel: (BLOCK_N, BLOCK_K, num_warps, defer)
                gemv(x, w, config=cfg[:3], defer=bool(cfg[3]), **kw)
            else:
                gemv(x, w, config=cfg, dot=True, **kw)
            done += 1
        except Exception:  # noqa: BLE001 - reported when timed
            pass
    torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple[int, int, str, int, list[tuple[int, int, int, int, int]]]], workers: int) -> None:
    import multiprocessing as mp

    chunks = [(n, k, f, m, cfgs[i::workers]) for n, k, f, m, cfgs in jobs for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        print(f"precompiled {sum(pool.map(_compile, chunks))} kernels in {workers} processes", flush=True)


SMALL_GRID = [(bn, bk, w, d) for bn in (4, 8, 16, 32) for bk in (64, 128, 256, 1024) for w in (2, 4, 8)
              for d in (0, 1) if bn * bk <= 16384]


def sweep_small(name: str, mat: str, n: int, k: int, fusion: str, rows: list[int]) -> tuple[int, int, int, int]:
    """Per-row kernel configs timed at every row count in ``rows`` (cold weights, one graph per config)."""
    from tandem.worker.triton_gemv import SHAPE_CONFIGS, gemv, gemv_config

    dev, dt = torch.device("cuda"), torch.bfloat16
    copies = max(2, -(-400_000_000 // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
    nw = torch.rand(k, device=dev, dtype=dt) + 0.5
    n_out = n // 2 if fusion == "norm_gated" else n
    xs = {m: torch.randn(m, k, device=dev, dtype=dt) for m in rows}
    kws = {m: _fusion_kw(fusion, nw, torch.randn(m, n_out, device=dev, dtype=dt)) for m in rows}
    table = []
    default = None
    for cfg in [None] + SMALL_GRID:
        try:
            times = [timed(lambda i, m=m: gemv(xs[m], ws[i % copies], config=cfg and cfg[:3],
                                                defer=None if cfg is None else bool(cfg[3]), **kws[m]), copies * 2, reps=3)
                     for m in rows]
        except Exception as e:  # noqa: BLE001 - a config may not compile
            print("   cfg", cfg, "failed:", type(e).__name__)
            continue
        if cfg is None:
            default = times
        else:
            table.append((sum(times), times, cfg))
    table.sort()
    fmt = lambda ts: " / ".join(f"{t:.2f}" for t in ts)  # noqa: E731
    cfg0 = SHAPE_CONFIGS.get((n, k, fusion.replace("_", "+"))) or gemv_config(1, n, k)
    print(f"{name} {mat} {n}x{k} ({fusion}) rows {rows}: default {cfg0} {fmt(default)} (sum {sum(default):.2f})")
    for tot, ts, cfg in table[:4]:
        print(f"   best sum {cfg}: {fmt(ts)} (sum {tot:.2f})")
    tot, ts, cfg = min(table, key=lambda r: r[1][0])
    print(f"   best at {rows[0]} row(s) {cfg}: {fmt(ts)} (sum {tot:.2f})", flush=True)
    return table[0][2]


def main() -> None:
    from tandem.worker.triton_dot import dot_config
    from tandem.worker.triton_gemv import gemv, gemv_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--sweep-rows", default="", help="row counts to sweep block configs for, e.g. 1,4")
    ap.add_argument("--sweep-dot-rows", default="", help="row counts to sweep the tensor-core (dot=True) "
                    "configs for, e.g. 16")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--compile-workers", type=int, default=12)
    ap.add_argument("--sweep-small", default="", help="row counts to sweep per-row configs over jointly, e.g. 1,4,5,6")
    ap.add_argument("--small-json", type=Path, default=None, help="--sweep-small: write the best-sum configs here")
    args = ap.parse_args()
    small_rows = [int(r) for r in args.sweep_small.split(",") if r]
    dev = torch.device("cuda")
    dt = torch.bfloat16
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    sweep_dot_rows = {int(r) for r in args.sweep_dot_rows.split(",") if r}
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    results = []
    models = {name: SHAPES[name] for name in args.models.split(",")}

    def matmuls(hid: int, inter: int, qkv: int) -> dict[str, tuple[int, int, str]]:
        return {"qkv": (qkv, hid, "norm"), "o": (hid, hid, "res"), "gate_up": (2 * inter, hid, "norm_gated"),
                "down": (hid, inter, "res")}

    if sweep_dot_rows and args.compile_workers > 1:
        precompile([(n, k, f, m, dot_grid(k)) for hid, inter, qkv in models.values()
                    for n, k, f in matmuls(hid, inter, qkv).values() for m in sorted(sweep_dot_rows)],
                   args.compile_workers)
    if small_rows:
        if args.compile_workers > 1:
            precompile([(n, k, f, 1, SMALL_GRID) for hid, inter, qkv in models.values()
                        for n, k, f in matmuls(hid, inter, qkv).values()], args.compile_workers)
        best = [[n, k, fusion, sweep_small(name, mat, n, k, fusion, small_rows)]
                for name, (hid, inter, qkv) in models.items() for mat, (n, k, fusion) in matmuls(hid, inter, qkv).items()]
        if args.small_json:  # what benchmarks/gpu_step_kernels.py --gemv-configs reads
            args.small_json.write_text(json.dumps(best))
        return
    for name, (hid, inter, qkv) in models.items():
        mats = matmuls(hid, inter, qkv)
        for mat, (n, k, fusion) in mats.items():
            nbytes = n * k * 2
            copies = max(2, -(-400_000_000 // nbytes))
            ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
            nw = torch.rand(k, device=dev, dtype=dt) + 0.5
            n_out = n // 2 if fusion == "norm_gated" else n
            for m in rows_list:
                x = torch.randn(m, k, device=dev, dtype=dt)
                res = torch.randn(m, n_out, device=dev, dtype=dt)
                # correctness of the fused variant against the unfused float32 math
                xf = x.float()
                if fusion.startswith("norm"):
                    xf = ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt).float()
                          * nw.float()).to(dt).float()
                ref = xf @ ws[0].float().T
                if fusion == "norm_gated":
                    ref = F.silu(ref[:, :n_out]) * ref[:, n_out:]
                    got = gemv(x, ws[0], norm_weight=nw, eps=1e-5, gated=True).float()
                elif fusion == "norm":
                    got = gemv(x, ws[0], norm_weight=nw, eps=1e-5).float()
                else:
                    ref = res.float() + ref.to(dt).float()
                    got = gemv(x, ws[0], residual=res.clone()).float()
                err = ((got - ref).norm() / ref.norm()).item()
                got = gemv(x, ws[0], dot=True, invariant=True, **_fusion_kw(fusion, nw, res.clone())).float()
                err_dot = ((got - ref).norm() / ref.norm()).item()
                cu = timed(lambda i: F.linear(x, ws[i % copies]), copies * 2)
                plain = timed(lambda i: gemv(x, ws[i % copies]), copies * 2)
                kw = _fusion_kw(fusion, nw, res)
                fused = timed(lambda i: gemv(x, ws[i % copies], **kw), copies * 2)
                dot = timed(lambda i: gemv(x, ws[i % copies], dot=True, invariant=True, **kw), copies * 2)
                row = dict(model=name, mat=mat, n=n, k=k, m=m, cublas_us=cu, gemv_us=plain, fused_us=fused,
                           fused_dot_us=dot, fusion=fusion, rel_err=err, rel_err_dot=err_dot, cfg=gemv_config(m, n, k),
                           dot_cfg=dot_config(n, k))
                results.append(row)
                print(f"{name:8s} {mat:8s} N={n:6d} K={k:6d} M={m:2d}: cuBLAS {cu:8.2f} µs "
                      f"({nbytes / cu / 1e6:5.2f} TB/s) | gemv {plain:8.2f} µs ({nbytes / plain / 1e6:5.2f} TB/s) "
                      f"| gemv+{fusion} {fused:8.2f} µs (tensor cores {dot:8.2f}) | rel err {err:.1e} / {err_dot:.1e} | "
                      f"cfg {row['cfg']} / {row['dot_cfg']}", flush=True)
                if m in sweep_rows and name != "SmolLM2":
                    grid = [c for c in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8))
                            if c[1] <= k * 2 and c[0] * c[1] <= 32768]
                    best = sweep(lambda cfg: lambda i: gemv(x, ws[i % copies], config=cfg), grid, copies * 2)
                    print("   sweep best:", ", ".join(f"{c} {u:.2f} µs ({nbytes / u / 1e6:.2f} TB/s)"
                                                    for u, c in best[:4]), flush=True)
                if m in sweep_dot_rows:
                    best = sweep(lambda cfg: lambda i: gemv(x, ws[i % copies], config=cfg, dot=True, **kw),
                                 dot_grid(k), copies * 2)
                    print(f"   dot sweep best (cuBLAS {cu:.2f} µs, committed {dot:.2f}):", ", ".join(
                        f"{c} {u:.2f} µs ({nbytes / u / 1e6:.2f} TB/s)" for u, c in best[:5]), flush=True)
            ws = []  # free the copies before the next shape
            torch.cuda.empty_cache()
    print("\n| model | matmul | M | cuBLAS µs | gemv µs | fused µs (what) | fused, tensor cores µs | gemv TB/s | rel err (per row / tensor cores) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['mat']} {r['n']}x{r['k']} | {r['m']} | {r['cublas_us']:.2f} | {r['gemv_us']:.2f} | "
              f"{r['fused_us']:.2f} ({r['fusion']}) | {r['fused_dot_us']:.2f} | {r['n'] * r['k'] * 2 / r['gemv_us'] / 1e6:.2f} | "
              f"{r['rel_err']:.1e} / {r['rel_err_dot']:.1e} |")


if __name__ == "__main__":
    main()
