#!/usr/bin/env python
"""Engine host work per step at large batch, on CPU with a tiny model (so the forward is cheap and the
engine's own Python work — scheduling, sampling bookkeeping, detokenization, outputs — shows).

Compares detokenizing through transformers' ``tokenizer.decode`` with the engine's default
(``detokenizer.fast_decoder``: the fast tokenizer's Rust backend when it gives the same text). Both
engines run in one process, alternating, same prompts (the tiny test checkpoint's tokenizer).

Usage: python benchmarks/engine_host_overhead.py [--batch 128] [--rounds 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from _common import decode_ms_per_step, tiny_model_dir

    from tandem import LLM, SamplingParams

    torch.set_num_threads(1)
    d = tiny_model_dir()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (64,), generator=g).tolist() for _ in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llms = {}
    for name in ("transformers decode", "backend decode (default)"):
        llm = LLM(str(d), device="cpu", dtype="float32", kv_cache_memory_bytes=256 << 20, block_size=16,
                  max_num_seqs=max(256, args.batch))
        if name.startswith("transformers"):
            llm.engine.output_processor.decoder = llm.engine.tokenizer
        llms[name] = llm
    res: dict[str, list[float]] = {k: [] for k in llms}
    for rep in range(args.rounds):
        for name, llm in llms.items():
            res[name].append(decode_ms_per_step(llm.engine, prompts, sp, str(rep))[0])
    print(f"| batch | detokenizer | ms per decode step (median of {args.rounds}) | runs |\n|---|---|---|---|")
    for k, v in res.items():
        print(f"| {args.batch} | {k} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")


if __name__ == "__main__":
    main()
