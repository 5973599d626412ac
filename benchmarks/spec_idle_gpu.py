#!/usr/bin/env python
"""What a speculative engine that does not draft costs on the GPU (issue #16, never slower): batch 1,
real SmolLM2 bf16 by default, HumanEval prompts, greedy, ``--max-tokens`` each with ``ignore_eos``.

Engines in one process (each a fresh ``LLM``, defaults otherwise), the order alternating per prompt
and round: ``baseline`` (no speculation); ``ngram off`` and ``eagle off`` (n-gram k = 4 / the EAGLE-3
head k = 3 with ``disable_by_batch_size: 1``: speculation configured, never drafting — the
speculator's and, for EAGLE, the target features' cost alone); ``eagle policy`` (the head with the
default goodput policy). Prints total seconds, the ratio to the baseline and the chained share
(steps launched before the previous step's tokens were read). Then one request per engine under
``torch.profiler``: API calls and GPU kernels per step (the profiler inflates the times; counts and
differences between engines are the signal).

Usage: python benchmarks/spec_idle_gpu.py [--humaneval FILE] [--head ALIAS|DIR] [--num-prompts 12]
       [--max-tokens 256] [--rounds 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import collections
import time

API_CALLS = ("cudaGraphLaunch", "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernelEx",
             "cudaStreamSynchronize", "cudaEventSynchronize", "cudaEventRecord", "cudaStreamWaitEvent")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    ap.add_argument("--humaneval", default=None)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from tandem import LLM, SamplingParams
    from tandem.bench.datasets import load_humaneval_prompts

    prompts = load_humaneval_prompts(args.humaneval)[: args.num_prompts]
    common = dict(device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                  max_model_len=2048, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    off = {"disable_by_batch_size": 1}
    engines = {
        "baseline": LLM(args.target, **common),
        "ngram off": LLM(args.target, speculative_config={"method": "ngram", "num_speculative_tokens": 4, **off},
                         **common),
        "eagle off": LLM(args.target, speculative_config={"model": args.head, "num_speculative_tokens": 3, **off},
                         **common),
        "eagle policy": LLM(args.target, speculative_config={"model": args.head, "num_speculative_tokens": 3},
                            **common),
    }
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    for llm in engines.values():  # graphs, kernels
        for p in prompts[:2]:
            llm.generate([p], sp, use_tqdm=False)
    secs: dict[str, float] = collections.defaultdict(float)
    for rnd in range(args.rounds):
        for i, p in enumerate(prompts):
            order = list(engines) if (i + rnd) % 2 == 0 else list(engines)[::-1]
            for name in order:
                t = time.perf_counter()
                engines[name].generate([p], sp, use_tqdm=False)
                secs[name] += time.perf_counter() - t
    print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.max_tokens} tokens each, batch 1, {args.device}")
    print("| engine | seconds | vs baseline | chained / steps |")
    print("|---|---|---|---|")
    for name, llm in engines.items():
        e = llm.engine
        print(f"| {name} | {secs[name]:.3f} | {secs['baseline'] / secs[name]:.3f}x | "
              f"{e.num_chained_steps} / {e.stats.num_steps} |")
    for name, llm in engines.items():
        steps0 = llm.engine.stats.num_steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompts[min(3, len(prompts) - 1)]], sp, use_tqdm=False)
        steps = max(1, llm.engine.stats.num_steps - steps0)
        averages = prof.key_averages()
        print(f"\n## {name}: {steps} steps")
        for k in averages:
            if k.key in API_CALLS:
                print(f"  {k.key}: {k.count / steps:.2f} per step, {k.self_cpu_time_total / steps:.1f} us CPU per step")
        gpu = sorted((k for k in averages if k.device_type.name == "CUDA"), key=lambda k: -k.self_device_time_total)
        for k in gpu[:12]:
            print(f"  GPU {k.key[:70]}: {k.count / steps:.2f} per step, {k.self_device_time_total / steps:.1f} us per step")


if __name__ == "__main__":
    main()
