#!/usr/bin/env python
"""What a speculating engine that does not draft costs under `bench sweep`'s driver (issue #16, never
slower at c = 32–64): the sweep streams every request's output every step, which makes a SmolLM2
engine host-bound at c = 64 on the H100 (process CPU time = wall time), so every microsecond of the
speculator's bookkeeping is a microsecond of the step (docs/performance.md §55).

Engines in one process (no speculation; n-gram k = 4 with the goodput policy; n-gram configured
never to draft, ``disable_by_batch_size: 1``; suffix with the policy), one warm-up, then ``--rounds``
rounds alternating between them, each a fresh policy as in the sweep (``reset_speculation``), the
workload's prompts driven by ``tandem.bench.sweep.drive`` at ``--concurrency``. Per engine and round:
wall and process CPU seconds, steps and chained steps, mean TPOT; then the ratio to the baseline's
wall time (median of the rounds). ``--profile``: the last round under cProfile, and per engine the
functions whose own time grew most against the baseline's.

Usage: python benchmarks/spec_idle_drive.py [--workload code] [--concurrency 64] [--num-prompts 64]
       [--max-tokens 256] [--rounds 3] [--engines none,ngram,ngram-off] [--profile] [--device cuda]
       [--model smollm2-135m-instruct] [--kv-cache-memory-bytes 2147483648]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import time
from typing import Any

ENGINES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram-off": {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1},
    "suffix": {"method": "suffix"},
}


def own_times(prof: cProfile.Profile) -> collections.Counter[str]:
    c: collections.Counter[str] = collections.Counter()
    for (f, _, fn), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        c[f.split("tandem/")[-1] + ":" + fn] += tt
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default=None)
    ap.add_argument("--workload", default="code", help="code | edit | chat | repeated (bench sweep's)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="none,ngram,ngram-off")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    ap.add_argument("--profile", action="store_true", help="cProfile the last round")
    args = ap.parse_args()
    from tandem import LLM
    from tandem.bench.sweep import drive, reset_speculation, workload_prompts
    from tandem.bench.sweep_spec import WORKLOADS
    from tandem.sampling_params import SamplingParams

    names = args.engines.split(",")
    if "none" not in names:
        raise SystemExit("--engines must include none (the baseline)")
    kw: dict[str, Any] = {"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
    if args.device:
        kw["device"] = args.device
    llms = {n: LLM(args.model, speculative_config=ENGINES[n], **kw) for n in names}
    wl = WORKLOADS[args.workload]
    prompts = workload_prompts(llms["none"].engine, wl, args.num_prompts, 0, args.max_tokens)
    params = [SamplingParams(temperature=wl.temperature, max_tokens=args.max_tokens,
                             seed=None if wl.temperature == 0 else i) for i in range(len(prompts))]
    for llm in llms.values():  # warm-up
        drive(llm.engine, prompts[:8], params[:8], 8)
    rows: dict[str, list[tuple[float, float, int, int, float]]] = collections.defaultdict(list)
    profs: dict[str, cProfile.Profile] = {}
    for rnd in range(args.rounds):
        for n, llm in llms.items():
            e = llm.engine
            reset_speculation(e)
            s0, c0 = e.stats.num_steps, e.num_chained_steps
            prof = cProfile.Profile() if args.profile and rnd == args.rounds - 1 else None
            t0, p0 = time.perf_counter(), time.process_time()
            if prof is not None:
                prof.enable()
            m = drive(e, prompts, params, args.concurrency)
            if prof is not None:
                prof.disable()
                profs[n] = prof
            rows[n].append((time.perf_counter() - t0, time.process_time() - p0, e.stats.num_steps - s0,
                            e.num_chained_steps - c0, m["mean_tpot_ms"]))
    timed = args.rounds - (1 if args.profile else 0)  # (the profiled round is not compared)
    print(f"\n{args.model}, {args.workload}, c = {args.concurrency}, {len(prompts)} prompts x {args.max_tokens}")
    print("| engine | wall s per round | CPU s | steps / chained (round 1) | TPOT ms | vs none (median) |")
    print("|---|---|---|---|---|---|")
    for n, r in rows.items():
        ratios = [b[0] / a[0] for a, b in zip(r[:timed], rows["none"][:timed])]
        print(f"| {n} | " + " / ".join(f"{x[0]:.3f}" for x in r) + " | " + " / ".join(f"{x[1]:.2f}" for x in r)
              + f" | {r[0][2]} / {r[0][3]} | " + " / ".join(f"{x[4]:.2f}" for x in r)
              + (f" | {statistics.median(ratios):.3f}x |" if ratios else " | - |"))
    if profs:
        base = own_times(profs["none"])
        for n in names[1:]:
            d = own_times(profs[n])
            d.subtract(base)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:15]
            print(f"{n} minus none, own ms in the profiled round: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in top))


if __name__ == "__main__":
    main()
