#!/usr/bin/env python
"""Where a decode / verify step's GPU time goes, kernel by kernel, under runner variants.

For a dummy-weight model of a public shape (``gpu_suite.py``'s shapes) and steps of (batch, query
rows) at one context length, prints

- the graph replay time of each step under each runner variant (``RunnerConfig`` fields given as
  JSON), with the step's cost over the 1-row decode of the same variant (``v`` for a verify);
- for the first variant, the device time per step of each kernel family (the eager fused forward
  under ``torch.profiler``: the same kernels the graph replays), so the rows that grow with the query
  length show.

``--gemv-configs FILE`` adds variants: the default runner with the per-row skinny kernel's config
replaced per weight shape and fusion (the same config at every row count). The file is a list of
``[N, K, fusion, [BLOCK_N, BLOCK_K, num_warps, defer]]`` (what ``gpu_gemv.py --sweep-small ...
--small-json FILE`` writes; variant "swept configs") or a dict of such lists by variant name.

Usage: python benchmarks/gpu_step_kernels.py [--model smollm2-135m] [--steps 1x1,1x2,1x4,1x5,1x6]
       [--ctx 256] [--variants '{"default": {}, "tensor cores": {"skinny_multirow": "dot"}}']
       [--gemv-configs FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite  # noqa: E402


def family(name: str) -> str:
    """A kernel's family: its name without template arguments, launch suffixes or numbers."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"_\d+(d\d+)*$", "", name)
    return name[:60]


@torch.inference_mode()
def kernel_profile(runner: Any, batch: int, q: int, ctx: int, iters: int = 5) -> dict[str, float]:
    """µs of device time per step by kernel family (eager forward, no graphs)."""
    from torch.profiler import ProfilerActivity, profile

    chunks, rows = gpu_suite._chunks(runner, batch, q, ctx)
    for _ in range(3):
        runner.forward_logits(chunks, rows)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            runner.forward_logits(chunks, rows)
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
        if t > 0 and ev.device_type == torch.autograd.DeviceType.CUDA:
            out[family(ev.key)] += t / iters
    return dict(out)


def patch_gemv(sets: dict[str, list[list[Any]]], current: list[Any]) -> None:
    """Route the layer kernels' per-row ``gemv`` calls through the config of their shape and fusion
    in the set named ``current[0]`` (none: unchanged)."""
    import tandem.worker.cuda_kernels as ck
    from tandem.worker.triton_gemv import fusion_key

    # gpu_gemv.py names fusions "norm_gated", triton_gemv "norm+gated"
    tables = {name: {(n, k, f.replace("_", "+")): cfg for n, k, f, cfg in configs} for name, configs in sets.items()}
    orig = ck.gemv

    def gemv(x: torch.Tensor, weight: Any, bias: Any = None, **kw: Any) -> torch.Tensor:
        fusion = fusion_key(kw.get("norm_weight") is not None, bool(kw.get("gated")), kw.get("residual") is not None)
        table = tables.get(current[0], {})
        cfg = None if kw.get("dot") else table.get((weight.shape[0], weight.shape[1], fusion))
        if cfg is not None:
            kw = {**kw, "config": tuple(cfg[:3]), "defer": bool(cfg[3])}
        return orig(x, weight, bias, **kw)

    ck.gemv = gemv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(gpu_suite.SHAPES))
    ap.add_argument("--steps", default="1x1,1x2,1x4,1x5,1x6", help="batch x query rows, comma-separated")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--variants", default='{"default": {}}', help="JSON: name -> RunnerConfig fields")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--gemv-configs", type=Path, default=None)
    args = ap.parse_args()
    from tandem.config import RunnerConfig
    from tandem.worker.gpu_runner import GpuModelRunner

    steps = [tuple(int(v) for v in s.split("x")) for s in args.steps.split(",")]
    variants = json.loads(args.variants)
    sets = json.loads(args.gemv_configs.read_text()) if args.gemv_configs else {}
    sets = {"swept configs": sets} if isinstance(sets, list) else sets
    patched: list[Any] = [None]
    patch_gemv(sets, patched)
    variants.update({name: {} for name in sets})
    llm = gpu_suite.make_llm(gpu_suite.write_dummy_dir(Path("/tmp/tandem_gpu_suite"), args.model), kv_gib=2.0)
    eng = llm.engine
    replay: dict[str, dict[str, float]] = {}
    profiles: dict[str, dict[str, float]] = {}
    for vi, (label, kw) in enumerate(variants.items()):
        patched[0] = label
        runner = GpuModelRunner(eng.model, eng.runner.kv_caches, eng.block_size, eng.device, RunnerConfig(**kw))
        for b, q in steps:
            r = gpu_suite.time_runner(runner, b, q, args.ctx, iters=30)
            replay.setdefault(label, {})[f"{b}x{q}"] = r.get("gpu_ms", float("nan"))
            print(f"[replay] {label} b={b} q={q}: {r.get('gpu_ms', float('nan')):.4f} ms (step {r['step_ms']:.3f} ms)",
                  flush=True)
        if vi == 0:
            eager = GpuModelRunner(eng.model, eng.runner.kv_caches, eng.block_size, eng.device,
                                   RunnerConfig(**{**kw, "cuda_graphs": False}))
            for b, q in steps:
                profiles[f"{b}x{q}"] = kernel_profile(eager, b, q, args.ctx)
            del eager
        del runner
        torch.cuda.empty_cache()
    cols = [f"{b}x{q}" for b, q in steps]
    print(f"\n# {args.model} (dummy bf16 weights), context {args.ctx}, {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}")
    print("\n## Graph replay, ms per step (cost over the same variant's 1x1 decode)\n")
    print("| variant | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for label, row in replay.items():
        base = row.get("1x1")
        cells = [f"{row[c]:.3f}" + (f" (+{row[c] / base - 1:.0%})" if base and c != "1x1" else "") for c in cols]
        print(f"| {label} | " + " | ".join(cells) + " |")
    first = next(iter(variants))
    print(f"\n## Device µs per step by kernel family ({first}, eager forward under torch.profiler)\n")
    fams = sorted({f for p in profiles.values() for f in p}, key=lambda f: -max(p.get(f, 0.0) for p in profiles.values()))
    print("| kernel | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for f in fams[:20]:
        print(f"| {f} | " + " | ".join(f"{profiles[c].get(f, 0.0):.1f}" for c in cols) + " |")
    print("| **sum** | " + " | ".join(f"{sum(profiles[c].values()):.1f}" for c in cols) + " |")
    if args.json:
        args.json.write_text(json.dumps({"replay_ms": replay, "kernel_us": profiles}, indent=1))


if __name__ == "__main__":
    main()
