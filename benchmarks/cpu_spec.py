#!/usr/bin/env python
"""CPU speculative decoding: SmolLM2-135M target, batch 1, greedy, HumanEval prompts.

Configs (one ``LLM`` each, all in this process, float32):
- ``baseline``     no speculation;
- ``ngram``        prompt lookup, k = 4, n-gram lengths 1..4;
- ``draft_model``  SmolLM2-135M drafting for itself, k = 4 (a correctness setup: the draft costs as
                   much as the target, so no speedup is possible; reported anyway).
Prompts run one at a time (batch 1), each config on the same prompt back to back in rotating
order, so all configs share the machine's background load. Every request generates exactly
``--max-tokens`` tokens (``ignore_eos``) so the work is identical; outputs are checked against the
baseline's (lossless greedy speculation must reproduce them token for token).

Reported per config: tokens/s (total tokens / total generate time, prefill included), speedup over
the baseline (ratio of total times; the median of per-prompt paired ratios is also given), τ (mean
tokens per verify step), per-position acceptance (fraction of drafts whose position i was
accepted), draft coverage (share of decode steps that carried a draft), and engine efficiency
η = measured speedup / cost-model speedup S, where (tandem.spec_decode.cost_model)
    S = (1 − α^{k+1}) / ((1 − α)(k·c + 1 + v))
- α: solved from the per-position acceptance p_i as Σ_{i=1..k} α^i = Σ_i p_i (= τ − 1);
- v: (time of one target forward over k + 1 query tokens / time of a 1-token decode forward) − 1,
     both through the engine's runner directly at the run's mean context length (median of
     interleaved repeats);
- c: draft_model: draft runner 1-token forward / target runner 1-token forward (same method);
     ngram: proposer wall time per propose call (timed inside the engine run) / (k × the target's
     1-token decode forward time);
  also printed: c_eff, the in-engine proposer time per call / (k × target decode forward), for
  both proposers.
Note that S describes steps that all carry k drafts; n-gram steps without a match are plain decodes,
which S does not model (their share is the "coverage" column).

Usage: python benchmarks/cpu_spec.py [--threads 1] [--num-prompts 10] [--max-tokens 128]
       [--k 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_load, loadavg, machine_info

MODEL = "smollm2-135m-instruct"


class Timed:
    """Wraps a bound method on an instance, summing wall time and counting calls."""

    def __init__(self, obj: Any, attr: str) -> None:
        self.obj, self.attr = obj, attr
        self.inner = getattr(obj, attr)
        self.total = 0.0
        self.calls = 0
        setattr(obj, attr, self)

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner(*a, **kw)
        finally:
            self.total += time.perf_counter() - t0
            self.calls += 1

    def reset(self) -> None:
        self.total, self.calls = 0.0, 0


def build(name: str, k: int, lookup_max: int) -> Any:
    from tandem import LLM

    spec: dict[str, Any] | None = None
    if name == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                "prompt_lookup_max": lookup_max}
    elif name == "draft_model":
        spec = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": k}
    return LLM(MODEL, device="cpu", dtype="float32", max_model_len=2048, kv_cache_memory_bytes=512 << 20,
               speculative_config=spec)


def runner_times(target_runner: Any, draft_runner: Any | None, ctx: int, k: int, block_size: int,
                 repeats: int) -> dict[str, float]:
    """Median times of target 1-token and (k+1)-token forwards (and the draft's 1-token forward) at
    context ``ctx``, through the runner's forward_logits, interleaved. Uses blocks 0.. directly: no
    request holds any block between generate calls, so the writes land in free blocks."""
    from tandem.worker.batch import SeqChunk

    blocks = list(range(math.ceil((ctx + k + 1) / block_size)))
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 20000, (ctx + k + 1,), generator=g).tolist()
    # fill the context once so attention reads real values
    target_runner.forward_logits([SeqChunk(prefix[:ctx], 0, blocks)], [ctx - 1])
    if draft_runner is not None:
        draft_runner.forward_logits([SeqChunk(prefix[:ctx], 0, blocks)], [ctx - 1])
    one = [SeqChunk(prefix[ctx:ctx + 1], ctx, blocks)]
    many = [SeqChunk(prefix[ctx:ctx + k + 1], ctx, blocks)]
    rows_many = list(range(k + 1))
    t1, tk, td = [], [], []
    for _ in range(2):  # warm-up
        target_runner.forward_logits(one, [0])
        target_runner.forward_logits(many, rows_many)
    for _ in range(repeats):
        a = time.perf_counter()
        target_runner.forward_logits(one, [0])
        b = time.perf_counter()
        target_runner.forward_logits(many, rows_many)
        c = time.perf_counter()
        t1.append(b - a)
        tk.append(c - b)
        if draft_runner is not None:
            d0 = time.perf_counter()
            draft_runner.forward_logits(one, [0])
            td.append(time.perf_counter() - d0)
    out = {"decode_s": statistics.median(t1), "verify_s": statistics.median(tk)}
    if td:
        out["draft_decode_s"] = statistics.median(td)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem import SamplingParams
    from tandem.bench.compare_table import estimate_alpha
    from tandem.bench.datasets import sample_requests
    from tandem.spec_decode.cost_model import cost_model_speedup

    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info()
    print(f"machine: {info['cpus']} CPUs, {info['mem_total']}, torch {info['torch']}, torch threads "
          f"{info['torch_threads']}; load average at start: {fmt_load(info['loadavg'])}", flush=True)
    names = ["baseline", "ngram", "draft_model"]
    llms = {}
    for n in names:
        t0 = time.perf_counter()
        llms[n] = build(n, args.k, args.lookup_max)
        print(f"{n} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    tok = llms["baseline"].get_tokenizer()
    reqs = sample_requests("humaneval", tok, args.num_prompts, seed=args.seed, output_len=args.max_tokens)
    prompts = [list(tok.encode(r.prompt, add_special_tokens=True)) for r in reqs]
    N = args.max_tokens
    sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    print(f"{len(prompts)} HumanEval prompts (seed {args.seed}), lengths {[len(p) for p in prompts]}, "
          f"{N} tokens each, k={args.k}", flush=True)

    proposer_timers = {n: Timed(llms[n].engine.proposer, "propose_requests")
                       for n in names if llms[n].engine.proposer is not None}
    fwd_timers = {n: Timed(llms[n].engine.runner, "forward_logits") for n in names}
    for n in names:  # warm-up
        llms[n].generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(temperature=0.0, max_tokens=8),
                         use_tqdm=False)
    for t in (*proposer_timers.values(), *fwd_timers.values()):
        t.reset()
    spec_before = {n: llms[n].engine.stats.spec.copy() for n in names}
    steps_before = {n: llms[n].engine.stats.num_steps for n in names}

    times: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    loads = [loadavg()]
    for i, p in enumerate(prompts):
        order = names[i % 3:] + names[:i % 3]
        for n in order:
            t0 = time.perf_counter()
            out = llms[n].generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            times[n].append(time.perf_counter() - t0)
            outputs[n].append(list(out.outputs[0].token_ids))
        loads.append(loadavg())
        print(f"  prompt {i + 1}/{len(prompts)}: "
              + ", ".join(f"{n} {N / times[n][-1]:.2f} tok/s" for n in names)
              + f"  (load {loads[-1][0]:.2f})", flush=True)

    fwd = {n: (t.total, t.calls) for n, t in fwd_timers.items()}  # before the runner probes below
    # Runner-level step costs at the run's mean context length.
    ctx = int(statistics.mean(len(p) for p in prompts) + N / 2)
    draft_runner = getattr(llms["draft_model"].engine.proposer, "runner", None)
    rt = runner_times(llms["baseline"].engine.runner, draft_runner, ctx, args.k,
                      llms["baseline"].engine.block_size, args.runner_repeats)
    loads.append(loadavg())
    v = max(0.0, rt["verify_s"] / rt["decode_s"] - 1.0)

    from tandem.bench.offline import spec_summary

    base_total = sum(times["baseline"])
    base_steps = llms["baseline"].engine.stats.num_steps - steps_before["baseline"]
    rows = []
    for n in names:
        eng = llms[n].engine
        total = sum(times[n])
        steps = eng.stats.num_steps - steps_before[n]
        spec = spec_summary(spec_before[n], eng.stats.spec)
        paired = [b / t for b, t in zip(times["baseline"], times[n])]
        row: dict[str, Any] = {
            "config": n, "tok_s": N * len(prompts) / total, "total_s": total,
            "speedup": base_total / total, "speedup_paired_median": statistics.median(paired),
            "steps": steps, "lossless": outputs[n] == outputs["baseline"],
            "mismatched_prompts": sum(a != b for a, b in zip(outputs[n], outputs["baseline"])),
            "target_forward_s_per_step": fwd[n][0] / max(fwd[n][1], 1),
            "engine_s_per_step": total / max(steps, 1),
        }
        if spec is not None:
            k = args.k
            per_pos = spec["per_position_acceptance_rates"]
            alpha = estimate_alpha(sum(per_pos), k)
            pt = proposer_timers[n]
            c_eff = (pt.total / max(pt.calls, 1)) / (k * rt["decode_s"])
            if n == "draft_model":
                c = rt["draft_decode_s"] / rt["decode_s"]
                c_src = "draft runner / target runner, 1-token forward"
            else:
                c, c_src = c_eff, "proposer time per call / (k × target decode forward)"
            s_model = cost_model_speedup(alpha, k, c, v)
            # decode steps = steps minus the prefill step of each prompt
            decode_steps = steps - len(prompts)
            row.update({
                "tau": spec["mean_acceptance_length"], "acceptance_rate": spec["acceptance_rate"],
                "per_position": per_pos, "num_drafts": spec["num_drafts"],
                "coverage": spec["num_drafts"] / max(decode_steps, 1), "alpha": alpha, "k": k,
                "c": c, "c_source": c_src, "c_eff": c_eff, "v": v,
                "proposer_s_per_call": pt.total / max(pt.calls, 1), "proposer_calls": pt.calls,
                "model_speedup": s_model, "eta": row["speedup"] / s_model,
            })
        rows.append(row)

    result = {
        "machine": info, "threads": torch.get_num_threads(), "num_prompts": len(prompts), "max_tokens": N,
        "k": args.k, "prompt_lens": [len(p) for p in prompts], "mean_context": ctx, "runner": rt, "v": v,
        "baseline_steps": base_steps, "rows": rows, "times": times, "loadavg": loads,
    }
    print_table(result)
    return result


def print_table(res: dict[str, Any]) -> None:
    la = res["loadavg"]
    rt = res["runner"]
    print()
    print(f"=== SmolLM2-135M fp32, batch 1, greedy, HumanEval {res['num_prompts']} prompts × "
          f"{res['max_tokens']} tokens, k={res['k']}, {res['threads']} torch thread(s) ===")
    print(f"load average (1 min) during the run: {min(x[0] for x in la):.2f} – {max(x[0] for x in la):.2f}")
    print(f"runner at context {res['mean_context']}: decode forward {1e3 * rt['decode_s']:.1f} ms, "
          f"verify ({res['k'] + 1} tokens) {1e3 * rt['verify_s']:.1f} ms → v = {res['v']:.3f}"
          + (f"; draft decode forward {1e3 * rt['draft_decode_s']:.1f} ms" if "draft_decode_s" in rt else ""))
    head = (f"{'config':<12} {'tok/s':>6} {'speedup':>7} {'paired':>6} {'tau':>5} {'acc%':>5} {'cover':>5} "
            f"{'alpha':>5} {'c':>6} {'c_eff':>6} {'v':>5} {'S':>5} {'eta':>5} {'lossless':>8}  per-position")
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        def f(key: str, spec: str, r: dict[str, Any] = r) -> str:
            return "-" if key not in r else format(r[key], spec)

        per_pos = ", ".join(f"{x:.2f}" for x in r.get("per_position", []))
        print(f"{r['config']:<12} {r['tok_s']:>6.2f} {r['speedup']:>7.2f} {r['speedup_paired_median']:>6.2f} "
              f"{f('tau', '.2f'):>5} {('-' if 'acceptance_rate' not in r else format(100 * r['acceptance_rate'], '.1f')):>5} "
              f"{f('coverage', '.2f'):>5} {f('alpha', '.3f'):>5} {f('c', '.4f'):>6} {f('c_eff', '.4f'):>6} "
              f"{f('v', '.3f'):>5} {f('model_speedup', '.2f'):>5} {f('eta', '.2f'):>5} "
              f"{r['lossless']!s:>8}  {per_pos}")
    print("engine time per step (total generate time / steps) vs target forward per step:")
    for r in res["rows"]:
        extra = f", proposer {1e3 * r['proposer_s_per_call']:.2f} ms/call" if "proposer_s_per_call" in r else ""
        print(f"  {r['config']:<12} {1e3 * r['engine_s_per_step']:.1f} ms/step over {r['steps']} steps, "
              f"target forward {1e3 * r['target_forward_s_per_step']:.1f} ms/step{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runner-repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1), encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
