#!/usr/bin/env python
"""One-row float32 matmuls on CPU: why tandem splits a GEMV into a small batched matmul.

SmolLM2-135M's per-layer weight shapes (30 layers, distinct tensors so every call reads cold memory)
plus the LM head, multiplied by one activation row, four ways: ``F.linear``, ``W @ x^T``, ``torch.mv``,
and ``torch.bmm`` over W split row-wise into 4 blocks (what ``tandem.models.layers.linear`` does for
one row). MKL runs a GEMV on one thread; the batched form spreads over the intra-op threads.
Prints the median time for all of them (one "token's" worth of matmuls) and the implied GB/s.

Usage: python benchmarks/cpu_gemv_split.py [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(2 * 1536, 576), (576, 1536), (576 + 2 * 192, 576), (576, 576)]  # gate_up, down, qkv, o
LAYERS = 30
VOCAB = 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [[torch.randn(o, i) for (o, i) in SHAPES] for _ in range(LAYERS)] + [[torch.randn(VOCAB, 576)]]
    nbytes = sum(w.numel() * 4 for ws in weights for w in ws)
    xs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}

    def split_bmm(x: torch.Tensor, w: torch.Tensor, parts: int = 4) -> torch.Tensor:
        o, i = w.shape
        return torch.bmm(w.view(parts, o // parts, i), x.t().unsqueeze(0).expand(parts, i, 1)).view(1, o)

    variants = {
        "F.linear": lambda x, w: F.linear(x, w),
        "W @ x^T": lambda x, w: w @ x.t(),
        "torch.mv": lambda x, w: torch.mv(w, x[0]),
        "bmm, W split in 4": split_bmm,
    }
    print(f"{nbytes / 1e6:.1f} MB of float32 weights per pass; torch {torch.__version__}")
    print("| threads | variant | ms per pass (median) | GB/s |\n|---|---|---|---|")
    for th in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(th)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats + 1):  # interleaved; the first round is a warm-up
            for name, fn in variants.items():
                t0 = time.perf_counter()
                for ws in weights:
                    for w in ws:
                        fn(xs[w.shape[1]], w)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            med = statistics.median(ts[1:])
            print(f"| {th} | {name} | {med * 1e3:.1f} | {nbytes / med / 1e9:.1f} |")


if __name__ == "__main__":
    main()
