#!/usr/bin/env python
"""What drawing a sampled step's tokens costs: host time and device time per step, on CPU or GPU.

``probs_from_logits`` + ``sample`` (temperature 0.8, top-p 0.95 unless ``--top-p 1``) on random
[batch, vocab] logits, for unseeded rows (one draw from the engine's generator) and seeded rows
(uniforms keyed by (seed, position), computed on the host), each with tandem's inverse-CDF draw
(``sampler.inverse_cdf``: one uniform per row) and with the exponential race it replaced (a row of
Exp(1) noise per sampled row, argmax of p / noise; unseeded only), all in one process. ``host`` is the
wall time of queuing one step's sampling (nothing waits for the device: sample/upload.py); ``device``
is the time for ``--steps`` steps queued back to back, per step, synchronised at the end (on CPU the
two are the same).

Usage: python benchmarks/sampling_cost.py [--device cuda] [--vocab 49152] [--batch 1,8,32,64]
       [--steps 200] [--top-p 0.95]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()
    from tandem import SamplingParams
    from tandem.sample import sampler
    from tandem.sample.logits import probs_from_logits
    from tandem.sample.rows import SamplingRow
    from tandem.sample.seeded import SeededStream

    dev = torch.device(args.device)
    gen = torch.Generator(dev).manual_seed(0)
    inverse_cdf = sampler.inverse_cdf

    def race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # the method before (unseeded rows)
        noise = torch.empty_like(probs).exponential_(generator=gen).clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / noise).argmax(dim=-1)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    print(f"{dev.type}, vocab {args.vocab}, T = 0.8, top-p {args.top_p}, {threads} threads; ms per step")
    print("| batch | rows | draw | host ms | device ms |")
    print("|---|---|---|---|---|")
    for b in [int(x) for x in args.batch.split(",")]:
        logits = torch.randn(b, args.vocab, device=dev)
        for seeded, draw in ((False, "inverse CDF"), (False, "exponential race"), (True, "inverse CDF")):
            rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=args.top_p, seed=i if seeded else None), (), (),
                                (), SeededStream(i) if seeded else None) for i in range(b)]
            sampler.inverse_cdf = race if draw == "exponential race" else inverse_cdf
            try:
                for s in range(5):
                    sampler.sample(probs_from_logits(logits, rows), rows, gen, positions=[s] * b)
                sync()
                host = 0.0
                t0 = time.perf_counter()
                for s in range(args.steps):
                    h = time.perf_counter()
                    sampler.sample(probs_from_logits(logits, rows), rows, gen, positions=[s] * b)
                    host += time.perf_counter() - h
                sync()
                dt = time.perf_counter() - t0
            finally:
                sampler.inverse_cdf = inverse_cdf
            print(f"| {b} | {'seeded' if seeded else 'unseeded'} | {draw} | {1e3 * host / args.steps:.3f} "
                  f"| {1e3 * dt / args.steps:.3f} |")


if __name__ == "__main__":
    main()
