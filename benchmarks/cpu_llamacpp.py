#!/usr/bin/env python
"""tandem vs llama.cpp on the CPU: the built-in SmolLM2-135M GGUF, batch 1, greedy, HumanEval prompts.

One run, side by side, each engine in its own child process (so each peak RSS is that engine's own,
load included), all on the same GGUF file, the same prompts and the same thread count:

- ``tandem fp32``          ``quantization="none"``: every tensor dequantized to float32 at load (the
                           path before issue #17);
- ``tandem packed``        the default: Q4_1 layer linears kept packed, int4pack kernel (bf16 activations);
- ``tandem packed+ngram``  the same with n-gram speculation (k = ``--k``, lookup 1..4);
- ``packed-floathead``     (not run by default) the default with ``screened_head`` off: the float32 LM
                           head for every row (the step before the screened head; its tokens must be
                           ``tandem packed``'s);
- ``fp32+ngram``           (not run by default) n-gram on the float32 path, for the losslessness check;
- ``llama.cpp``            llama-cpp-python on the same file, if ``import llama_cpp`` works; otherwise the
                           column is skipped with a note (it builds from source in ~15 minutes on a
                           2-core box: ``pip install llama-cpp-python``; never in CI).

Every request generates exactly ``--max-tokens`` tokens (tandem: ``ignore_eos``; llama.cpp: its token
generator is stopped after that many), so the work is identical. Reported per engine: tokens/s (all
generated tokens / all generate time, prefill included), the ratio to llama.cpp (or to tandem fp32 when
llama.cpp is missing), peak RSS of the process (``ru_maxrss``) and the load time. Greedy outputs are
compared with ``tandem packed``: n-gram must equal it token for token (lossless); fp32 and llama.cpp
are reported as the share of requests that agree in full and the mean first-divergence position.

Usage: python benchmarks/cpu_llamacpp.py [--num-prompts 5] [--max-tokens 128] [--threads 2] [--k 4]
       [--engines fp32,packed,packed+ngram,llama.cpp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "smollm2-135m-instruct"
ENGINES = ("fp32", "packed", "packed+ngram", "llama.cpp", "fp32+ngram", "packed-floathead", "packed-floathead+ngram")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=5, help="HumanEval prompts (the first N; default 5)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="torch / llama.cpp threads (default 2)")
    ap.add_argument("--k", type=int, default=4, help="n-gram speculative tokens (default 4)")
    ap.add_argument("--engines", default=",".join(ENGINES[:4]), help="comma-separated subset of " + ", ".join(ENGINES))
    ap.add_argument("--json", type=Path, default=None, help="also write every number here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one engine, print JSON
    return ap.parse_args(argv)


def prompts(n: int) -> list[str]:
    from tandem.bench.datasets import load_humaneval_prompts

    return load_humaneval_prompts()[:n]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---- workers (child processes) -----------------------------------------------------------------------

def run_tandem(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from tandem import LLM, SamplingParams

    kw: dict[str, Any] = {"device": "cpu"}
    if engine.startswith("fp32"):
        kw["quantization"] = "none"
    if engine.startswith("packed-floathead"):
        kw["runner_config"] = {"screened_head": False}
    if engine.endswith("+ngram"):
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    t0 = time.perf_counter()
    llm = LLM(MODEL, **kw)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    outputs, total = [], 0.0
    for p in prompts(args.num_prompts):
        t = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        total += time.perf_counter() - t
        outputs.append(list(out.token_ids))
    return {"outputs": outputs, "seconds": total, "load_s": load_s}


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import llama_cpp
    except ImportError as e:
        return {"skipped": f"llama-cpp-python is not installed ({e.msg}); pip install llama-cpp-python"}
    from tandem.loader.registry import resolve_model

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(resolve_model(MODEL)), n_ctx=2048, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    load_s = time.perf_counter() - t0
    outputs, total = [], 0.0
    for p in prompts(args.num_prompts):
        tokens = llm.tokenize(p.encode("utf-8"), add_bos=False)
        llm.reset()
        t = time.perf_counter()
        got: list[int] = []
        for tok in llm.generate(tokens, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            got.append(int(tok))
            if len(got) == args.max_tokens:
                break
        total += time.perf_counter() - t
        outputs.append(got)
    return {"outputs": outputs, "seconds": total, "load_s": load_s, "version": llama_cpp.__version__}


def worker(args: argparse.Namespace) -> None:
    res = run_llamacpp(args) if args.worker == "llama.cpp" else run_tandem(args.worker, args)
    res["peak_rss_mib"] = peak_rss_mib()
    print("RESULT " + json.dumps(res))


# ---- parent --------------------------------------------------------------------------------------------

def spawn(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", engine, "--num-prompts", str(args.num_prompts),
           "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "--k", str(args.k)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"skipped": f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(line[len("RESULT "):])


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from _common import fmt_load, loadavg, machine_info

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        sys.exit(f"unknown engine(s) {unknown}; choose from {ENGINES}")
    info = machine_info()
    la0 = loadavg()
    results = {e: spawn(e, args) for e in engines}
    la1 = loadavg()
    ran = {e: r for e, r in results.items() if "skipped" not in r}
    base_name = "llama.cpp" if "llama.cpp" in ran else ("fp32" if "fp32" in ran else None)
    tokens = args.num_prompts * args.max_tokens
    print(f"# tandem vs llama.cpp, {MODEL} GGUF, batch 1 greedy, {args.num_prompts} HumanEval prompts × "
          f"{args.max_tokens} tokens, {args.threads} threads")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; cpus {info['cpus']}, {info['mem_total']}, "
          f"torch {info['torch']}; load average before {fmt_load(la0)}, after {fmt_load(la1)}")
    print()
    ref = ran.get("packed", {}).get("outputs")
    print(f"| engine | tok/s | vs {base_name or '-'} | peak RSS MiB | load s | outputs vs tandem packed |")
    print("|---|---|---|---|---|---|")
    for e in engines:
        r = results[e]
        if "skipped" in r:
            print(f"| {e} | skipped: {r['skipped']} | | | | |")
            continue
        tps = tokens / r["seconds"]
        r["tok_s"] = tps
        ratio = f"{tps / (tokens / ran[base_name]['seconds']):.2f}×" if base_name else "-"
        agree = "-"
        if ref is not None and e != "packed":
            same = sum(o == g for o, g in zip(r["outputs"], ref))
            div = sum(first_divergence(o, g) for o, g in zip(r["outputs"], ref)) / len(ref)
            agree = f"{same}/{len(ref)} identical, mean first divergence {div:.0f}"
        print(f"| {e} | {tps:.1f} | {ratio} | {r['peak_rss_mib']:.0f} | {r['load_s']:.1f} | {agree} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "machine": info,
                                         "loadavg": [la0, la1], "results": results}, indent=1))


if __name__ == "__main__":
    main()
