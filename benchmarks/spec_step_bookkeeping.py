#!/usr/bin/env python
"""A speculator's own host work per engine step, without a model (issue #16, never slower): what the
engine and the speculator do around every step of a batch where nobody drafts — building the step
record (``StepRows.add`` over the step's scheduled requests as the engine calls it, then
``StepRecord.of``; a plain engine builds none), ``observe``, ``will_draft``
and ``background`` — timed with synthetic requests whose tokens never repeat (n-gram and suffix find
no matches) and a given step time (the share of it the idle credit earns: ``time_credit.py``).
On a host-bound GPU engine (SmolLM2 at batch 8–64, docs/performance.md §43–44) every microsecond of
this is a microsecond of the step.

Usage: python benchmarks/spec_step_bookkeeping.py [--batch 8,32,64] [--methods ngram,ngram-off,suffix,suffix-off]
       [--steps 4000] [--step-ms 1.4]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from tandem.config.speculative import SpeculativeConfig
from tandem.engine.stats import SpecStats
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.proposers import build_proposer
from tandem.spec_decode.speculator import build_speculator
from tandem.spec_decode.step_record import StepKind, StepRecord, StepRows

STAGES = ("record", "observe", "will_draft", "background")


def measure(batch: int, method: str, steps: int, step_seconds: float) -> dict[str, float]:
    name, _, off = method.partition("-")
    cfg = SpeculativeConfig(method=name, num_speculative_tokens=4 if name == "ngram" else 24,
                            **({"disable_by_batch_size": 1} if off else {}))
    spec = build_speculator(cfg, build_proposer(cfg, None, torch.Generator()), SpecStats(), torch.device("cuda"),
                            asynchronous=True)
    reqs = []
    for i in range(batch):
        r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=10**6), (0,), 10**6,
                    token_ids=[(i * 7 + j) % 500 for j in range(200)])
        r.num_computed_tokens, r.status = 199, RequestStatus.RUNNING
        reqs.append(r)
    totals = dict.fromkeys(STAGES, 0.0)
    scheduled = [SimpleNamespace(request=r, spec_token_ids=[]) for r in reqs]  # (a ScheduledRequest's fields read)
    accepted = [0] * batch

    def step(n: int, timed: bool) -> None:
        for r in reqs:
            r.token_ids.append(500 + (n * batch + int(r.request_id[1:])) % 100_000)  # never repeats
        sampled_ids = [[r.token_ids[-1]] for r in reqs]
        t0 = time.perf_counter()
        rows = StepRows()
        rows.add(scheduled, sampled_ids, accepted, False)
        record = StepRecord.of(StepKind.DECODE, step_seconds, rows, (), batch, batch)
        t1 = time.perf_counter()
        spec.observe(record)
        t2 = time.perf_counter()
        spec.will_draft(reqs)
        t3 = time.perf_counter()
        spec.background()
        t4 = time.perf_counter()
        if timed:
            for k, dt in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                totals[k] += dt

    for n in range(300):
        step(n, False)
    for n in range(300, 300 + steps):
        step(n, True)
    return {k: 1e6 * v / steps for k, v in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="8,32,64")
    ap.add_argument("--methods", default="ngram,ngram-off,suffix,suffix-off")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--step-ms", type=float, default=1.4, help="the step time the records report")
    args = ap.parse_args()
    print(f"µs per step, {args.steps} steps, records of {args.step_ms} ms steps")
    print("| batch | method | " + " | ".join(STAGES) + " | sum | share of the step |")
    print("|---|---|" + "---|" * (len(STAGES) + 2))
    for batch in (int(b) for b in args.batch.split(",")):
        for method in args.methods.split(","):
            t = measure(batch, method, args.steps, args.step_ms * 1e-3)
            total = sum(t.values())
            print(f"| {batch} | {method} | " + " | ".join(f"{t[k]:.1f}" for k in STAGES)
                  + f" | {total:.1f} | {total / (10 * args.step_ms):.1f} % |")


if __name__ == "__main__":
    main()
