#!/usr/bin/env python
"""Where an engine step's wall time goes: plain (asynchronous) decode vs speculative steps.

Runs the same prompts (greedy unless ``--temperature``) through one engine per configuration (built-in model by default,
HumanEval completion prompts when ``--humaneval`` is given, else a repetitive synthetic prompt) and
times each phase of ``LLMEngine.step`` by wrapping the engine's own methods (no device syncs added:
the wait for the device shows where the host reads results):

- ``propose``   ``_propose`` and ``_propose_ahead`` (host proposers draft here, an EAGLE head's steps
                are launched; the policy chooses)
- ``head``      of ``propose``: the EAGLE head runner's steps (``forward``, ``forward_chain``), host
                time — on CUDA the packing, copies, fix-ups and graph launches, not the device's work
- ``resolve``   ``speculator.resolve_drafts`` (the host read of drafts left on the device)
- ``schedule``  ``scheduler.schedule``
- ``execute``   ``executor.start`` + ``finish`` (a synchronous step: pack, launch, wait, sample / verify)
- ``launch``    ``executor.launch`` (an asynchronous step: pack, launch)
- ``read``      ``InflightStep.read`` (the host sync of an asynchronous step)
- ``process``   ``output_processor.apply`` + ``flush`` (stops, then detokenize and outputs; an
                asynchronous engine flushes a verify step's text while the next step runs)
- ``observe``   ``speculator.observe`` (counters, policy evidence; not inside the step's own timing)
- ``cycle``     the time from one ``step()`` call to the next (what throughput sees)

The verify-step table also counts chained verifies (engine/async_decode.py) and how often the
assumption their drafts rested on held.

Prints per configuration: steps, tokens per step, ms per token, and mean ms per step of each phase;
then the same phases over the steps that verified drafts only (and their whole ``step()`` call).
Optionally writes a cProfile of each configuration (``--cprofile DIR``).

Usage: python benchmarks/spec_step_profile.py [--model M] [--batch 1] [--num-prompts 8]
       [--max-tokens 256] [--temperature 0] [--humaneval FILE] [--configs baseline,sync,ngram,ngram_policy,suffix]
       [--sync]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

CONFIGS: dict[str, tuple[dict[str, Any] | None, bool]] = {
    "baseline": (None, True),
    "sync": (None, False),
    "ngram": ({"method": "ngram", "num_speculative_tokens": 4, "disable_by_acceptance": False}, True),
    "ngram_policy": ({"method": "ngram", "num_speculative_tokens": 4, "disable_by_acceptance": True}, True),
    "suffix": ({"method": "suffix", "disable_by_acceptance": False}, True),
    "suffix_policy": ({"method": "suffix", "disable_by_acceptance": True}, True),
    "eagle3_policy": ({"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3,
                       "disable_by_acceptance": True}, True),
    "eagle3": ({"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3,
                "disable_by_acceptance": False}, True),
}
PHASES = ("propose", "head", "resolve", "schedule", "execute", "launch", "read", "process", "observe", "cycle")


def _wrap(obj: Any, name: str, acc: dict[str, float], key: str) -> None:
    fn = getattr(obj, name)

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, name, timed)


def _prompts(args: argparse.Namespace, llm: Any) -> list[list[int]]:
    if args.humaneval:
        import gzip

        opener = gzip.open if args.humaneval.endswith(".gz") else open
        with opener(args.humaneval, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [llm.engine.encode(r["prompt"]) for r in rows[: args.num_prompts]]
    text = "def add(a, b):\n    return a + b\n\n" * 2
    return [llm.engine.encode(f"# file {i}\n" + text) for i in range(args.num_prompts)]


def _chain_counts(eng: Any) -> tuple[int, int, int]:
    """Chained verifies so far, and their drafts' assumptions held / failed (0 in older trees)."""
    spec = eng.stats.spec
    return (getattr(eng, "num_chained_verifies", 0), getattr(spec, "num_assumed_held", 0),
            getattr(spec, "num_assumed_failed", 0))


def profile(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from tandem import LLM, SamplingParams
    from tandem.engine import async_decode

    spec, async_on = CONFIGS[name]
    async_on = async_on and not args.sync
    kw: dict[str, Any] = {"async_scheduling": async_on}
    if args.device:
        kw["device"] = args.device
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    elif (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        # the engines of one process share the card: a GPU engine's default (a share of the free
        # memory) had left the second configuration 0 bytes of KV cache
        kw["kv_cache_memory_bytes"] = 2 << 30
    llm = LLM(args.model, speculative_config=spec, **kw)
    eng = llm.engine
    prompts = _prompts(args, llm)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0 if args.temperature else None)

    verify: dict[str, float] = defaultdict(float)  # the phases of the steps that verified drafts

    def run(tag: str, acc: dict[str, float] | None) -> tuple[int, int, float]:
        queue = list(prompts)
        live = 0
        steps = tokens = 0
        t0 = time.perf_counter()
        last = None
        while queue or eng.has_unfinished_requests():
            while queue and live < args.batch:
                eng.add_request(f"{tag}-{len(queue)}", None, sp, prompt_token_ids=queue.pop())
                live += 1
            now = time.perf_counter()
            if acc is not None and last is not None:
                acc["cycle"] += now - last
            last = now
            before, drafts = dict(acc or {}), eng.stats.spec.num_drafts
            t_step = time.perf_counter()
            for o in eng.step():
                if o.finished:
                    live -= 1
                    tokens += len(o.outputs[0].token_ids)
            steps += 1
            if acc is not None and eng.stats.spec.num_drafts > drafts:
                verify["steps"] += 1
                verify["step()"] += time.perf_counter() - t_step
                for p in PHASES[:-1]:
                    verify[p] += acc[p] - before.get(p, 0.0)
        return steps, tokens, time.perf_counter() - t0

    run("warm", None)
    acc: dict[str, float] = defaultdict(float)
    _wrap(eng, "_propose", acc, "propose")
    if hasattr(eng, "_propose_ahead"):  # (older trees: no chained verifies)
        _wrap(eng, "_propose_ahead", acc, "propose")
    head_runner = getattr(eng.proposer, "runner", None)
    if hasattr(head_runner, "head"):  # an EAGLE head's runner (a draft model's has no ``head``)
        for n in ("forward", "forward_chain"):
            if hasattr(head_runner, n):
                _wrap(head_runner, n, acc, "head")
    _wrap(eng.speculator, "resolve_drafts", acc, "resolve")
    _wrap(eng.scheduler, "schedule", acc, "schedule")
    # (the engine calls start / finish and apply / flush; older trees execute and process)
    for obj, names, key in ((eng.executor, ("execute", "start", "finish"), "execute"),
                            (eng.output_processor, ("process", "apply", "flush"), "process")):
        for n in names:
            if hasattr(obj, n):
                _wrap(obj, n, acc, key)
    _wrap(eng.executor, "launch", acc, "launch")
    _wrap(eng.speculator, "observe", acc, "observe")
    orig_read = async_decode.InflightStep.read

    def read(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_read(self)
        finally:
            acc["read"] += time.perf_counter() - t0

    async_decode.InflightStep.read = read  # type: ignore[method-assign]
    prof = cProfile.Profile() if args.cprofile else None
    counts = _chain_counts(eng)  # (the warm-up's are not the timed run's)
    try:
        if prof is not None:
            prof.enable()
        steps, tokens, dt = run("timed", acc)
        if prof is not None:
            prof.disable()
    finally:
        async_decode.InflightStep.read = orig_read  # type: ignore[method-assign]
    if prof is not None:
        out = Path(args.cprofile)
        out.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(out / f"{name}.prof"))
    spec_stats = eng.stats.spec
    tau = (1 + spec_stats.num_accepted_tokens / spec_stats.num_drafts) if spec_stats.num_drafts else None
    # chained verifies (older trees have none): launched before the verify they follow was read,
    # and how often the assumption their drafts rested on held
    chained, held, failed = (a - b for a, b in zip(_chain_counts(eng), counts))
    del llm
    nv = int(verify["steps"])
    return {"name": name, "steps": steps, "tokens": tokens, "seconds": dt, "tau": tau, "chained": chained,
            "held": held / (held + failed) if held + failed else None,
            **{p: 1e3 * acc[p] / max(steps, 1) for p in PHASES}, "verify_steps": nv,
            "verify": {p: 1e3 * verify[p] / nv for p in (*PHASES[:-1], "step()")} if nv else {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--humaneval", default=None, help="HumanEval.jsonl(.gz): completion prompts")
    ap.add_argument("--configs", default="baseline,sync,ngram,ngram_policy")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="default: 2 GiB on CUDA, the engine's on CPU")
    ap.add_argument("--cprofile", default=None, help="directory for one .prof per configuration")
    ap.add_argument("--quantization", default=None, help="e.g. none: the float32 CPU target (default: the engine's)")
    ap.add_argument("--sync", action="store_true", help="every configuration synchronous (the CPU's default)")
    args = ap.parse_args()
    if args.model is None:
        from tandem.loader.registry import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    rows = [profile(args, c.strip()) for c in args.configs.split(",") if c.strip()]
    print(f"\nmodel {args.model}, batch {args.batch}, {args.num_prompts} prompts, max_tokens {args.max_tokens}")
    head = "| config | steps | tok/step | ms/tok | τ | " + " | ".join(PHASES) + " |"
    print(head)
    print("|" + "---|" * (5 + len(PHASES)))
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        print(f"| {r['name']} | {r['steps']} | {r['tokens'] / r['steps']:.2f} | {1e3 * r['seconds'] / r['tokens']:.3f} "
              f"| {tau} | " + " | ".join(f"{r[p]:.3f}" for p in PHASES) + " |")
    print("(phase columns: mean ms per step)")
    vphases = (*PHASES[:-1], "step()")
    print("\n| config | verify steps | chained | assumption held | " + " | ".join(vphases) + " |")
    print("|" + "---|" * (4 + len(vphases)))
    for r in rows:
        if r["verify"]:
            held = f"{100 * r['held']:.0f} %" if r["held"] is not None else "-"
            print(f"| {r['name']} | {r['verify_steps']} | {r['chained']} | {held} | "
                  + " | ".join(f"{r['verify'][p]:.3f}" for p in vphases) + " |")
    print("(mean ms per step that verified drafts; step(): the whole call; chained: verifies launched\n"
          " before the verify they follow was read, with drafts resting on the assumption that it accepted\n"
          " everything — held: how often that assumption did)")


if __name__ == "__main__":
    main()
