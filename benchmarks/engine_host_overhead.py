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
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import write_tiny_hf_checkpoint

    from tandem import LLM, SamplingParams

    torch.set_num_threads(1)
    d = write_tiny_hf_checkpoint(Path(tempfile.mkdtemp()), "llama", hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
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
            eng = llm.engine
            for i, p in enumerate(prompts):
                eng.add_request(f"{rep}-{i}", None, sp, prompt_token_ids=p)
            while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
                eng.step()
            t0, n = time.perf_counter(), 0
            while eng.has_unfinished_requests():
                eng.step()
                n += 1
            res[name].append((time.perf_counter() - t0) / n * 1e3)
    print(f"| batch | detokenizer | ms per decode step (median of {args.rounds}) | runs |\n|---|---|---|---|")
    for k, v in res.items():
        print(f"| {args.batch} | {k} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")


if __name__ == "__main__":
    main()
