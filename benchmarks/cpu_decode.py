#!/usr/bin/env python
"""CPU decode speed: tandem vs HF transformers ``generate`` on SmolLM2-135M-Instruct, float32.

Both engines load the same GGUF file (``resolve_model("smollm2-135m-instruct")``; HF through its own
GGUF reader), run the same prompt token ids, greedy, exactly ``--max-tokens`` new tokens (tandem
``ignore_eos``, HF ``eos_token_id=None``), in the same process. Runs are interleaved prompt by
prompt with alternating order, so both see the same background load; the ratio is the result to
trust on a shared machine, absolute numbers move with the load average (printed).

Measured per prompt and engine:
- e2e tok/s   = N / time of one ``generate`` call for N new tokens (includes the prefill);
- decode tok/s = (N - 1) / (t_N - t_first), where t_first is when the first new token existed
  (tandem: the engine's ``first_token_time``; HF: a ``generate`` streamer's first new-token call),
  i.e. the steady-state decode rate with the prefill taken out, from the same call.
Bandwidth floor: a 512 MiB tensor copy gives DRAM bandwidth B (bytes read + written per second,
measured between rounds, same thread count). A batch-1 decode step must read every weight once
(fp32, tied embedding counted once) plus the KV of its context, so
    floor tok/s = B / (weight bytes + KV bytes per context token × mean context length),
and each engine's decode tok/s is reported as % of that floor (the median B is used; the max B is
printed too). Batch 16: one ``generate`` call with 16 prompts, tokens/s = 16·N / time (HF pads on
the left with an attention mask); its floor is B · 16 / (weights + 16 · KV of a mean context).

Usage: python benchmarks/cpu_decode.py [--threads 1] [--num-prompts 4] [--max-tokens 64]
       [--rounds 2] [--batch-size 16] [--batch-max-tokens 32] [--no-hf-batch] [--json out.json]
       [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    copy_bandwidth,
    fmt_load,
    kv_bytes_per_context_token,
    load_hf_from_gguf,
    loadavg,
    machine_info,
    model_weight_bytes,
)

MODEL = "smollm2-135m-instruct"


def humaneval_prompt_ids(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    from tandem.bench.datasets import sample_requests

    reqs = sample_requests("humaneval", tokenizer, n, seed=seed, output_len=1)
    return [list(tokenizer.encode(r.prompt, add_special_tokens=True)) for r in reqs]


class TandemRunner:
    name = "tandem"

    def __init__(self, llm: Any) -> None:
        from tandem import SamplingParams

        self.llm = llm
        self._sp = SamplingParams

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, float, list[list[int]]]:
        """(total seconds, seconds until the first new token, output ids)."""
        sp = self._sp(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0m, t0 = time.monotonic(), time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        # first_token_time is time.monotonic() inside the engine
        first = min(o.metrics.get("first_token_time") or t0m for o in outs) - t0m
        return dt, first, [list(o.outputs[0].token_ids) for o in outs]


class HFRunner:
    name = "hf"

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, float, list[list[int]]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        streamer = _FirstTokenClock()
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, eos_token_id=None, pad_token_id=self.pad_id,
                                  streamer=streamer if len(prompts) == 1 else None)
        dt = time.perf_counter() - t0
        first = (streamer.first - t0) if streamer.first is not None else float("nan")
        return dt, first, [row[width:].tolist() for row in out]


class _FirstTokenClock:
    """A generate() streamer that records when the first *new* token arrives (batch 1 only):
    HF calls put() once with the prompt, then once per generated token."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def agree_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem import LLM
    from tandem.loader.registry import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info()
    print(f"machine: {info['cpus']} CPUs, {info['mem_total']}, torch {info['torch']}, "
          f"transformers {info['transformers']}, torch threads {info['torch_threads']}")
    print(f"load average at start: {fmt_load(info['loadavg'])}", flush=True)
    path = Path(resolve_model(MODEL))
    t0 = time.perf_counter()
    llm = LLM(MODEL, device="cpu", dtype="float32", max_model_len=2048, kv_cache_memory_bytes=512 << 20)
    print(f"tandem loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    hf_model, hf_tok = load_hf_from_gguf(path)
    print(f"HF loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else (hf_tok.eos_token_id or 0)
    runners = [TandemRunner(llm), HFRunner(hf_model, pad)]
    arch = llm.engine.arch
    weight_bytes = model_weight_bytes(llm.engine.model)
    kv_tok = kv_bytes_per_context_token(arch, 4)
    prompts = humaneval_prompt_ids(llm.get_tokenizer(), args.num_prompts, args.seed)
    N = args.max_tokens
    print(f"{len(prompts)} HumanEval prompts, lengths {[len(p) for p in prompts]}, {N} new tokens, "
          f"{args.rounds} rounds; weights {weight_bytes / 1e6:.1f} MB fp32, KV {kv_tok} B/token", flush=True)

    # warm-up (allocators, lazy init) on a short prompt
    for r in runners:
        r.generate([prompts[0][:16]], 4)

    bw: list[dict[str, float]] = [copy_bandwidth()]
    rows: dict[str, dict[str, list[float]]] = {r.name: {"e2e": [], "decode": [], "t1": []} for r in runners}
    outputs: dict[str, list[list[int]]] = {r.name: [] for r in runners}
    loads = [loadavg()]
    for rnd in range(args.rounds):
        for i, p in enumerate(prompts):
            order = runners if (rnd + i) % 2 == 0 else runners[::-1]
            for r in order:
                tn, t1, toks = r.generate([p], N)
                rows[r.name]["t1"].append(t1)
                rows[r.name]["e2e"].append(N / tn)
                rows[r.name]["decode"].append((N - 1) / (tn - t1))
                if rnd == 0:
                    outputs[r.name].append(toks[0])
            print(f"  round {rnd + 1} prompt {i + 1}: "
                  + ", ".join(f"{r.name} {rows[r.name]['decode'][-1]:.2f} tok/s" for r in runners)
                  + f"  (load {loadavg()[0]:.2f})", flush=True)
        bw.append(copy_bandwidth())
        loads.append(loadavg())

    agree = [agree_prefix(a, b) for a, b in zip(outputs["tandem"], outputs["hf"])]
    bw_med = statistics.median(b["median_GBps"] for b in bw)
    bw_max = max(b["max_GBps"] for b in bw)
    mean_ctx = statistics.mean(len(p) for p in prompts) + N / 2
    bytes_tok = weight_bytes + kv_tok * mean_ctx
    floor = bw_med * 1e9 / bytes_tok
    floor_max = bw_max * 1e9 / bytes_tok

    summary: dict[str, Any] = {}
    for r in runners:
        d = rows[r.name]
        summary[r.name] = {
            "decode_tok_s_median": statistics.median(d["decode"]),
            "decode_tok_s_mean": statistics.mean(d["decode"]),
            "e2e_tok_s_median": statistics.median(d["e2e"]),
            "prefill_plus_first_token_s_median": statistics.median(d["t1"]),
            "pct_of_floor": 100 * statistics.median(d["decode"]) / floor,
            "samples_decode": d["decode"],
            "samples_e2e": d["e2e"],
        }
    ratios = [a / b for a, b in zip(rows["tandem"]["decode"], rows["hf"]["decode"])]
    ratios_e2e = [a / b for a, b in zip(rows["tandem"]["e2e"], rows["hf"]["e2e"])]

    # ---- batch 16 -----------------------------------------------------------------------------
    batch: dict[str, Any] = {}
    if args.batch_size > 1:
        bprompts = humaneval_prompt_ids(llm.get_tokenizer(), args.batch_size, args.seed + 1)
        bn = args.batch_max_tokens
        brunners = runners if args.hf_batch else runners[:1]
        for rep in range(args.batch_rounds):
            for r in (brunners if rep % 2 == 0 else brunners[::-1]):
                dt, _, _ = r.generate(bprompts, bn)
                batch.setdefault(r.name, []).append(len(bprompts) * bn / dt)
                print(f"  batch {len(bprompts)} rep {rep + 1}: {r.name} {batch[r.name][-1]:.2f} tok/s "
                      f"(load {loadavg()[0]:.2f})", flush=True)
        bw.append(copy_bandwidth())
        loads.append(loadavg())
        bctx = statistics.mean(len(p) for p in bprompts) + bn / 2
        batch_floor = statistics.median(b["median_GBps"] for b in bw) * 1e9 * len(bprompts) / (
            weight_bytes + len(bprompts) * kv_tok * bctx)
        batch = {"batch_size": len(bprompts), "max_tokens": bn, "mean_prompt_len": bctx - bn / 2,
                 "tok_s": {k: statistics.median(v) for k, v in batch.items()},
                 "samples": batch, "floor_tok_s": batch_floor}

    result = {
        "machine": info, "threads": torch.get_num_threads(), "max_tokens": N, "rounds": args.rounds,
        "prompt_lens": [len(p) for p in prompts], "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_tok,
        "bandwidth": bw, "bandwidth_median_GBps": bw_med, "bandwidth_max_GBps": bw_max,
        "floor_tok_s": floor, "floor_tok_s_at_max_bw": floor_max, "engines": summary,
        "ratio_tandem_over_hf_decode": {"median": statistics.median(ratios), "samples": ratios},
        "ratio_tandem_over_hf_e2e": {"median": statistics.median(ratios_e2e), "samples": ratios_e2e},
        "greedy_agreement_prefix": agree, "batch": batch, "loadavg": loads,
    }
    print_table(result)
    if args.profile:
        profile_tandem(llm, prompts[0], N)
    return result


def print_table(res: dict[str, Any]) -> None:
    e = res["engines"]
    la = res["loadavg"]
    print()
    print(f"=== batch-1 greedy decode, SmolLM2-135M fp32, {res['threads']} torch thread(s), "
          f"{res['max_tokens']} new tokens, {len(res['prompt_lens'])} prompts × {res['rounds']} rounds ===")
    print(f"load average (1 min) during the run: {min(x[0] for x in la):.2f} – {max(x[0] for x in la):.2f}")
    print(f"copy bandwidth (read+write): median {res['bandwidth_median_GBps']:.2f} GB/s, "
          f"max {res['bandwidth_max_GBps']:.2f} GB/s; bytes/token "
          f"{(res['weight_bytes'] + res['kv_bytes_per_token'] * (sum(res['prompt_lens']) / len(res['prompt_lens']) + res['max_tokens'] / 2)) / 1e6:.1f} MB")
    print(f"{'engine':<8} {'decode tok/s':>13} {'e2e tok/s':>10} {'prefill+1 s':>12} {'% of floor':>11}")
    for name in ("tandem", "hf"):
        s = e[name]
        print(f"{name:<8} {s['decode_tok_s_median']:>13.2f} {s['e2e_tok_s_median']:>10.2f} "
              f"{s['prefill_plus_first_token_s_median']:>12.3f} {s['pct_of_floor']:>10.1f}%")
    print(f"{'floor':<8} {res['floor_tok_s']:>13.2f}   (at max bandwidth: {res['floor_tok_s_at_max_bw']:.2f})")
    print(f"tandem / HF (paired, median): decode {res['ratio_tandem_over_hf_decode']['median']:.3f}, "
          f"e2e {res['ratio_tandem_over_hf_e2e']['median']:.3f}")
    print(f"greedy agreement with HF (identical leading tokens of {res['max_tokens']}): "
          f"{res['greedy_agreement_prefix']}")
    b = res["batch"]
    if b:
        print(f"batch {b['batch_size']} ({b['max_tokens']} new tokens each): "
              + ", ".join(f"{k} {v:.2f} tok/s" for k, v in b["tok_s"].items())
              + f"; floor {b['floor_tok_s']:.1f} tok/s")


def profile_tandem(llm: Any, prompt: list[int], n: int) -> None:
    """torch-profiler table of one tandem generate (the decode-dominated op mix)."""
    from torch.profiler import ProfilerActivity, profile

    from tandem import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16, help="0/1: skip the batch run")
    ap.add_argument("--batch-max-tokens", type=int, default=32)
    ap.add_argument("--batch-rounds", type=int, default=2)
    ap.add_argument("--hf-batch", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile", action="store_true", help="print a torch-profiler table of tandem")
    ap.add_argument("--json", default=None, help="write all measurements here")
    args = ap.parse_args()
    res = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1), encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
