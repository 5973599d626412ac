#!/usr/bin/env python
"""EAGLE heads at batch 1: acceptance (τ, per position) and speed against no speculation and n-gram,
same prompts, one process.

Engines (same target, dtype, defaults otherwise): ``baseline`` (no speculation: asynchronous decode
on CUDA), ``ngram`` (k = 4, tandem's defaults), and ``eagle k=K`` for each ``--ks``. Two workloads:
``code`` (HumanEval prompts, raw completion) and ``chat`` (ShareGPT first user turns through the
chat template, skipping every prompt the head's training.json lists as trained on or validated on,
or, for a head trained on a ``tandem.train.sources`` file, every conversation it used: rows of
``--sharegpt-prompts`` then need their ``record``); for a target without a chat template (the base
``gemma-3-270m``) the same prompts are continued as raw text, workload ``text``. Greedy, ``--max-tokens`` each, every prompt
alone (batch 1), the order of engines alternating per prompt; each engine first runs 3 prompts untimed (graphs, JIT).

Per engine and workload: decode time (sum of finish − first token), speedup over the baseline on
that time, τ = tokens per verify step (accepted + 1), acceptance per draft position (of the drafts that
reached that position: where the policy drafts fewer than k, not diluted by the shorter ones), outputs
identical to the baseline's. For EAGLE also the cost model (spec_decode/cost_model.py):
c = head step / target decode step and v = verify extra cost, timed on the engines themselves
(``--profile``), and η = measured speedup / S(per-position acceptance, k, c, v).

Usage: python benchmarks/eagle_bench.py --target smollm2-135m-instruct --head smollm2-135m-instruct-eagle3
       [--humaneval FILE] [--sharegpt-prompts FILE.jsonl] [--sharegpt-offset N] [--num-prompts 20]
       [--max-tokens 256] [--ks 3,5] [--device cuda] [--dtype bfloat16] [--json OUT]
       [--draft-every-step | --also-every-step]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path


def load_chat_prompts(path: str | None, offset: int, n: int, exclude: set[int],
                      exclude_records: set[int] | None = None) -> list[str]:
    """ShareGPT first user turns from ``offset`` on, skipping the indices in ``exclude`` and, with
    the records in ``exclude_records`` (a head's training and validation prompts and source records:
    what its training.json records; a JSONL row names its record as ``record``)."""
    skip = exclude_records or set()
    if path:
        import gzip

        raw = gzip.decompress(Path(path).read_bytes()) if path.endswith(".gz") else Path(path).read_bytes()
        rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        indexed = [(r.get("record"), r["prompt"]) if isinstance(r, dict) else (None, str(r)) for r in rows]
    else:
        from tandem.bench.datasets import load_sharegpt_records, sharegpt_indexed_pairs

        indexed = [(rec, p) for rec, p, _ in sharegpt_indexed_pairs(load_sharegpt_records())]
    return [t for i, (rec, t) in enumerate(indexed)
            if i >= offset and i not in exclude and rec not in skip and len(t) < 4000][:n]


def head_prompt_indices(head: str) -> tuple[set[int], set[int]]:
    """(prompt indices, source records) a head was trained or validated on (its training.json).
    A head trained on first turns records prompt indices; one trained on a ``sources.py`` file
    records the ShareGPT records it used (its prompt indices then name lines of that file)."""
    from tandem.loader.heads import resolve_head

    info = resolve_head(head) / "training.json"
    if not info.is_file():
        return set(), set()
    data = json.loads(info.read_text()).get("data", {})
    if data.get("records"):
        return set(), set(data["records"])
    return set(data.get("train_prompt_indices", [])) | set(data.get("val_prompt_indices", [])), set()


def policy_state(llm, before) -> dict | None:  # type: ignore[no-untyped-def]
    """The goodput policy's batch-1 models after a workload, and the rounds it chose since ``before``
    (None without the policy)."""
    policy = llm.engine.policy
    if policy is None:
        return None
    cost, st = policy.cost, llm.engine.stats.spec
    sigma, beta = cost.overhead(1)
    draft = getattr(policy, "draft", None)
    return {"chosen_k": [x - _at(before.chosen_k, j) for j, x in enumerate(st.chosen_k)],
            "sigma": sigma, "beta": beta, "restart": cost.restart_ratio(1),
            "entry": cost.entry_ratio(1) if hasattr(cost, "entry_ratio") else 0.0, "run_length": cost.run_length(1),
            "draft_fixed": draft.fixed if draft is not None else 0.0,
            "draft_per_step": draft.per_step if draft is not None else policy.draft_cost,
            "guard_blocks": policy.guard.num_blocks}  # (the engine's so far: workloads run one after another)


def timed(llm, prompt, max_tokens: int):  # type: ignore[no-untyped-def]
    from tandem import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    t0, t0m = time.perf_counter(), time.monotonic()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    total = time.perf_counter() - t0
    first = (out.metrics.get("first_token_time") or t0m) - t0m
    return out.outputs[0].token_ids, max(1e-9, total - first), len(out.outputs[0].token_ids)


def step_costs(llm, prompt: str, k: int, reps: int = 30) -> tuple[float, float, float]:
    """(target 1-token decode, target (k+1)-token verify, head step) seconds, timed on this engine's
    own runners after a prefill, synchronising the device around each."""
    import torch

    from tandem.worker.batch import SeqChunk

    eng = llm.engine
    ids = eng.encode(prompt)[:64]
    blocks = list(range(0, (len(ids) + 2 * k + 16) // eng.scheduler.block_size + 2))
    runner, proposer = eng.runner, eng.proposer
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    runner.forward_logits([SeqChunk(ids, 0, blocks)], [len(ids) - 1])

    def clock(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    n = len(ids)
    dec = clock(lambda: runner.forward_logits([SeqChunk([ids[-1]], n, blocks)], [0]))
    ver = clock(lambda: runner.forward_logits([SeqChunk([ids[-1]] * (k + 1), n, blocks)], range(k + 1)))
    head = proposer.runner
    hid = torch.zeros(1, head.head.cfg.hidden_size, dtype=head.head.fc.weight.dtype, device=runner.device)
    tok = torch.tensor([ids[-1]], device=runner.device)
    hstep = clock(lambda: head.forward([SeqChunk([0], n, blocks)], [0], hid, token_ids=tok))
    return dec, ver, hstep


def _at(xs: list[int], j: int) -> int:
    return xs[j] if j < len(xs) else 0


def main() -> None:
    import torch

    from tandem import LLM
    from tandem.bench.datasets import load_humaneval_prompts
    from tandem.spec_decode.cost_model import expected_tokens_from_position_rates

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-eagle3",
                    help="head alias or directory; several, comma-separated, run side by side (chat prompts: "
                         "none that any of them used)")
    ap.add_argument("--humaneval", default=None)
    ap.add_argument("--sharegpt-prompts", default=None, help="JSONL of {'prompt': ...} (default: the ShareGPT package)")
    ap.add_argument("--sharegpt-offset", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ks", default="3,5")
    ap.add_argument("--workloads", default="code,chat")
    ap.add_argument("--no-ngram", action="store_true")
    ap.add_argument("--draft-every-step", action="store_true",
                    help="speculative engines draft every step (disable_by_acceptance false): measures the head's "
                         "acceptance rather than what the goodput policy makes of it")
    ap.add_argument("--also-every-step", action="store_true",
                    help="each EAGLE engine twice, side by side: with the goodput policy and drafting every step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quantization", default=None,
                    help="the target's (e.g. none: the GGUF dequantized to --dtype, the CPU fp32 case)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    ks = [int(k) for k in args.ks.split(",")]
    common = dict(device=args.device, dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=1 << 30,
                  enable_prefix_caching=False, quantization=args.quantization)
    t0 = time.perf_counter()
    every = {"disable_by_acceptance": False} if args.draft_every_step else {}
    engines = {"baseline": LLM(args.target, **common)}
    if not args.no_ngram:
        engines["ngram k=4"] = LLM(args.target, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                                   **every}, **common)
    heads = args.head.split(",")
    names = {h: "eagle" if len(heads) == 1 else f"eagle[{Path(h).name}]" for h in heads}
    eagle_k: dict[str, int] = {}  # engine name -> its k
    for h in heads:
        for k in ks:
            variants = {"": every}
            if args.also_every_step and not args.draft_every_step:
                variants[" every step"] = {"disable_by_acceptance": False}
            for suffix, extra in variants.items():
                name = f"{names[h]} k={k}{suffix}"
                eagle_k[name] = k
                engines[name] = LLM(args.target, speculative_config={
                    "model": h, "num_speculative_tokens": k, **extra}, **common)
    tok = engines["baseline"].get_tokenizer()
    work: dict[str, list] = {}
    if "code" in args.workloads:
        work["code"] = load_humaneval_prompts(args.humaneval)[: args.num_prompts]
    if "chat" in args.workloads:
        used = [head_prompt_indices(h) for h in heads]  # every head's: the same prompts for all
        texts = load_chat_prompts(args.sharegpt_prompts, args.sharegpt_offset, args.num_prompts,
                                  set().union(*(u[0] for u in used)), set().union(*(u[1] for u in used)))
        if getattr(tok, "chat_template", None):
            work["chat"] = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True) for p in texts]
        else:  # a base model (gemma-3-270m): the same prompts, continued as raw text
            work["text"] = texts
    empty = [w for w, prompts in work.items() if not prompts]
    if empty:
        raise SystemExit(f"no prompts for workload(s) {', '.join(empty)}: check --humaneval / --sharegpt-prompts "
                         f"(an empty file, or every prompt excluded as trained on)")
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"{date.today()} {dev}, torch {torch.__version__}, {dtype}, threads {torch.get_num_threads()}; engines built "
          f"in {time.perf_counter() - t0:.1f} s; {args.max_tokens} tokens per prompt, batch 1")
    for llm in engines.values():
        for p in work[next(iter(work))][:3]:
            timed(llm, p, 32)
    results: dict[str, dict[str, dict]] = {}
    for wname, prompts in work.items():
        acc = {name: {"seconds": 0.0, "tokens": 0, "identical": 0} for name in engines}
        before = {name: llm.engine.stats.spec.copy() for name, llm in engines.items()}
        for i, p in enumerate(prompts):
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]
            outs = {name: timed(engines[name], p, args.max_tokens) for name in order}
            for name, (toks, secs, n) in outs.items():
                a = acc[name]
                a["seconds"] += secs
                a["tokens"] += n
                a["identical"] += toks == outs["baseline"][0]
        for name, llm in engines.items():
            st, b = llm.engine.stats.spec, before[name]
            drafts = st.num_drafts - b.num_drafts
            # acceptance at position j of the drafts that reached it (older trees: of all drafts)
            tried = getattr(st, "drafted_per_pos", None)
            per_pos = [(x - _at(b.accepted_per_pos, j))
                       / max(1, tried[j] - _at(b.drafted_per_pos, j) if tried is not None else drafts)
                       for j, x in enumerate(st.accepted_per_pos)]
            # (min: with the policy choosing k per round, later positions are drafted in other rounds)
            cond = [per_pos[0]] + [min(1.0, per_pos[j] / per_pos[j - 1]) if per_pos[j - 1] else 0.0
                                   for j in range(1, len(per_pos))] if per_pos else []
            acc[name].update(
                tau=1 + (st.num_accepted_tokens - b.num_accepted_tokens) / drafts if drafts else None,
                per_position=per_pos, cond_rates=cond,
                speedup=acc["baseline"]["seconds"] / acc[name]["seconds"] if name != "baseline" else 1.0,
                policy=policy_state(llm, b),
            )
        results[wname] = acc
    costs = {}
    for k in ks:
        llm = engines[f"{names[heads[0]]} k={k}"]
        dec, ver, hstep = step_costs(llm, work[next(iter(work))][0], k)
        costs[k] = {"decode_s": dec, "verify_s": ver, "head_step_s": hstep, "c": hstep / dec, "v": ver / dec - 1}
    print("\n| workload | engine | decode tok/s | speedup | τ | acceptance per position | identical | η |")
    print("|---|---|---|---|---|---|---|---|")
    for wname, acc in results.items():
        for name, a in acc.items():
            eta = ""
            if name in eagle_k and a["tau"]:
                k = eagle_k[name]
                c = costs[k]
                s_model = expected_tokens_from_position_rates(a["cond_rates"][:k]) / (k * c["c"] + 1 + c["v"])
                a["eta"] = a["speedup"] / s_model
                eta = f"{a['eta']:.2f}"
            pos = ", ".join(f"{x:.2f}" for x in a["per_position"]) if a["per_position"] else ""
            tau = f"{a['tau']:.2f}" if a.get("tau") else ""
            print(f"| {wname} | {name} | {a['tokens'] / a['seconds']:.1f} | {a['speedup']:.2f}x | {tau} | {pos} | "
                  f"{a['identical']}/{len(work[wname])} | {eta} |")
    states = [(w, name, a["policy"]) for w, acc in results.items() for name, a in acc.items() if a.get("policy")]
    if states:  # why the policy drafted what it did: its models as each workload left them
        print("\n| workload | engine | rounds: chosen k 0/1/.. | σ, β | ρ (of it the runs' entry) | run length | "
              "draft cost: fixed + per step (D) | guard blocks so far |")
        print("|---|---|---|---|---|---|---|---|")
        for w, name, ps in states:
            print(f"| {w} | {name} | {'/'.join(map(str, ps['chosen_k']))} | {ps['sigma']:.3f}, {ps['beta']:.3f} | "
                  f"{ps['restart']:.2f} ({ps['entry']:.2f}) | {ps['run_length']:.1f} | "
                  f"{ps['draft_fixed']:.3f} + {ps['draft_per_step']:.3f} | {ps.get('guard_blocks', '')} |")
    for k, c in costs.items():
        print(f"k={k}: target decode {c['decode_s'] * 1e3:.3f} ms, verify {c['verify_s'] * 1e3:.3f} ms (v={c['v']:.3f}), "
              f"head step {c['head_step_s'] * 1e3:.3f} ms (c={c['c']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "costs": costs,
                                               "date": str(date.today()), "device": dev}, indent=1))


if __name__ == "__main__":
    main()
