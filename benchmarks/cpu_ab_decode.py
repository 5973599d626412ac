#!/usr/bin/env python
"""Two tandem source trees side by side on the CPU: batch-1 greedy decode of the built-in GGUF, alternating.

Each tree (``--a``, ``--b``: repository roots, e.g. a worktree of the base commit and this one) runs in
its own long-lived child process (``PYTHONPATH`` = the tree), one engine per mode (``plain``: no
speculation; ``ngram``: n-gram speculation, k = ``--k``). The parent asks the children for one request
at a time, A then B then A ..., so they never run concurrently and a load spike on the shared machine
hits both alike. Every request generates exactly ``--max-tokens`` tokens (``ignore_eos``).

Printed per tree and mode: tok/s (generated tokens / generate time, prefill included, summed over all
rounds), tok/s from each prompt's fastest round (the least disturbed estimate on a shared machine),
the per-round spread, peak RSS of the child (``ru_maxrss``: both engines of the tree), and
whether the two trees' greedy outputs are identical token for token.

Usage: python benchmarks/cpu_ab_decode.py --a /work/wt-base --b . [--num-prompts 3] [--max-tokens 128]
       [--rounds 2] [--threads 2] [--k 4] [--modes plain,ngram] [--extra-b '{"lm_head_dtype": "float16"}']
       (a ``speculative_config`` in ``--extra-a`` / ``--extra-b`` is merged into that tree's n-gram config,
       e.g. ``--a . --b . --extra-b '{"speculative_config": {"num_speculative_tokens": 3}}'``)
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

MODEL = "smollm2-135m-instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", type=Path, required=False, help="tree A (repository root)")
    ap.add_argument("--b", type=Path, required=False, help="tree B (repository root)")
    ap.add_argument("--extra-a", default="{}", help="JSON: extra LLM(...) keyword arguments for A")
    ap.add_argument("--extra-b", default="{}", help="JSON: extra LLM(...) keyword arguments for B")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--modes", default="plain,ngram")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---- child ---------------------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from tandem import LLM, SamplingParams
    from tandem.bench.datasets import load_humaneval_prompts

    extra = json.loads(args.extra)
    spec_extra = extra.pop("speculative_config", {})  # merged into the n-gram mode's config
    engines = {}
    for mode in args.modes.split(","):
        kw: dict[str, Any] = {"device": "cpu", **extra}
        if mode == "ngram":
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 4, **spec_extra}
        engines[mode] = LLM(MODEL, **kw)
        engines[mode].generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    prompts = load_humaneval_prompts()[:args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print("READY", flush=True)
    for line in sys.stdin:
        mode, i = line.split()
        t0 = time.perf_counter()
        out = engines[mode].generate([prompts[int(i)]], params, use_tqdm=False)[0].outputs[0]
        dt = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps({"s": dt, "tokens": list(out.token_ids), "rss": rss}), flush=True)


# ---- parent --------------------------------------------------------------------------------------------

class Child:
    def __init__(self, tree: Path, extra: str, args: argparse.Namespace) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--extra", extra,
               "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
               "--threads", str(args.threads), "--k", str(args.k), "--modes", args.modes]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"child exited ({self.proc.wait()})")

    def run(self, mode: str, i: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{mode} {i}\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import fmt_load, loadavg, machine_info

    info, la0 = machine_info(), loadavg()
    children = {"A": Child(args.a, args.extra_a, args), "B": Child(args.b, args.extra_b, args)}
    modes = args.modes.split(",")
    secs = {(c, m): [] for c in children for m in modes}  # per round
    best = {(c, m, i): float("inf") for c in children for m in modes for i in range(args.num_prompts)}
    outs: dict[tuple[str, str], list[list[int]]] = {(c, m): [] for c in children for m in modes}
    rss = {c: 0.0 for c in children}
    for rnd in range(args.rounds):
        for m in modes:
            per = {c: 0.0 for c in children}
            for i in range(args.num_prompts):
                order = ("A", "B") if (rnd + i) % 2 == 0 else ("B", "A")
                for c in order:
                    r = children[c].run(m, i)
                    per[c] += r["s"]
                    best[(c, m, i)] = min(best[(c, m, i)], r["s"])
                    rss[c] = max(rss[c], r["rss"])
                    if rnd == 0:
                        outs[(c, m)].append(r["tokens"])
            for c in children:
                secs[(c, m)].append(per[c])
    for c in children.values():
        c.close()
    la1 = loadavg()
    tokens = args.num_prompts * args.max_tokens
    print(f"# A/B batch-1 greedy, {MODEL} GGUF, {args.num_prompts} HumanEval prompts × {args.max_tokens} tokens, "
          f"{args.rounds} rounds alternating, {args.threads} threads")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; cpus {info['cpus']}, {info['mem_total']}, "
          f"torch {info['torch']}; load average before {fmt_load(la0)}, after {fmt_load(la1)}")
    print(f"# A = {args.a} {args.extra_a}; B = {args.b} {args.extra_b}")
    print()
    print("| tree | mode | tok/s (all rounds) | tok/s (best round per prompt) | per round tok/s | peak RSS MiB "
          "| outputs A = B |")
    print("|---|---|---|---|---|---|---|")

    def best_tps(c: str, m: str) -> float:
        return tokens / sum(best[(c, m, i)] for i in range(args.num_prompts))

    for m in modes:
        same = sum(a == b for a, b in zip(outs[("A", m)], outs[("B", m)]))
        for c in children:
            s = secs[(c, m)]
            per_round = ", ".join(f"{tokens / x:.1f}" for x in s)
            print(f"| {c} | {m} | {tokens * len(s) / sum(s):.1f} | {best_tps(c, m):.1f} | {per_round} | "
                  f"{rss[c]:.0f} | {same}/{args.num_prompts} |")
    for m in modes:
        a = tokens * len(secs[("A", m)]) / sum(secs[("A", m)])
        b = tokens * len(secs[("B", m)]) / sum(secs[("B", m)])
        print(f"# {m}: B / A = {b / a:.2f}× (all rounds), {best_tps('B', m) / best_tps('A', m):.2f}× (best rounds)")


if __name__ == "__main__":
    main()
