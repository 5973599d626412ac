#!/usr/bin/env python
"""Where a CPU decode / verify forward goes: SmolLM2-135M fp32 through tandem's torch runner.

Prints, at a fixed context length:
1. the median 1-token decode forward time and the time spent in ``paged_attention`` per forward
   (wrapped where ``worker/attention.py::TorchAttention`` calls it), next to ``F.scaled_dot_product_attention`` on
   the same per-layer shapes (the attention math alone);
2. torch-profiler tables (self CPU time) of 5 decode and 5 (k+1)-token verify forwards;
3. the model's own linears + LM head called directly with 1, 2 and k+1 rows (twice, interleaved).

Usage: python benchmarks/cpu_forward_profile.py [--threads 1] [--ctx 250] [--k 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import smollm2_decode_and_verify  # noqa: E402


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from tandem.worker import attention as decoder  # TorchAttention calls attention.paged_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=250)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm, one, many, rows = smollm2_decode_and_verify(args.ctx, args.k)
    runner = llm.engine.runner
    arch = llm.engine.arch
    ctx, k = args.ctx, args.k
    for _ in range(3):
        runner.forward_logits(one, [0])
        runner.forward_logits(many, rows)

    # 1. attention share of a decode forward
    spent = {"s": 0.0, "n": 0}
    orig = decoder.paged_attention

    def timed_attention(*a, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            spent["s"] += time.perf_counter() - t0
            spent["n"] += 1

    decoder.paged_attention = timed_attention
    reps = 20
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.forward_logits(one, [0])
        times.append(time.perf_counter() - t0)
    decoder.paged_attention = orig
    h, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    q = torch.randn(1, h, 1, d)
    kk, vv = torch.randn(1, kvh, ctx, d), torch.randn(1, kvh, ctx, d)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    for _ in range(5):
        sdpa()
    t0 = time.perf_counter()
    for _ in range(300):
        sdpa()
    per_layer = (time.perf_counter() - t0) / 300
    print(f"threads {torch.get_num_threads()}, context {ctx}: decode forward median "
          f"{1e3 * statistics.median(times):.1f} ms; paged_attention {1e3 * spent['s'] / reps:.1f} ms per forward "
          f"({spent['n'] // reps} calls); SDPA on the same shapes {1e3 * per_layer:.3f} ms per layer "
          f"({1e3 * per_layer * arch.num_layers:.1f} ms per forward)")

    # 2. op tables
    for name, chunks, r in (("decode", one, [0]), (f"verify ({k + 1} tokens)", many, rows)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                runner.forward_logits(chunks, r)
        print(f"--- 5 × {name} forward")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

    # 3. linears alone
    model = runner.model
    inter = arch.intermediate_size

    @torch.inference_mode()
    def linears(m_rows: int, repeats: int = 5) -> float:
        x = torch.randn(m_rows, arch.hidden_size)
        h2 = torch.randn(m_rows, inter)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for layer in model.model.layers:
                layer.self_attn.qkv_proj(x)
                layer.self_attn.o_proj(x)
                layer.mlp.gate_up_proj(x)
                layer.mlp.down_proj(h2)
            model.compute_logits(x)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    for m_rows in (1, 2, k + 1, 1, 2, k + 1):
        print(f"all linears + LM head, {m_rows} row(s): {1e3 * linears(m_rows):.1f} ms")


if __name__ == "__main__":
    main()
