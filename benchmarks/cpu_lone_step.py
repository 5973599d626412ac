#!/usr/bin/env python
"""One batch-1 CPU step, eager vs scripted (``worker/lone_decode.py``), alternating in one process.

The built-in SmolLM2-135M Q4_1 GGUF (packed int4, defaults); a prompt of ``--ctx`` tokens is
prefilled once, then a step of 1 (decode) and of k + 1 rows (verify) at that position is run with
``TorchRunner``'s scripted path off and on, alternately (the KV rewritten is the same each time), and
the median per path is printed with the load average. Also checks the two paths' logits are equal.
A third column times the scripted step for argmax-only rows (greedy), where the screened LM head
(``models/quant/screened_head.py``) replaces the float32 one, and checks its argmax is the same.

Usage: python benchmarks/cpu_lone_step.py [--ctx 200] [--rows 1,2,4,5] [--reps 25] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--rows", default="1,2,4,5")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from tandem import LLM
    from tandem.worker.batch import SeqChunk

    runner = LLM("smollm2-135m-instruct", device="cpu").engine.runner
    ctx, bs = args.ctx, runner.block_size
    blocks = list(range(-(-(ctx + 16) // bs)))
    runner.forward_logits([SeqChunk([(7 * j) % 5000 + 100 for j in range(ctx)], 0, blocks)], [ctx - 1])
    runner.forward_logits([SeqChunk([5], ctx, blocks)], [0])
    lone = runner._lone
    if not lone:
        raise SystemExit("the scripted step does not apply to this model / runner")
    sizes = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.reps):
        for t in sizes:
            step, rows = [SeqChunk(list(range(5, 5 + t)), ctx, blocks)], list(range(t))
            got = {}
            for name, val in (("eager", False), ("scripted", lone)):
                runner._lone = val
                t0 = time.perf_counter()
                got[name] = runner.forward_logits(step, rows)
                times.setdefault((t, name), []).append(time.perf_counter() - t0)
            assert torch.equal(got["eager"], got["scripted"]), f"{t} rows: logits differ"
            t0 = time.perf_counter()
            argmax = runner.forward_logits(step, rows, argmax_only=True)
            times.setdefault((t, "screened"), []).append(time.perf_counter() - t0)
            assert torch.equal(argmax.argmax(-1), got["scripted"].argmax(-1)), f"{t} rows: argmax differs"
    print(f"# SmolLM2 GGUF, context {ctx}, {args.threads} threads, median of {args.reps}; "
          f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| rows | eager ms | scripted ms | eager / scripted | scripted, argmax rows (screened head) ms |")
    print("|---|---|---|---|---|")
    for t in sizes:
        e, s, a = (statistics.median(times[(t, n)]) for n in ("eager", "scripted", "screened"))
        print(f"| {t} | {1e3 * e:.2f} | {1e3 * s:.2f} | {e / s:.2f}× | {1e3 * a:.2f} |")


if __name__ == "__main__":
    main()
