"""An EAGLE head's step on the CPU: 1, 2 and 4 rows, warm and right after a target verify, per kernel variant.

The variants rebuild the engine's head in place, same process, alternating, median of ``--reps``:

- ``torch``: the head's float linears on ``layers.linear`` and torch's attention (before §48);
- ``skinny-f32``: the linears on ``cpu_skinny`` for 1–8 rows (``models/skinny_linear.py``), float32 weights;
- ``skinny-bf16``: ... reading the bf16 copy of weights that hold bf16 values (the shipped heads);
- ``+c-attn``: ... and the step's one request through ``worker/cpu_attention.py`` (the engine's default).

"After a verify" times the head step right after a 4-row target verify, as in an EAGLE round (the
target's weights have pushed the head's out of the caches). Prints a table (ms).

    PYTHONPATH=. python benchmarks/cpu_head_step.py [--quantization none] [--context 300] [--reps 90]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import date

import torch


def main() -> None:
    from tandem import LLM
    from tandem.models.layers import Linear
    from tandem.models.quant.attach import replace_module
    from tandem.models.skinny_linear import SkinnyLinear
    from tandem.worker.batch import SeqChunk

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle3")
    ap.add_argument("--quantization", default=None,
                    help="the target's (default: detected, the packed GGUF; none: float32, #15's CPU case)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="alternating passes over the variants")
    args = ap.parse_args()
    llm = LLM(args.target, device="cpu", dtype="float32", max_model_len=2048, kv_cache_memory_bytes=1 << 28,
              enable_prefix_caching=False, quantization=args.quantization,
              speculative_config={"model": args.head, "num_speculative_tokens": 3})
    eng = llm.engine
    runner, head_runner = eng.runner, eng.proposer.runner
    head = head_runner.head
    skinny = {name: m for name, m in head.named_modules() if isinstance(m, SkinnyLinear)}
    narrow = {name: m.narrow for name, m in skinny.items()}
    plain = {name: Linear(m.in_features, m.out_features, bias=m.bias is not None) for name, m in skinny.items()}
    for name, m in plain.items():
        m.weight, m.bias = skinny[name].weight, skinny[name].bias

    def variant(v: str) -> None:
        for name in skinny:
            replace_module(head, name, plain[name] if v == "torch" else skinny[name])
            skinny[name].narrow = None if v == "skinny-f32" else narrow[name]
        head_runner.attention.cpu_kernel = v == "+c-attn"

    n = args.context
    ids = [(7 * i) % 5000 + 100 for i in range(n)]
    blocks = list(range(0, (n + 64) // eng.scheduler.block_size + 2))
    runner.forward_logits([SeqChunk(ids, 0, blocks)], [n - 1])
    hidden_size = head.cfg.hidden_size

    def step(rows: int) -> None:
        head_runner.forward([SeqChunk(ids[-rows:], n - rows, blocks)], [rows - 1], torch.zeros(rows, hidden_size))

    def verify() -> None:
        runner.forward([SeqChunk(ids[-4:], n - 4, blocks)], range(4), argmax_only=True)

    variants = ["torch", "skinny-f32", "skinny-bf16", "+c-attn"]
    cells: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):
        for v in variants:
            variant(v)
            for rows in (1, 2, 4):
                step(rows)
                for cold in (False, True):
                    for _ in range(args.reps // args.rounds):
                        if cold:
                            verify()
                        t0 = time.perf_counter()
                        step(rows)
                        cells.setdefault((v, "after a verify" if cold else "warm", rows), []).append(
                            time.perf_counter() - t0)
    variant("+c-attn")
    print(f"{date.today()} {platform.processor() or platform.machine()}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; target {args.target} ({args.quantization or 'detected'}), head {args.head}, context {n}; "
          f"median ms of {args.reps} per cell")
    print("\n| variant | warm 1 row | 2 rows | 4 rows | after a verify 1 row | 2 rows | 4 rows |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        vals = [statistics.median(cells[(v, when, rows)]) * 1e3 for when in ("warm", "after a verify")
                for rows in (1, 2, 4)]
        print(f"| {v} | " + " | ".join(f"{x:.3f}" for x in vals) + " |")


if __name__ == "__main__":
    main()
