#!/usr/bin/env python
"""Engine host work per decode step at large batch: what building per-step outputs and detokenizing
cost, side by side in one engine.

Three ways to run the same requests (greedy, ``ignore_eos``, random prompt ids), alternating round by
round in one process:

- ``cumulative, text``: an output for every request at every step, with its text so far — what the
  server streams, and what ``LLM.generate`` asked for before it asked for final outputs only;
- ``final only, text``: ``output_kind=FINAL_ONLY`` (``LLM.generate`` now);
- ``final only, no text``: also ``detokenize=False`` (``tandem train-draft`` generating its data).

On CPU with the tiny test checkpoint (the default) the forward is cheap and the engine's own Python
work shows; ``--host-only`` times with this process's CPU time and subtracts the runner's forward
(prefill steps' forwards included, so it slightly under-reads), which a shared machine's noise
disturbs less than wall time. With ``--model smollm2-135m-instruct --device cuda`` (wall time) this
is the data-generation step of ``train-draft`` on a GPU, where that host work is the step time.

Usage: python benchmarks/engine_host_overhead.py [--batch 256] [--rounds 3] [--max-tokens 128]
       [--host-only] [--model PATH_OR_ALIAS --device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MODES = ("cumulative, text", "final only, text", "final only, no text")


def params_for(mode: str, max_tokens: int):  # noqa: ANN201 - SamplingParams, imported lazily
    from tandem.sampling_params import RequestOutputKind, SamplingParams

    kind = RequestOutputKind.CUMULATIVE if mode.startswith("cumulative") else RequestOutputKind.FINAL_ONLY
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind,
                          detokenize=not mode.endswith("no text"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--model", default=None, help="default: the tiny random test checkpoint (CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--host-only", action="store_true",
                    help="process CPU time minus the runner's forward (CPU only)")
    args = ap.parse_args()
    if args.host_only and args.device != "cpu":
        ap.error("--host-only measures CPU time: use it with --device cpu")
    from _common import decode_ms_per_step, tiny_model_dir

    from tandem import LLM

    kw: dict = {"max_num_seqs": max(256, args.batch)}
    if args.device == "cpu":
        torch.set_num_threads(1)
        kw.update(dtype="float32", kv_cache_memory_bytes=512 << 20, block_size=16)
    llm = LLM(args.model or str(tiny_model_dir()), device=args.device, **kw)
    vocab = 500 if args.model is None else llm.engine.arch.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    forward_s = [0.0]
    if args.host_only:  # the runner's forwards, in process time, to subtract
        runner = llm.engine.runner
        forward = runner.forward_logits

        def timed_forward(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t0 = time.process_time()
            try:
                return forward(*a, **kw)
            finally:
                forward_s[0] += time.process_time() - t0

        runner.forward_logits = timed_forward
    clock = time.process_time if args.host_only else time.perf_counter
    decode_ms_per_step(llm.engine, prompts[:8], params_for(MODES[0], 8), "warm")
    res: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.rounds):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            forward_s[0] = 0.0
            ms, steps = decode_ms_per_step(llm.engine, prompts, params_for(mode, args.max_tokens),
                                           f"{rep}-{mode}", clock=clock)
            res[mode].append(ms - forward_s[0] / max(1, steps) * 1e3)
    base = statistics.median(res[MODES[0]])
    what = "host CPU ms per decode step, forward excluded" if args.host_only else "ms per decode step"
    print(f"\n{args.model or 'tiny random Llama'} on {args.device}, batch {args.batch}, "
          f"{args.max_tokens} tokens, {args.rounds} rounds alternating")
    rate = "tok/s (host work alone)" if args.host_only else "tok/s"
    print(f"| outputs | {what} (median) | µs per request-step | {rate} | vs cumulative | runs |")
    print("|---|---|---|---|---|---|")
    for mode, v in res.items():
        ms = statistics.median(v)
        print(f"| {mode} | {ms:.2f} | {ms * 1e3 / args.batch:.1f} | {args.batch / ms * 1e3:.0f} | "
              f"{base / ms:.2f}× | {', '.join(f'{x:.2f}' for x in v)} |")


if __name__ == "__main__":
    main()
