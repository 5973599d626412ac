#!/usr/bin/env python
"""What speculation costs when it does not draft (issue #16: the H200's 0.91x at concurrency 32 with
3 % drafting), measured on the host: a tiny model on CPU, so a step is mostly the engine's own Python
work, with asynchronous scheduling on as on CUDA (the pipeline logic runs; the forward does not
overlap on CPU, so this measures host work and pipeline chaining, not GPU overlap).

Engines in one process, alternating per round, same prompts: no speculation; n-gram with the
default goodput policy; n-gram drafting every step (``disable_by_acceptance: false``). Random-token
prompts give n-gram few matches, so the policy mostly does not draft. Per engine: ms per decode step
(median of rounds), the share of steps launched ahead of the previous read (``num_chained_steps`` /
steps: 1.0 is a fully overlapped pipeline), and the policy's drafting share.

``--repetitive F``: that fraction of the prompts repeats a 6-token motif (n-gram matches there, so a
few requests want to draft while the rest do not — the case where one drafting request turns the
whole batch's step into a synchronous verify).

Usage: python benchmarks/spec_idle_overhead.py [--batch 32,64] [--rounds 5] [--max-tokens 96] [--repetitive 0.0]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="32,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repetitive", type=float, default=0.0)
    args = ap.parse_args()
    from _common import decode_ms_per_step, tiny_model_dir

    from tandem import LLM, SamplingParams

    torch.set_num_threads(1)
    d = tiny_model_dir()
    configs = {
        "none": None,
        "ngram, policy (default)": {"method": "ngram", "num_speculative_tokens": 4, "disable_by_acceptance": True},
        "ngram, every step": {"method": "ngram", "num_speculative_tokens": 4, "disable_by_acceptance": False},
    }
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"repetitive prompts: {args.repetitive:.0%}")
    print("| batch | speculation | ms per step (median) | runs | chained steps | drafting share | steps |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, 500, (48,), generator=g).tolist() for _ in range(batch)]
        for i in range(round(args.repetitive * batch)):
            prompts[i] = (torch.randint(3, 500, (6,), generator=g).tolist() * 8)[:48]
        llms = {name: LLM(str(d), device="cpu", dtype="float32", kv_cache_memory_bytes=256 << 20, block_size=16,
                          max_num_seqs=max(256, batch), async_scheduling=True, speculative_config=cfg)
                for name, cfg in configs.items()}
        res: dict[str, list[float]] = {k: [] for k in llms}
        info: dict[str, tuple[float, float, int]] = {}
        for rep in range(args.rounds):
            for name, llm in llms.items():
                eng = llm.engine
                chained0 = eng.num_chained_steps
                ms, n = decode_ms_per_step(eng, prompts, sp, str(rep))
                res[name].append(ms)
                share = eng.stats.spec.drafting_share if eng.spec is not None else 0.0
                info[name] = ((eng.num_chained_steps - chained0) / n, share, n)
        for name, v in res.items():
            chained, share, steps = info[name]
            print(f"| {batch} | {name} | {statistics.median(v):.3f} | {', '.join(f'{x:.3f}' for x in v)} | "
                  f"{chained:.2f} | {share:.2f} | {steps} |", flush=True)


if __name__ == "__main__":
    main()
