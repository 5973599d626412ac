#!/usr/bin/env python
"""Sampled chat at batch 1 (or `--batch`): what a speculating engine costs when it (almost) never drafts.

One engine per method in one process (baseline, n-gram k = 4 and EAGLE-3 k = 3 with the shipped
head, the goodput policy at its default), the same ShareGPT first turns through the chat template,
one request at a time at ``--temperature`` (seeded), ``--rounds`` rounds with the methods
alternating; the last round runs under cProfile, and each method's top functions by own time go to
``--cprofile DIR/<method>.txt``. Prints ms per generated token per round, and the drafts verified.
Until sampled decode steps ran asynchronously (docs/performance.md §33) every step here was a
synchronous one; now a step nobody drafts chains on the device as a greedy one does, and the
difference between the methods is what speculation adds to a round (§32, §33).

Usage: python benchmarks/spec_sampled_profile.py [--model smollm2-135m-instruct] [--num-prompts 12]
       [--max-tokens 256] [--temperature 0.8] [--rounds 3] [--batch 1] [--methods baseline,ngram,eagle3]
       [--kv-cache-memory-bytes 3000000000] [--cprofile DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path
from typing import Any

METHODS: dict[str, dict[str, Any] | None] = {
    "baseline": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix"},
    "eagle3": {"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3},
}


def chat_prompts(tokenizer: Any, n: int, max_len: int = 1500) -> list[dict[str, list[int]]]:
    from tandem.bench.datasets import load_sharegpt_records, sharegpt_pairs
    from tandem.loader.tokenizer import apply_chat_template

    out = []
    for prompt, _ in sharegpt_pairs(load_sharegpt_records()):
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        if len(ids) < max_len:
            out.append({"prompt_token_ids": list(ids)})
        if len(out) == n:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call (concurrent requests)")
    ap.add_argument("--methods", default="baseline,ngram,eagle3", help="comma-separated from " + ",".join(METHODS))
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=3_000_000_000)
    ap.add_argument("--device", default=None)
    ap.add_argument("--cprofile", type=Path, default=None, help="directory for <method>.txt of the last round")
    args = ap.parse_args()
    from tandem import LLM, SamplingParams

    kw: dict[str, Any] = {"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
    if args.device:
        kw["device"] = args.device
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    llms = {n: LLM(args.model, speculative_config=METHODS[n], **kw) for n in names}
    prompts = chat_prompts(llms[names[0]].engine.tokenizer, args.num_prompts)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=1)
    ms: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for n, llm in llms.items():
            prof = cProfile.Profile() if args.cprofile and rnd == args.rounds - 1 else None
            toks = 0
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            for i in range(0, len(prompts), args.batch):
                outs = llm.generate(prompts[i:i + args.batch], sp, use_tqdm=False)
                toks += sum(len(o.outputs[0].token_ids) for o in outs)
            if prof is not None:
                prof.disable()
                args.cprofile.mkdir(parents=True, exist_ok=True)
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
                (args.cprofile / f"{n}.txt").write_text(s.getvalue())
            ms[n].append(1e3 * (time.perf_counter() - t0) / max(toks, 1))
    print(f"\n{args.model}, {len(prompts)} ShareGPT chat prompts x {args.max_tokens} tokens, T = {args.temperature}, batch {args.batch}")
    print("| method | " + " | ".join(f"round {i + 1} ms/token" for i in range(args.rounds)) + " | drafts verified |")
    print("|---|" + "---|" * (args.rounds + 1))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{x:.3f}" for x in ms[n]) + f" | {llms[n].engine.stats.spec.num_drafts} |")


if __name__ == "__main__":
    main()
