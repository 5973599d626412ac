#!/usr/bin/env python
"""Real SmolLM2-135M-Instruct in bf16 on the GPU: batch-1 decode speed with and without n-gram
speculation on HumanEval, and how often the greedy outputs of the two agree (and why not).

Four engines in one process (same GGUF, bf16, CUDA graphs): ``baseline`` (asynchronous decode, the
CUDA default), ``ngram`` (k, n-gram lengths as given, with the CUDA default acceptance gate: a
request drafts only while its acceptance pays for the verify steps, spec/gate.py), ``ngram_ungated``
(``disable_by_acceptance: false``: drafts every step, as vLLM) and ``baseline_sync`` (no asynchronous
decode; its outputs must equal the baseline's). Each HumanEval prompt runs alone (batch 1) through both, alternating which goes
first. Per run: decode tok/s = (tokens − 1) / (finish − first token), the steady state. Outputs:
identical, or the first position where they differ, with the baseline's top-2 log-probability gap
there, from an untimed re-run with logprobs (bf16 near-ties flip under the different accumulation
order of a k+1-row verify vs a 1-row decode: a small gap says that is what happened). Timed runs
request no logprobs; each engine first runs 4 prompts × 64 tokens untimed (graph captures, JIT).

Usage: python benchmarks/gpu_real_smol.py --gguf PATH [--humaneval PATH.jsonl.gz] [--num-prompts 20]
       [--max-tokens 256] [--k 4] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def run_one(llm, prompt: str, max_tokens: int, logprobs: int | None = None):  # type: ignore[no-untyped-def]
    from tandem import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    t0, t0m = time.perf_counter(), time.monotonic()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    total = time.perf_counter() - t0
    first = (out.metrics.get("first_token_time") or t0m) - t0m
    n = len(out.outputs[0].token_ids)
    return out, {"tokens": n, "seconds": total, "ttft_s": first, "decode_tok_s": (n - 1) / max(1e-9, total - first)}


def main() -> None:
    import torch

    from tandem import LLM
    from tandem.bench.datasets import load_humaneval_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--humaneval", default=None)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--suffix", action="store_true", help="also run suffix decoding (method suffix, k as given)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    prompts = load_humaneval_prompts(args.humaneval)[: args.num_prompts]
    common = dict(device=args.device, dtype=args.dtype, max_model_len=2048, kv_cache_memory_bytes=2 << 30,
                  enable_prefix_caching=False)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    t0 = time.perf_counter()
    engines = {"baseline": LLM(args.gguf, **common), "ngram": LLM(args.gguf, speculative_config=spec, **common),
               "ngram_ungated": LLM(args.gguf, speculative_config={**spec, "disable_by_acceptance": False}, **common),
               # the baseline without asynchronous decode (the way speculation steps run)
               "baseline_sync": LLM(args.gguf, async_scheduling=False, **common)}
    if args.suffix:  # suffix decoding: per-request tree + a global tree over earlier prompts' outputs
        engines["suffix"] = LLM(args.gguf, speculative_config={"method": "suffix", "num_speculative_tokens": args.k},
                                **common)
    print(f"device {torch.cuda.get_device_name(0) if args.device == 'cuda' else args.device}, torch {torch.__version__}; engines built in "
          f"{time.perf_counter() - t0:.1f} s; {len(prompts)} HumanEval prompts × {args.max_tokens} tokens, k={args.k}")
    for llm in engines.values():  # warm-up: graphs of every query length, Triton JIT of every shape
        for p in prompts[:4]:
            run_one(llm, p, 64)
    rows = []
    for i, p in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]  # alternate who goes first
        res = {name: run_one(engines[name], p, args.max_tokens) for name in order}
        (ob, mb), (on, mn), (os_, ms) = res["baseline"], res["ngram"], res["baseline_sync"]
        ou, mu = res["ngram_ungated"]
        assert os_.outputs[0].token_ids == ob.outputs[0].token_ids, "asynchronous decode changed the output"
        tb, tn = ob.outputs[0].token_ids, on.outputs[0].token_ids
        diff = next((j for j, (a, b) in enumerate(zip(tb, tn)) if a != b), None)
        gap = None
        if diff is not None:  # untimed re-run of the baseline with top-2 logprobs at every position
            lp = run_one(engines["baseline"], p, diff + 1, logprobs=2)[0].outputs[0].logprobs
            top = sorted(lp[diff].values(), key=lambda x: -x.logprob) if lp else []
            if len(top) >= 2:
                gap = top[0].logprob - top[1].logprob
        row = {"prompt": i, "base": mb, "ngram": mn, "ngram_ungated": mu, "base_sync": ms,
               "speedup": mb["seconds"] / mn["seconds"], "speedup_ungated": mb["seconds"] / mu["seconds"],
               "first_diff": diff, "top2_logprob_gap_at_diff": gap,
               "identical_ungated": ou.outputs[0].token_ids == tb,
               "ngram_drafted": on.outputs[0].num_draft_tokens, "ngram_accepted": on.outputs[0].num_accepted_tokens,
               "ungated_drafted": ou.outputs[0].num_draft_tokens, "ungated_accepted": ou.outputs[0].num_accepted_tokens}
        if "suffix" in res:
            osx, msx = res["suffix"]
            row.update(suffix=msx, identical_suffix=osx.outputs[0].token_ids == tb,
                       suffix_drafted=osx.outputs[0].num_draft_tokens, suffix_accepted=osx.outputs[0].num_accepted_tokens)
            print(f"           suffix {msx['decode_tok_s']:7.1f} tok/s, accepted {row['suffix_accepted']}/"
                  f"{row['suffix_drafted']}, {'identical' if row['identical_suffix'] else 'differs'}")
        rows.append(row)
        print(f"prompt {i:2d}: baseline {mb['decode_tok_s']:7.1f} tok/s (sync {ms['decode_tok_s']:7.1f}), "
              f"ngram {mn['decode_tok_s']:7.1f} tok/s "
              f"(x{row['speedup']:.2f} e2e), accepted {row['ngram_accepted']}/{row['ngram_drafted']}; ungated "
              f"{mu['decode_tok_s']:7.1f} tok/s (x{row['speedup_ungated']:.2f}), accepted "
              f"{row['ungated_accepted']}/{row['ungated_drafted']}; "
              + ("identical" if diff is None else f"first diff at token {diff} (top-2 gap {gap if gap is None else round(gap, 4)})"),
              flush=True)
    base_tok = sum(r["base"]["tokens"] for r in rows)
    summary = {
        "baseline_decode_tok_s_median": statistics.median(r["base"]["decode_tok_s"] for r in rows),
        "ngram_decode_tok_s_median": statistics.median(r["ngram"]["decode_tok_s"] for r in rows),
        "baseline_sync_decode_tok_s_median": statistics.median(r["base_sync"]["decode_tok_s"] for r in rows),
        "baseline_sync_e2e_tok_s": base_tok / sum(r["base_sync"]["seconds"] for r in rows),
        "baseline_e2e_tok_s": base_tok / sum(r["base"]["seconds"] for r in rows),
        "ngram_e2e_tok_s": base_tok / sum(r["ngram"]["seconds"] for r in rows),
        "ngram_ungated_decode_tok_s_median": statistics.median(r["ngram_ungated"]["decode_tok_s"] for r in rows),
        "ngram_ungated_e2e_tok_s": base_tok / sum(r["ngram_ungated"]["seconds"] for r in rows),
        "identical_outputs": sum(r["first_diff"] is None for r in rows),
        "identical_outputs_ungated": sum(r["identical_ungated"] for r in rows),
        "acceptance_ungated": (sum(r["ungated_accepted"] for r in rows)
                               / max(1, sum(r["ungated_drafted"] for r in rows))),
        "policy_shadow_drafts": engines["ngram"].engine.stats.spec.num_shadow_drafts,
        "policy_drafting_share": engines["ngram"].engine.stats.spec.drafting_share,
        "prompts": len(rows),
        "acceptance": sum(r["ngram_accepted"] for r in rows) / max(1, sum(r["ngram_drafted"] for r in rows)),
        "gaps_at_first_diff": [r["top2_logprob_gap_at_diff"] for r in rows if r["first_diff"] is not None],
        "first_diffs": [r["first_diff"] for r in rows if r["first_diff"] is not None],
    }
    summary["speedup_e2e"] = summary["ngram_e2e_tok_s"] / summary["baseline_e2e_tok_s"]
    # without the first-token times: a first-seen shape can stall one engine's prefill (a compile) and
    # swing the e2e ratio; decode time alone is what speculation changes
    def decode_s(key: str) -> float:
        return sum(r[key]["seconds"] - r[key]["ttft_s"] for r in rows)

    summary["speedup_decode"] = decode_s("base") / decode_s("ngram")
    summary["speedup_decode_ungated"] = decode_s("base") / decode_s("ngram_ungated")
    summary["speedup_e2e_ungated"] = summary["ngram_ungated_e2e_tok_s"] / summary["baseline_e2e_tok_s"]
    summary["max_ttft_s"] = {k: max(r[k]["ttft_s"] for r in rows) for k in ("base", "ngram", "ngram_ungated", "base_sync")}
    if args.suffix:
        summary["suffix_speedup_decode"] = decode_s("base") / decode_s("suffix")
        summary["suffix_decode_tok_s_median"] = statistics.median(r["suffix"]["decode_tok_s"] for r in rows)
        summary["suffix_acceptance"] = (sum(r["suffix_accepted"] for r in rows)
                                        / max(1, sum(r["suffix_drafted"] for r in rows)))
        summary["identical_outputs_suffix"] = sum(r["identical_suffix"] for r in rows)
        print(f"suffix k={args.k}: x{summary['suffix_speedup_decode']:.3f} in decode time vs the baseline; "
              f"decode {summary['suffix_decode_tok_s_median']:.1f} tok/s (median); acceptance "
              f"{summary['suffix_acceptance']:.1%}; identical outputs {summary['identical_outputs_suffix']}/{len(rows)}")
    print("\n| engine | decode tok/s (median) | e2e tok/s |\n|---|---|---|")
    print(f"| baseline | {summary['baseline_decode_tok_s_median']:.1f} | {summary['baseline_e2e_tok_s']:.1f} |")
    print(f"| baseline, synchronous decode | {summary['baseline_sync_decode_tok_s_median']:.1f} | "
          f"{summary['baseline_sync_e2e_tok_s']:.1f} |")
    print(f"| ngram k={args.k} (acceptance gate) | {summary['ngram_decode_tok_s_median']:.1f} | {summary['ngram_e2e_tok_s']:.1f} |")
    print(f"| ngram k={args.k}, ungated | {summary['ngram_ungated_decode_tok_s_median']:.1f} | "
          f"{summary['ngram_ungated_e2e_tok_s']:.1f} |")
    print(f"ungated: speedup x{summary['speedup_decode_ungated']:.3f} in decode time, x{summary['speedup_e2e_ungated']:.2f} "
          f"e2e; acceptance {summary['acceptance_ungated']:.1%}; identical outputs "
          f"{summary['identical_outputs_ungated']}/{summary['prompts']}. Gate: {summary['gate_shadow_drafts']} shadow "
          f"drafts scored, cost ratio {summary['gate_cost_ratio']}")
    print(f"speedup x{summary['speedup_decode']:.3f} in decode time (first tokens excluded; longest first token: "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in summary["max_ttft_s"].items()) + ")")
    print(f"speedup (e2e) x{summary['speedup_e2e']:.2f}; acceptance {summary['acceptance']:.1%}; identical outputs "
          f"{summary['identical_outputs']}/{summary['prompts']}; first diffs at {summary['first_diffs']} with "
          f"top-2 gaps {[None if g is None else round(g, 4) for g in summary['gaps_at_first_diff']]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
