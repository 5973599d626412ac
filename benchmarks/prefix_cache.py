"""Prefix caching on CPU: TTFT and scheduled prefill tokens with caching on vs off.

Workload: tandem's `prefix-repetition` dataset (shared random prefixes + per-request random
suffixes, exact token lengths) on SmolLM2-135M-Instruct in float32. Requests run one at a time
(batch 1), so TTFT is pure prefill time: the first request of each prefix pays for the whole
prompt, later ones — with caching on — only for the uncached suffix. Both configurations run in
the same process, interleaved request by request, so load changes hit both alike.

    python benchmarks/prefix_cache.py --num-prompts 12 --prefix-len 448 --suffix-len 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tandem import LLM, SamplingParams
from tandem.bench.datasets import sample_prefix_repetition


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--num-prefixes", type=int, default=3)
    ap.add_argument("--prefix-len", type=int, default=448)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {
        on: LLM(args.model, device="cpu", dtype="float32", max_model_len=2048,
                kv_cache_memory_bytes=512 << 20, enable_prefix_caching=on)
        for on in (False, True)
    }
    tok = engines[True].get_tokenizer()
    reqs = sample_prefix_repetition(tok, args.num_prompts, seed=0, prefix_len=args.prefix_len,
                                    suffix_len=args.suffix_len, num_prefixes=args.num_prefixes, output_len=1)
    params = SamplingParams(temperature=0, max_tokens=1)
    seen: set[str] = set()
    rows: dict[tuple[bool, bool], list[float]] = {}
    cached: dict[tuple[bool, bool], list[int]] = {}
    outputs: dict[bool, list[list[int]]] = {False: [], True: []}
    for r in reqs:
        prefix = r.prompt[:200]
        repeat = prefix in seen
        seen.add(prefix)
        ids = tok.encode(r.prompt)
        for on in (False, True) if len(seen) % 2 else (True, False):
            t0 = time.perf_counter()
            out = engines[on].generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            rows.setdefault((on, repeat), []).append(time.perf_counter() - t0)
            cached.setdefault((on, repeat), []).append(out.num_cached_tokens)
            outputs[on].append(out.outputs[0].token_ids)
    st = engines[True].engine.stats
    print(f"# {time.strftime('%Y-%m-%d')}, load avg {os.getloadavg()[0]:.2f}, threads {args.threads}, "
          f"{args.num_prompts} prompts of {args.prefix_len}+{args.suffix_len} tokens, {args.num_prefixes} prefixes")
    print("| prefix caching | request | n | TTFT median (ms) | cached tokens (mean) |")
    print("|---|---|---|---|---|")
    for on in (False, True):
        for repeat in (False, True):
            t = rows.get((on, repeat), [])
            if t:
                print(f"| {'on' if on else 'off'} | {'repeated prefix' if repeat else 'first of its prefix'} | "
                      f"{len(t)} | {1e3 * statistics.median(t):.1f} | {statistics.mean(cached[(on, repeat)]):.0f} |")
    rep_off, rep_on = statistics.median(rows[(False, True)]), statistics.median(rows[(True, True)])
    print(f"\nTTFT of repeated-prefix requests, off / on: {rep_off / rep_on:.2f}x; "
          f"prefix cache hits/queries {st.prefix_cache_hits}/{st.prefix_cache_queries} tokens; "
          f"identical outputs: {outputs[False] == outputs[True]}")


if __name__ == "__main__":
    main()
