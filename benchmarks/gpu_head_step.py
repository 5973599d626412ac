"""An EAGLE head's steps on CUDA, per layer-kernel choice: a proposal of k graphed steps (the first
from the target's features, then chain steps of one row), at batch 1 and 8.

No target weights: the head (the shipped SmolLM2 head by default) is bound to a random embedding of
the target's shape and reads random features, so it runs where the real target is not at hand. Two
runners over the same head, built the same way except for their layer kernels:

- ``torch``: the head's linears on cuBLAS and its norms as torch ops (before: ~40 launches a step);
- ``fused``: the target's CUDA kernels (``worker/cuda_kernels.py``: skinny Triton matmuls with the
  norms and residual adds fused in, the norm and the LM head in one) — the runner's default.

Each cell: the median over ``--rounds`` (alternating variants) of the mean wall time per step over
``--reps`` back-to-back proposals, synchronised at the end (so a step costs max(host, device)).
Prints a table (µs per step).

    PYTHONPATH=. python benchmarks/gpu_head_step.py [--head smollm2-135m-instruct-eagle3] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch


def main() -> None:
    from tandem.kv.feature_cache import FeatureCache
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.loader.arch import ModelArch
    from tandem.loader.eagle import load_eagle_head, read_eagle_config
    from tandem.loader.heads import resolve_head
    from tandem.worker.batch import SeqChunk
    from tandem.worker.gpu_head_runner import GpuHeadRunner

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    ap.add_argument("--target-layers", type=int, default=30, help="the target's layer count (SmolLM2-135M: 30)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev, bs, dtype = torch.device("cuda"), 16, torch.bfloat16
    hdir = resolve_head(args.head)
    layer = json.loads((Path(hdir) / "config.json").read_text())["transformer_layer_config"]
    arch = ModelArch.from_hf({**layer, "num_hidden_layers": args.target_layers})
    cfg = read_eagle_config(hdir, arch)
    head = load_eagle_head(cfg, 4096, dtype, dev)
    emb = torch.nn.Embedding(arch.vocab_size, arch.hidden_size).to(dev, dtype)
    head.bind_target(emb, None, emb.weight)
    batch, n = 8, args.context
    blocks_per = -(-(n + 2 * args.k + 8) // bs)
    num_blocks = batch * blocks_per + 1
    width = len(cfg.feature_layers(arch.num_layers)) * arch.hidden_size
    features = FeatureCache(width, num_blocks, bs, dtype, dev)
    features.rows.normal_()

    def runner(fused: bool) -> GpuHeadRunner:
        kv = allocate_kv_cache(cfg.layer, num_blocks, bs, dtype, dev)[0]
        r = GpuHeadRunner(head, kv, bs, dev, max_model_len=n + 64, lookahead=args.k + 1, features=features)
        r.fused = fused
        r.warm_up([1, batch], list(range(1, args.k + 2)))
        return r

    runners = {"torch": runner(False), "fused": runner(True)}
    blocks = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(batch)]
    ids = [(7 * i) % 5000 + 100 for i in range(n + args.k + 1)]
    for r in runners.values():  # the head's KV over the context (eager catch-ups)
        r.forward([SeqChunk(ids[:n], 0, b) for b in blocks], [(i + 1) * n - 1 for i in range(batch)], None)

    def proposal(r: GpuHeadRunner, b: int) -> None:
        chunks = [SeqChunk(ids[n:n + 1], n, blocks[i]) for i in range(b)]
        step = r.forward(chunks, list(range(b)), None)  # the first step: from the features
        for j in range(1, args.k):
            chunks = [SeqChunk(ids[n + j:n + j + 1], n + j, blocks[i]) for i in range(b)]
            step = r.forward(chunks, list(range(b)), step.feedback, token_ids=step.token_ids)

    cells: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, r in runners.items():
            for b in (1, batch):
                proposal(r, b)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    proposal(r, b)
                torch.cuda.synchronize()
                cells.setdefault((name, b), []).append((time.perf_counter() - t0) / (args.reps * args.k))
    print(f"{date.today()} {torch.cuda.get_device_name()}, torch {torch.__version__}; head {args.head}, "
          f"bf16, k = {args.k}, context {n}; µs per head step (median of {args.rounds} rounds of {args.reps} proposals)")
    print("\n| layer kernels | batch 1 | batch 8 |\n|---|---|---|")
    for name in runners:
        print(f"| {name} | " + " | ".join(f"{statistics.median(cells[(name, b)]) * 1e6:.1f}" for b in (1, batch)) + " |")


if __name__ == "__main__":
    main()
