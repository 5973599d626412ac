"""An EAGLE head's eager catch-up steps on CUDA: the rows each took and its host / host + device time.

A head the policy leaves idle catches up over every position it skipped when it next drafts (an
exploration), and every request's first proposal catches up over its prompt; such steps are longer
than the head's graphs (8 rows) and run eagerly. Runs the real SmolLM2 target with the shipped EAGLE-3
head and the default policy over HumanEval prompts, wraps ``GpuHeadRunner._forward_eager`` (synchronised
before and after; cProfile of those calls with ``--cprofile``) and prints one row per eager step.
``--no-pad``: without ``eager_pad`` (every row count its own cuBLAS shape, as before docs/performance.md
§51: 2.6-9.8 ms for catch-ups of 65-289 rows on an H100, 2.2-2.8 ms padded, profiler on).

    PYTHONPATH=. python benchmarks/gpu_head_catchup.py --humaneval HumanEval.jsonl.gz [--no-pad] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import tandem.worker.gpu_head_runner as g
    from eagle_bench import timed
    from tandem import LLM
    from tandem.bench.datasets import load_humaneval_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--humaneval", default=None, help="HumanEval.jsonl(.gz) (default: the package's)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--no-pad", action="store_true", help="eager steps unpadded (the shapes before §51)")
    ap.add_argument("--cprofile", action="store_true", help="profile the eager steps (inflates their host time)")
    args = ap.parse_args()
    if args.no_pad:
        g.eager_pad = lambda qlens: None
    rec: list[tuple[int, int, bool, float, float]] = []
    prof = cProfile.Profile()
    orig = g.GpuHeadRunner._forward_eager

    def wrapped(self, chunks, qlens, rows, hidden, token_ids, chain=None):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if args.cprofile:
            prof.enable()
        out = orig(self, chunks, qlens, rows, hidden, token_ids, chain)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if args.cprofile:
            prof.disable()
        rec.append((sum(qlens), len(chunks), hidden is None, (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
        return out

    g.GpuHeadRunner._forward_eager = wrapped
    spec = {"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": args.k}
    llm = LLM("smollm2-135m-instruct", speculative_config=spec, kv_cache_memory_bytes=1 << 30)
    for p in load_humaneval_prompts(args.humaneval)[: args.num_prompts]:
        timed(llm, p, args.max_tokens)
    print(f"{torch.cuda.get_device_name(0)}, padded: {not args.no_pad}, cProfile: {args.cprofile}")
    print("| rows | requests | from the features | host ms | host + device ms |")
    print("|---|---|---|---|---|")
    for rows, n, feats, host, total in rec:
        print(f"| {rows} | {n} | {feats} | {host:.2f} | {total:.2f} |")
    if args.cprofile:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
        print(s.getvalue())


if __name__ == "__main__":
    main()
