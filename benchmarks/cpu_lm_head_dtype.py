#!/usr/bin/env python
"""The LM head's dtype on CPU (``lm_head_dtype``): how often greedy output changes, and the speed.

Two engines in one process on the built-in SmolLM2-135M GGUF (packed, the CPU default): ``auto``
(float32 head, the reference) and ``float16``. Every HumanEval prompt of the first ``--num-prompts``
runs through both, alternating which goes first, each generating exactly ``--max-tokens`` tokens
greedily (``ignore_eos``). Printed: requests whose output is identical token for token, the first
divergence position of the others, the share of all generated tokens before the first divergence,
and tokens/s of each engine (generate time, prefill included).

Usage: python benchmarks/cpu_lm_head_dtype.py [--num-prompts 20] [--max-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import fmt_load, loadavg, machine_info

    from tandem import LLM, SamplingParams
    from tandem.bench.datasets import load_humaneval_prompts

    info, la0 = machine_info(), loadavg()
    names = ("auto", "float16")
    engines = {n: LLM(MODEL, device="cpu", lm_head_dtype=n) for n in names}
    warm = SamplingParams(temperature=0, max_tokens=4)
    for e in engines.values():
        e.generate(["Hello"], warm, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    secs = dict.fromkeys(names, 0.0)
    outs: dict[str, list[list[int]]] = {n: [] for n in names}
    for i, p in enumerate(load_humaneval_prompts()[:args.num_prompts]):
        for n in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            out = engines[n].generate([p], params, use_tqdm=False)[0].outputs[0]
            secs[n] += time.perf_counter() - t0
            outs[n].append(list(out.token_ids))
    divergences = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                   for a, b in zip(outs["auto"], outs["float16"])]
    same = sum(d is None for d in divergences)
    agreed = sum(args.max_tokens if d is None else d for d in divergences)
    total = args.max_tokens * args.num_prompts
    print(f"# lm_head_dtype auto vs float16, {MODEL} GGUF packed, {args.num_prompts} HumanEval prompts × "
          f"{args.max_tokens} greedy tokens, {args.threads} threads")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; cpus {info['cpus']}, torch {info['torch']}; "
          f"load average before {fmt_load(la0)}, after {fmt_load(loadavg())}; "
          f"peak RSS (both engines) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    print()
    print("| lm_head_dtype | tok/s | identical outputs | first divergences | tokens before the first divergence |")
    print("|---|---|---|---|---|")
    div = ", ".join(str(d) for d in divergences if d is not None) or "-"
    for n in names:
        agree = "reference" if n == "auto" else f"{same}/{args.num_prompts}"
        share = "reference" if n == "auto" else f"{agreed}/{total} ({100 * agreed / total:.1f}%)"
        print(f"| {n} | {total / secs[n]:.1f} | {agree} | {div if n != 'auto' else '-'} | {share} |")


if __name__ == "__main__":
    main()
