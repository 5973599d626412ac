#!/usr/bin/env python
"""What speculation costs when it does not draft (issue #16: the H200's 0.91x at concurrency 32 with
3 % drafting), measured on the host: a tiny model on CPU, so a step is mostly the engine's own Python
work, with asynchronous scheduling on as on CUDA (the pipeline logic runs; the forward does not
overlap on CPU, so this measures host work and pipeline chaining, not GPU overlap).

Engines in one process, alternating per round, same prompts: no speculation; n-gram with the
default goodput policy; n-gram drafting every step (``disable_by_acceptance: false``); EAGLE-3 with
the default policy (a tiny random head, ``tests/eagle_heads.py``, reading the inputs of the
target's layers 0, 1 and 2 — the tiny target has 3 layers here, 2 in §18's runs: nothing it drafts
is accepted, so after its first rounds the policy stops drafting, as with the shipped SmolLM2 head
on the H200, docs/performance.md §23). Random-token prompts give n-gram few matches, so the policy
mostly does not draft. Per engine: ms per decode step (median of rounds), its ratio to no
speculation (median of the per-round ratios: rounds alternate engines, so a ratio compares
neighbours in time), the share of steps launched ahead of the previous read (``num_chained_steps``
/ steps: 1.0 is a fully overlapped pipeline), and the drafting share (request-steps that verified
drafts / request-steps).

``--engines``: a comma-separated subset of none, ngram, ngram-every, ngram-off, suffix, suffix-off,
eagle3 (default: all); ``-off``: configured with ``disable_by_batch_size: 1`` (never drafting: the
speculator's standing cost). Every engine runs the target without the oneDNN copies a speculating
float32 CPU target gets (``cpu_onednn=False``), so the target forward is the same everywhere.
``--profile NAME``: instead of the table, cProfile the decode steps of one engine (after one warm-up
round) and print its 25 most expensive functions by own time, then the speculator's
(``spec_decode``) 30 by cumulative time. ``--breakdown``: after the table, the
wall time per decode step of each engine's stages (the target forward — for EAGLE with the write
of its features to the feature cache —, the speculator's four calls, and within them the proposer's
proposals), timed around each call in every round.

``--repetitive F``: that fraction of the prompts repeats a 6-token motif (n-gram matches there, so a
few requests want to draft while the rest do not — the case where one drafting request turns the
whole batch's step into a synchronous verify).

Usage: python benchmarks/spec_idle_overhead.py [--batch 32,64] [--rounds 5] [--max-tokens 96] [--repetitive 0.0]
       [--engines none,eagle3] [--breakdown] [--profile eagle3] [--clock cpu]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ENGINES = ("none", "ngram", "ngram-every", "ngram-off", "suffix", "suffix-off", "eagle3")
STAGES = ("target forward", "drafts_for", "will_draft", "observe", "background", "proposer")


class Stages:
    """Wall time spent in an engine's stages, timed around each call, exclusive: a stage called from
    within another (the proposer's head forwards inside ``drafts_for`` or ``observe``) is not counted
    in the outer one."""

    def __init__(self, engine: Any) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self._stack: list[str] = []
        self._wrap(engine.runner, "forward_logits", "target forward")
        self._wrap(engine.runner, "forward", "target forward")
        for name in ("drafts_for", "will_draft", "observe", "background"):
            self._wrap(engine.speculator, name, name)
        proposer = engine.speculator.proposer
        if proposer is not None:  # head / draft-model forwards, proposals
            self._wrap(proposer, "propose_requests", "proposer")

    def _wrap(self, obj: Any, attr: str, stage: str) -> None:
        fn = getattr(obj, attr)
        stack = self._stack

        def timed(*args: Any, **kwargs: Any) -> Any:
            if stack and stack[-1] == stage:  # (forward_logits calling forward)
                return fn(*args, **kwargs)
            stack.append(stage)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                stack.pop()
                self.seconds[stage] += dt
                if stack:
                    self.seconds[stack[-1]] -= dt

        setattr(obj, attr, timed)


def spec_config(name: str, target: Path) -> dict[str, Any] | None:
    if name == "none":
        return None
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "disable_by_acceptance": True}
    if name == "ngram-off":  # configured, never drafting: the speculator's standing cost
        return {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1}
    if name == "suffix-off":
        return {"method": "suffix", "disable_by_batch_size": 1}
    if name == "ngram-every":
        return {"method": "ngram", "num_speculative_tokens": 4, "disable_by_acceptance": False}
    if name == "suffix":  # vLLM's defaults (k = 24)
        return {"method": "suffix", "disable_by_acceptance": True}
    if name == "eagle3":
        from eagle_heads import write_eagle_head  # tests/ (on the path after tiny_model_dir)

        head, _ = write_eagle_head(Path(tempfile.mkdtemp()), "eagle3", target, aux=(0, 1, 2))  # the target has 3 layers
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "disable_by_acceptance": True}
    raise SystemExit(f"unknown engine {name!r}: one of {', '.join(ENGINES)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="32,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repetitive", type=float, default=0.0)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--profile", default=None, help="cProfile this engine's decode steps instead")
    ap.add_argument("--breakdown", action="store_true", help="also time each engine's stages")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (host work, less disturbed by other processes)")
    args = ap.parse_args()
    from _common import decode_ms_per_step, tiny_model_dir

    from tandem import LLM, SamplingParams

    torch.set_num_threads(1)
    d = tiny_model_dir(num_layers=3)
    names = [args.profile] if args.profile else args.engines.split(",")
    configs = {name: spec_config(name, d) for name in names}
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"repetitive prompts: {args.repetitive:.0%}; clock: {args.clock}")
    if not args.profile:
        print("| batch | speculation | ms per step (median) | vs none (median of rounds) | runs | chained steps "
              "| drafting share | steps per round |")
        print("|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, 500, (48,), generator=g).tolist() for _ in range(batch)]
        for i in range(round(args.repetitive * batch)):
            prompts[i] = (torch.randint(3, 500, (6,), generator=g).tolist() * 8)[:48]
        llms = {name: LLM(str(d), device="cpu", dtype="float32", kv_cache_memory_bytes=256 << 20, block_size=16,
                          max_num_seqs=max(256, batch), async_scheduling=True, speculative_config=cfg,
                          runner_config={"cpu_onednn": False})  # (the same target forward in every engine: host work is the subject)
                for name, cfg in configs.items()}
        if args.profile:
            profile(llms[args.profile].engine, prompts, sp, args.rounds)
            continue
        stages = {name: Stages(llm.engine) for name, llm in llms.items()} if args.breakdown else {}
        res: dict[str, list[float]] = {k: [] for k in llms}
        steps = {k: 0 for k in llms}
        chained = {k: 0 for k in llms}
        drafted = {k: 0 for k in llms}
        for rep in range(args.rounds):
            for name, llm in llms.items():
                eng = llm.engine
                chained0, drafts0 = eng.num_chained_steps, eng.stats.spec.num_drafts
                ms, n = decode_ms_per_step(eng, prompts, sp, str(rep), clock)
                res[name].append(ms)
                steps[name] += n
                chained[name] += eng.num_chained_steps - chained0
                drafted[name] += eng.stats.spec.num_drafts - drafts0
        for name, v in res.items():
            ratio = (f"{statistics.median([x / y for x, y in zip(v, res['none'])]):.3f}x" if "none" in res else "")
            # chained: steps launched before the previous step's tokens were read; drafting share:
            # the share of request-steps that verified drafts
            print(f"| {batch} | {name} | {statistics.median(v):.3f} | {ratio} | {', '.join(f'{x:.3f}' for x in v)} | "
                  f"{chained[name] / steps[name]:.3f} | {drafted[name] / (steps[name] * batch):.3f} | "
                  f"{steps[name] // args.rounds} |", flush=True)
        if stages:
            print(f"\nbatch {batch}, µs per decode step (prefill steps' share included):")
            print("| speculation | " + " | ".join(STAGES) + " | sum |")
            print("|---" * (len(STAGES) + 2) + "|")
            for name, st in stages.items():
                us = [st.seconds[k] / steps[name] * 1e6 for k in STAGES]
                print(f"| {name} | " + " | ".join(f"{u:.1f}" for u in us) + f" | {sum(us):.1f} |")
            print()


def profile(engine: Any, prompts: list[list[int]], sp: Any, rounds: int) -> None:
    from _common import decode_ms_per_step

    decode_ms_per_step(engine, prompts, sp, "warm")
    prof = cProfile.Profile()
    steps = 0
    for rep in range(rounds):
        prof.enable()
        steps += decode_ms_per_step(engine, prompts, sp, str(rep))[1]
        prof.disable()
    print(f"{steps} decode steps (cProfile on: times are inflated)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats("spec_decode", 30)


if __name__ == "__main__":
    main()
