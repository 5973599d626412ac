#!/usr/bin/env python
"""Probe: how much of a CPU decode / verify forward is lost in ``F.linear`` for few-row inputs.

On this machine's torch build (MKL sgemm, AVX2) ``F.linear(x, W)`` with x of 2..8 rows (a k+1
token verify at batch 1) reads the weights far slower than with 1 row, so verifying 5 tokens costs
~2× a 1-token decode although the model is memory-bound. Computing the same product as
``(W @ x.T).T`` takes another MKL path. This script measures, through tandem's own torch runner on
SmolLM2-135M fp32, the 1-token and (k+1)-token forward times with the model's linears as they are
("stock") and with every linear + the LM head routed through ``(W @ x.T).T`` when x has 2..8 rows
("wx"), interleaved repeat by repeat. It patches module instances in this process only; nothing in
tandem is changed. Also checks that the logits agree (max abs difference).

Usage: python benchmarks/cpu_linear_probe.py [--threads 1] [--k 4] [--ctx 250] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_load, loadavg, smollm2_decode_and_verify

MODE = {"wx": False}


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if MODE["wx"] and x.dim() == 2 and 2 <= x.shape[0] <= 8:
        y = torch.matmul(w, x.t()).t()
        return y + b if b is not None else y
    return F.linear(x, w, b)


def patch(model: torch.nn.Module) -> int:
    from tandem.models.layers import PackedLinear

    def routed(m: torch.nn.Module) -> Any:
        return lambda x: _linear(x, m.weight, m.bias)

    n = 0
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, PackedLinear)):
            mod.forward = routed(mod)  # type: ignore[method-assign]
            n += 1
    orig = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        if not MODE["wx"]:
            return orig(hidden)
        w = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        return _linear(hidden, w, None).float()

    model.compute_logits = compute_logits  # type: ignore[method-assign]
    return n + 1


def main() -> None:

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=250)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, load average {fmt_load(loadavg())}", flush=True)
    llm, one, many, rows = smollm2_decode_and_verify(args.ctx, args.k)
    runner = llm.engine.runner
    print(f"patched {patch(runner.model)} linear layers", flush=True)
    ctx, k = args.ctx, args.k
    res: dict[str, dict[str, list[float]]] = {m: {"decode": [], "verify": []} for m in ("stock", "wx")}
    outs: dict[str, Any] = {}
    for rep in range(args.repeats + 2):
        for mode in (("stock", "wx") if rep % 2 == 0 else ("wx", "stock")):
            MODE["wx"] = mode == "wx"
            t0 = time.perf_counter()
            runner.forward_logits(one, [0])
            t1 = time.perf_counter()
            outs[mode] = runner.forward_logits(many, rows)
            t2 = time.perf_counter()
            if rep >= 2:
                res[mode]["decode"].append(t1 - t0)
                res[mode]["verify"].append(t2 - t1)
    MODE["wx"] = False
    diff = (outs["stock"] - outs["wx"]).abs().max().item()
    same_argmax = bool((outs["stock"].argmax(-1) == outs["wx"].argmax(-1)).all())
    print(f"load average at end {fmt_load(loadavg())}")
    print(f"{'linears':<8} {'decode ms':>10} {'verify ms':>10} {'v':>6}   (k+1 = {k + 1} tokens, context {ctx})")
    for mode, d in res.items():
        dec, ver = statistics.median(d["decode"]), statistics.median(d["verify"])
        print(f"{mode:<8} {1e3 * dec:>10.1f} {1e3 * ver:>10.1f} {ver / dec - 1:>6.3f}")
    print(f"verify logits max |stock - wx| = {diff:.2e}, same argmax: {same_argmax}")


if __name__ == "__main__":
    main()
