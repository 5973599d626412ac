#!/usr/bin/env python
"""Offline throughput with and without admission in groups (``SchedulerConfig.admission_group``).

More requests than seats (``--num-prompts`` > ``max_num_seqs``): with ``admission_group`` 1 a request
is admitted as soon as a seat frees, so almost every step carries a prefill — on CUDA an eager
forward that also breaks the asynchronous decode chain; with groups, steps between admissions stay
chained graph replays. Each setting gets a new engine per round (rounds alternate); the timed part is
one ``LLM.generate`` over ShareGPT prompts (tandem's benchmark loader: the first ``--num-prompts``
after the seed shuffle that pass vLLM's length filter), greedy, ``--max-tokens`` each, no text.

On CPU (no graphs) the default is 1 and the setting changes little; this measures the GPU case:

    python benchmarks/admission_groups.py --model smollm2-135m-instruct --device cuda --num-prompts 1500

Prints tokens/s per round, chained steps and steps, and the output tokens (bf16 outputs may differ
between settings where another batch composition rounds differently).
"""

from __future__ import annotations

import argparse
import statistics
import time


def prompts_from_file(path: str) -> list[str]:
    """The ``prompt`` of each non-empty line of a JSONL file (gzip when it ends in .gz)."""
    import gzip
    import json
    from pathlib import Path

    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if path.endswith(".gz") else raw).decode()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--groups", default="1,default", help="comma-separated admission_group values; 'default' = auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=8.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompts", default=None,
                    help="JSONL of {'prompt': ...} (.gz allowed) instead of the ShareGPT package: the first "
                         "--num-prompts whose tokens fit max_model_len - max_tokens, in file order")
    args = ap.parse_args()

    from tandem import LLM, SamplingParams
    from tandem.bench.datasets import sample_sharegpt
    from tandem.loader.checkpoint import open_checkpoint

    groups = [None if g == "default" else int(g) for g in args.groups.split(",")]
    tokenizer = open_checkpoint(args.model).load_tokenizer()
    texts = (prompts_from_file(args.prompts) if args.prompts
             else [r.prompt for r in sample_sharegpt(tokenizer, args.num_prompts)])
    fit = args.max_model_len - args.max_tokens
    prompts: list[dict[str, list[int]]] = []
    for text in texts:
        if len(prompts) == args.num_prompts:
            break
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if 0 < len(ids) <= fit:
            prompts.append({"prompt_token_ids": ids})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    rows: dict[str, list[tuple[float, int, int, int]]] = {}
    for _ in range(args.rounds):
        for g in groups:
            llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs, admission_group=g,
                      kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), max_model_len=args.max_model_len)
            eng = llm.engine
            name = f"{eng.scheduler.admission_group}" + (" (default)" if g is None else "")
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.setdefault(name, []).append((ntok / dt, eng.num_chained_steps, eng.stats.num_steps, ntok))
            print(f"admission_group {name}: {ntok} tokens in {dt:.2f} s = {ntok / dt:.0f} tok/s, "
                  f"chained {eng.num_chained_steps} of {eng.stats.num_steps} steps", flush=True)
            del llm, eng
    print(f"\n{args.model} on {args.device}, {len(prompts)} ShareGPT prompts, {args.max_tokens} greedy tokens, "
          f"max_num_seqs {args.max_num_seqs}, {args.rounds} alternating rounds")
    print("| admission_group | tok/s (rounds) | median | chained / steps (last) | output tokens |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        print(f"| {name} | {', '.join(f'{r[0]:.0f}' for r in runs)} | {statistics.median(r[0] for r in runs):.0f} "
              f"| {runs[-1][1]} / {runs[-1][2]} | {runs[-1][3]} |")


if __name__ == "__main__":
    main()
