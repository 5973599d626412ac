#!/usr/bin/env python
"""What a speculative engine that does not draft costs on the GPU (issue #16, never slower): real
SmolLM2 bf16 by default, HumanEval prompts, greedy, ``--max-tokens`` each with ``ignore_eos``, at
batch 1 and at larger batches (``--batch 1,64``: that many prompts in one ``generate`` call).

Engines in one process (each a fresh ``LLM``, defaults otherwise), the order alternating per group
and round: ``baseline`` (no speculation); ``<method> off`` (n-gram k = 4, suffix, or the EAGLE-3 head
k = 3 with ``disable_by_batch_size: 1``: speculation configured, never drafting — the speculator's
and, for EAGLE, the target features' cost alone); ``<method>`` (the default goodput policy). Prints
total seconds, the ratio to the baseline, steps, the chained share (steps launched before the previous
step's tokens were read), ms per step, the tokens drafted and accepted and the goodput guard's
blocks. Then one group per engine under ``torch.profiler``: API calls
and GPU kernels per step (the profiler inflates the times; counts and differences between engines
are the signal).

Usage: python benchmarks/spec_idle_gpu.py [--humaneval FILE] [--head ALIAS|DIR] [--num-prompts 12]
       [--batch 1,64] [--engines baseline,ngram off,ngram,eagle off,eagle] [--max-tokens 256]
       [--rounds 3] [--device cuda] [--no-profile] [--cprofile DIR]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time
from pathlib import Path

API_CALLS = ("cudaGraphLaunch", "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernelEx",
             "cudaStreamSynchronize", "cudaEventSynchronize", "cudaEventRecord", "cudaStreamWaitEvent")


def speculative_config(name: str, head: str) -> dict | None:
    """The engine ``name`` stands for: ``baseline``, ``<method>`` or ``<method> off``."""
    if name == "baseline":
        return None
    method, _, off = name.partition(" ")
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
               "suffix": {"method": "suffix"},
               "eagle": {"model": head, "num_speculative_tokens": 3}}
    if method not in configs or off not in ("", "off"):
        raise SystemExit(f"--engines: unknown engine {name!r}; use baseline, ngram, suffix, eagle, "
                         "each optionally followed by ' off'")
    return {**configs[method], **({"disable_by_batch_size": 1} if off else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    ap.add_argument("--humaneval", default=None)
    ap.add_argument("--num-prompts", type=int, default=12, help="groups per round at each batch size")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes (prompts per generate call)")
    ap.add_argument("--engines", default="baseline,ngram off,eagle off,eagle")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--cprofile", default=None, metavar="DIR",
                    help="also cProfile one group per engine and batch; top functions to DIR/<batch>-<engine>.txt")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from tandem import LLM, SamplingParams
    from tandem.bench.datasets import load_humaneval_prompts

    batches = [int(b) for b in args.batch.split(",")]
    names = [n.strip() for n in args.engines.split(",")]
    if "baseline" not in names:
        raise SystemExit("--engines must include baseline")
    prompts = load_humaneval_prompts(args.humaneval)
    common = dict(device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                  max_model_len=2048, kv_cache_memory_bytes=(1 << 30) * max(1, max(batches) // 16),
                  enable_prefix_caching=False)
    engines = {n: LLM(args.target, speculative_config=speculative_config(n, args.head), **common) for n in names}
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)

    def group(batch: int, i: int) -> list[str]:
        return [prompts[(i * batch + j) % len(prompts)] for j in range(batch)]

    rows = []
    for batch in batches:
        for llm in engines.values():  # graphs, kernels
            llm.generate(group(batch, 0), sp, use_tqdm=False)
        secs: dict[str, float] = collections.defaultdict(float)
        steps0 = {n: (llm.engine.stats.num_steps, llm.engine.num_chained_steps, *speculation(llm))
                  for n, llm in engines.items()}
        for rnd in range(args.rounds):
            for i in range(args.num_prompts):
                order = names if (i + rnd) % 2 == 0 else names[::-1]
                for name in order:
                    t = time.perf_counter()
                    engines[name].generate(group(batch, i), sp, use_tqdm=False)
                    secs[name] += time.perf_counter() - t
        for name, llm in engines.items():
            steps = llm.engine.stats.num_steps - steps0[name][0]
            chained = llm.engine.num_chained_steps - steps0[name][1]
            drafted, accepted, blocks = (a - b for a, b in zip(speculation(llm), steps0[name][2:]))
            rows.append((batch, name, secs[name], secs["baseline"] / secs[name], chained, steps,
                         1e3 * secs[name] / max(1, steps), drafted, accepted, blocks))
        if args.cprofile:
            Path(args.cprofile).mkdir(parents=True, exist_ok=True)
            for name, llm in engines.items():
                prof = cProfile.Profile()
                prof.runcall(llm.generate, group(batch, 2), sp, use_tqdm=False)
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats("spec_decode", 30)
                Path(args.cprofile, f"{batch}-{name.replace(' ', '_')}.txt").write_text(text.getvalue())
        if not args.no_profile:
            for name, llm in engines.items():
                s0 = llm.engine.stats.num_steps
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    llm.generate(group(batch, 3), sp, use_tqdm=False)
                steps = max(1, llm.engine.stats.num_steps - s0)
                averages = prof.key_averages()
                print(f"\n## batch {batch}, {name}: {steps} steps")
                for k in averages:
                    if k.key in API_CALLS:
                        print(f"  {k.key}: {k.count / steps:.2f} per step, "
                              f"{k.self_cpu_time_total / steps:.1f} us CPU per step")
                gpu = sorted((k for k in averages if k.device_type.name == "CUDA"),
                             key=lambda k: -k.self_device_time_total)
                for k in gpu[:12]:
                    print(f"  GPU {k.key[:70]}: {k.count / steps:.2f} per step, "
                          f"{k.self_device_time_total / steps:.1f} us per step")
    print(f"\n{args.num_prompts} groups x {args.rounds} rounds, {args.max_tokens} tokens each, {args.device}")
    print("| batch | engine | seconds | vs baseline | chained / steps | ms per step | drafted / accepted tokens "
          "| guard blocks |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, name, s, ratio, chained, steps, ms, drafted, accepted, blocks in rows:
        print(f"| {batch} | {name} | {s:.3f} | {ratio:.3f}x | {chained} / {steps} | {ms:.3f} | {drafted} / {accepted} "
              f"| {blocks} |")


def speculation(llm) -> tuple[int, int, int]:
    """Drafted and accepted tokens and the goodput guard's blocks so far (zeros without speculation)."""
    spec = llm.engine.speculator
    stats, policy = getattr(spec, "stats", None), spec.policy
    if stats is None:
        return 0, 0, 0
    return stats.num_draft_tokens, stats.num_accepted_tokens, policy.guard.num_blocks if policy is not None else 0


if __name__ == "__main__":
    main()
