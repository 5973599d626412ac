#!/usr/bin/env python
"""Batch-invariant mode (issue #19): its speed as a fraction of the default mode, and how often greedy
outputs with and without speculation agree in each mode. On the GPU (default) or ``--device cpu``
(the torch path: every row alone).

Per model — the real SmolLM2-135M-Instruct (``--gguf``, bf16; HumanEval prompts with ``--humaneval``,
else random token prompts) and the dummy Llama-3.1-8B / 3.2-1B shapes (random weights, random token
prompts) — two engines in one process, default and ``batch_invariant=True``, each run:

- greedy, no speculation, the prompts one at a time (batch 1): the reference outputs;
- the same prompts all at once at concurrency 8 and 32 (``max_num_seqs``), no speculation;
- the same at batch 1, 8, 32 with n-gram speculation (k = 4, drafting every step);

and reports, per mode and cell, decode tokens/s (generated tokens / wall time of the batch), how
many outputs equal the batch-1 reference token for token, and the CUDA graph captures and Triton
compiles that happened during the cell (work done mid-serving: both should be 0). In batch-invariant mode every count must be
the full count (tests/worker/test_gpu_batch_invariant.py asserts it); in the default mode the bf16
differences between a k + 1-row verify, a batch of rows and a 1-row decode flip near-ties.

Usage: python benchmarks/gpu_batch_invariant.py [--gguf PATH] [--humaneval PATH] [--shapes smol,1b,8b]
       [--num-prompts 32] [--max-tokens 128] [--batches 1,8,32] [--device cuda|cpu] [--json OUT]
       [--modes default,invariant]
On CPU, ``--shapes smol`` without ``--gguf`` runs the built-in SmolLM2 GGUF (packed int4, the default).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


from _common import warm_state  # noqa: E402


def dummy_dir(root: Path, name: str) -> Path:
    import gpu_suite

    return gpu_suite.write_dummy_dir(root, name)


def run(llm, prompts, max_tokens: int, batch: int, spec: dict | None):  # type: ignore[no-untyped-def]
    from tandem import SamplingParams
    from tandem.config.speculative import SpeculativeConfig

    eng = llm.engine
    eng.spec = SpeculativeConfig.from_dict(spec) if spec else None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        res = llm.generate(prompts[i:i + batch], sp, use_tqdm=False)
        outs.extend(list(r.outputs[0].token_ids) for r in res)
    dt = time.perf_counter() - t0
    return outs, sum(len(o) for o in outs) / dt


def main() -> None:
    import torch

    from tandem import LLM
    from tandem.bench.datasets import load_humaneval_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--humaneval", default=None)
    ap.add_argument("--shapes", default="smol,1b,8b")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="default,invariant")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    name = "cpu" if cpu else torch.cuda.get_device_name(0)
    print(f"device {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="tandem_bi_"))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
            "disable_by_acceptance": False}
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        if shape == "smol" and (args.gguf or cpu):
            model, kw = args.gguf or "smollm2-135m-instruct", {}
            prompts: list = load_humaneval_prompts(args.humaneval)[: args.num_prompts] if args.humaneval else None
        else:
            name = {"smol": "smollm2-135m", "1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}[shape]
            model, kw, prompts = str(dummy_dir(root, name)), {"load_format": "dummy"}, None
        g = torch.Generator().manual_seed(0)
        for mode in args.modes.split(","):
            llm = LLM(model, dtype="float32" if cpu else "bfloat16", device=args.device, max_model_len=2048,
                      kv_cache_memory_bytes=(1 << 30) if cpu else (8 << 30),
                      enable_prefix_caching=False, batch_invariant=mode == "invariant",
                      speculative_config=spec, **kw)
            if prompts is None:
                vocab = llm.engine.arch.vocab_size
                prompts = [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=g).tolist()}
                           for n in torch.randint(16, 200, (args.num_prompts,), generator=g)]
            run(llm, prompts[:4], 16, 4, None)  # warm-up: graphs, JIT
            run(llm, prompts[:4], 16, 4, spec)
            ref, _ = run(llm, prompts, args.max_tokens, 1, None)
            for s in (None, spec):
                for b in batches:
                    g0, s0, v0 = warm_state(llm)
                    outs, tok_s = run(llm, prompts, args.max_tokens, b, s)
                    g1, s1, v1 = warm_state(llm)
                    same = sum(o == r for o, r in zip(outs, ref))
                    row = dict(model=shape, mode=mode, spec="ngram" if s else "none", batch=b, tok_s=tok_s,
                               identical=same, prompts=len(prompts), captures=g1 - g0, capture_s=s1 - s0,
                               compiles=v1 - v0)
                    rows.append(row)
                    print(f"{shape:5s} {mode:9s} {row['spec']:5s} b={b:2d}: {tok_s:9.1f} tok/s, identical to batch-1 "
                          f"reference {same}/{len(prompts)}; mid-run: {g1 - g0} graph captures ({s1 - s0:.2f} s), "
                          f"{v1 - v0} Triton compiles", flush=True)
            del llm
            if not cpu:
                torch.cuda.empty_cache()
    print("\n| model | speculation | batch | default tok/s | invariant tok/s | invariant / default | identical default | identical invariant |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["mode"] != "default":
            continue
        inv = next((x for x in rows if x["mode"] == "invariant" and all(x[k] == r[k] for k in ("model", "spec", "batch"))),
                   None)
        if inv is None:
            continue
        print(f"| {r['model']} | {r['spec']} | {r['batch']} | {r['tok_s']:.0f} | {inv['tok_s']:.0f} | "
              f"{inv['tok_s'] / r['tok_s']:.2f} | {r['identical']}/{r['prompts']} | {inv['identical']}/{inv['prompts']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
