#!/usr/bin/env python
"""What drawing a sampled step's tokens costs on the GPU: host time and device time per step.

``probs_from_logits`` + ``sample`` (temperature 0.8, top-p 0.95, the sweep's chat parameters) on
random [batch, vocab] logits, for unseeded rows (one draw from the engine's generator), seeded rows
(one keyed Triton launch for all of them, worker/triton_noise.py) and seeded rows drawn the way
they were before that kernel (a generator reseeded and a launch per row). ``host`` is the wall
time of queuing one step's sampling (nothing waits for the device: sample/upload.py); ``device``
is the time for ``--steps`` steps queued back to back, per step, synchronised at the end.

Usage: python benchmarks/gpu_sampling.py [--vocab 49152] [--batch 1,8,32,64] [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    from tandem import SamplingParams
    from tandem.sample.logits import probs_from_logits
    from tandem.sample.rows import SamplingRow
    from tandem.sample.sampler import Noise, sample
    from tandem.sample.seeded import SeededStream, keyed_generator

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    per_row = Noise.from_keys

    def per_row_keys(self: Noise, keys, device):  # the pre-kernel way: one generator and launch per row
        return torch.cat([self.from_generator(1, keyed_generator(k, device), device) for k in keys])

    print(f"vocab {args.vocab}, T = 0.8, top-p 0.95; ms per step")
    print("| batch | rows | host ms | device ms |")
    print("|---|---|---|---|")
    for b in [int(x) for x in args.batch.split(",")]:
        logits = torch.randn(b, args.vocab, device=dev)
        for name in ("unseeded", "seeded (keyed launch)", "seeded (per-row generators)"):
            seeded = name.startswith("seeded")
            rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.95, seed=i if seeded else None), (), (),
                                (), SeededStream(i) if seeded else None) for i in range(b)]
            Noise.from_keys = per_row_keys if "per-row" in name else per_row  # type: ignore[method-assign]
            try:
                for _ in range(10):
                    sample(probs_from_logits(logits, rows), rows, gen, positions=[5] * b)
                torch.cuda.synchronize()
                host = 0.0
                t0 = time.perf_counter()
                for s in range(args.steps):
                    h = time.perf_counter()
                    sample(probs_from_logits(logits, rows), rows, gen, positions=[s] * b)
                    host += time.perf_counter() - h
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            finally:
                Noise.from_keys = per_row  # type: ignore[method-assign]
            print(f"| {b} | {name} | {1e3 * host / args.steps:.3f} | {1e3 * dt / args.steps:.3f} |")


if __name__ == "__main__":
    main()
