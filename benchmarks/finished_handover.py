#!/usr/bin/env python
"""Host time a decode step spends handing finished outputs to the suffix proposer's global tree
(issue #16: never slower), under the old rule and the time credit (``spec_decode/finished_queue.py``).

The real ``SuffixProposer`` (vLLM's defaults: depth 24, 10000 cached outputs) is fed a stream of
finished outputs as an engine at batch B with L-token outputs sees it: B / L outputs finish per step,
staggered (continuous batching; ``--waves``: all B together every L steps instead, as in
``tandem bench sweep``'s closed loop). Each step has a nominal wall time (the H100's measured decode
step of real SmolLM2 bf16 at that batch, docs/performance.md §43, unless ``--step-ms``); the host
time of each hand-over is measured on this machine. Rules:

- ``old``: 128 output tokens per step plus 1/64 of the queue, at least one output (§36 to §42);
- ``credit``: a credit of ``HOST_SHARE`` of each step's wall time (``time_credit.py``: 1 % since
  docs/performance.md §44, 2 % in §43's table; 4 ms saved at most, 0.5 ms a call), the oldest queued
  outputs dropped beyond 8192 tokens (``FinishedQueue``'s defaults; in an engine with the goodput
  policy the credit is shared with the policy's idle work).

Outputs: n-gram-like token streams (a 2,000-token vocabulary, runs copied from earlier outputs so the
tree has structure), seeded. Prints, per batch and rule, µs per step spent handing over (mean, and
its share of the nominal step), the largest single step, and the share of outputs that reached the
tree.

Usage: python benchmarks/finished_handover.py [--batch 1,8,32,64] [--output-len 256] [--steps 1024]
       [--waves] [--step-ms 0.6,0.85,1.41,2.27]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections import deque
from collections.abc import Callable, Sequence

from tandem.spec_decode.finished_queue import FinishedQueue
from tandem.spec_decode.suffix import SuffixProposer

# The H100's decode step, real SmolLM2 bf16, defaults (spec_idle_gpu.py, docs/performance.md §43), ms
H100_STEP_MS = {1: 0.61, 8: 0.85, 32: 1.41, 64: 2.27}


class OldRule:
    """The hand-over before the time credit: 128 tokens per call plus 1/64 of the queue."""

    def __init__(self) -> None:
        self._queue: deque[tuple[str, Sequence[int]]] = deque()
        self.num_tokens = 0
        self.num_dropped = 0

    def push(self, rid: str, output: Sequence[int]) -> None:
        self._queue.append((rid, output))
        self.num_tokens += len(output) + 1

    def earn(self, step_seconds: float) -> None:
        pass

    def hand_over(self, forget: Callable[[str, Sequence[int]], None]) -> None:
        budget = 128 + self.num_tokens // 64
        while self._queue and budget > 0:
            rid, output = self._queue.popleft()
            forget(rid, output)
            budget -= len(output) + 1
            self.num_tokens -= len(output) + 1


def outputs(rng: random.Random, n: int, length: int) -> list[list[int]]:
    done: list[list[int]] = []
    for _ in range(n):
        out: list[int] = []
        while len(out) < length:
            if done and rng.random() < 0.5:  # a run copied from an earlier output
                src = rng.choice(done)
                at = rng.randrange(len(src))
                out += src[at:at + rng.randint(4, 24)]
            else:
                out += [rng.randrange(2000) for _ in range(rng.randint(1, 8))]
        done.append(out[:length])
    return done


def run(rule: str, batch: int, step_s: float, output_len: int, steps: int, waves: bool,
        pool: list[list[int]]) -> tuple[float, float, float]:
    gc.collect()  # (a collection of an earlier run's trees is not this run's cost)
    proposer = SuffixProposer(24)
    q = OldRule() if rule == "old" else FinishedQueue()
    told = 0

    def forget(rid: str, output: Sequence[int]) -> None:
        nonlocal told
        told += 1
        proposer.forget(rid, output)

    finished = 0
    spent, worst, owed = 0.0, 0.0, 0.0
    for step in range(steps):
        if waves:
            due = batch if step % output_len == output_len - 1 else 0
        else:
            owed += batch / output_len
            due = int(owed)
            owed -= due
        for _ in range(due):
            q.push(f"r{finished}", pool[finished % len(pool)])
            finished += 1
        q.earn(step_s)
        t0 = time.perf_counter()
        q.hand_over(forget)
        dt = time.perf_counter() - t0
        spent += dt
        worst = max(worst, dt)
    return spent / steps, worst, told / max(1, finished)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--waves", action="store_true")
    ap.add_argument("--step-ms", default=None, help="nominal step per batch (default: the H100's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    step_ms = ([float(x) for x in args.step_ms.split(",")] if args.step_ms
               else [H100_STEP_MS.get(b, 2.27) for b in batches])
    pool = outputs(random.Random(args.seed), 512, args.output_len)
    print(f"outputs of {args.output_len} tokens, {args.steps} steps, "
          f"{'waves' if args.waves else 'staggered'} finishing")
    print("| batch | nominal step ms | rule | µs per step (share) | largest step µs | outputs reaching the tree |")
    print("|---|---|---|---|---|---|")
    for b, ms in zip(batches, step_ms):
        for rule in ("old", "credit"):
            mean, worst, share = run(rule, b, ms / 1e3, args.output_len, args.steps, args.waves, pool)
            print(f"| {b} | {ms:.2f} | {rule} | {mean * 1e6:.1f} ({100 * mean / (ms / 1e3):.1f} %) | "
                  f"{worst * 1e6:.0f} | {100 * share:.0f} % |")


if __name__ == "__main__":
    main()
