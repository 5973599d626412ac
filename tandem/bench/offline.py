"""Offline benchmarks: ``tandem bench latency`` and ``tandem bench throughput`` (in-process ``LLM``).

Both mirror vLLM's ``vllm bench latency`` / ``vllm bench throughput``: the same flag names, the same
printed lines and the same JSON keys, so scripts written for vLLM read tandem's results.

latency    one batch of ``--batch-size`` random-token prompts of ``--input-len`` tokens, each asked
           for exactly ``--output-len`` tokens (``ignore_eos``); ``--num-iters-warmup`` untimed
           runs, then ``--num-iters`` timed ``LLM.generate`` calls. Prints ``Avg latency: X
           seconds`` and the 10/25/50/75/90/99th percentiles; JSON: ``avg_latency``,
           ``latencies``, ``percentiles`` (keys "10" … "99").
throughput ``--num-prompts`` prompts from ``--dataset-name`` (random | sharegpt | humaneval |
           prefix-repetition | custom, via :mod:`tandem.bench.datasets`), all submitted to one
           ``LLM.generate`` call, timed end to end. Prints ``Throughput: X requests/s, Y total
           tokens/s, Z output tokens/s``; JSON: ``elapsed_time``, ``num_requests``,
           ``total_num_tokens``, ``requests_per_second``, ``tokens_per_second`` (+ tandem extras).

Token counts are what the engine actually processed (prompt ids incl. BOS + generated ids), not the
dataset's nominal lengths. Defaults differ from vLLM's only where a 2-core CPU needs it
(``--num-iters-warmup 2``, ``--num-iters 5``). Sampling follows vLLM (temperature 1.0, top_p 1.0,
``ignore_eos``); ``--temperature 0`` gives greedy decoding, the usual setting for speculation.
Speculative decoding counters (τ, acceptance, per-position acceptance) are taken from
``llm.engine.stats.spec`` as the difference over the timed part only, and printed when speculation
is on.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from tandem.errors import ConfigError

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)
# vLLM draws dummy prompt ids from [0, 10000); smaller vocabularies use their own size.
_DUMMY_VOCAB = 10000


# --------------------------------------------------------------------------------------------
# Shared
# --------------------------------------------------------------------------------------------


def _add_common_args(p: argparse.ArgumentParser) -> None:
    from tandem.engine.args import add_engine_args
    from tandem.loader.registry import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="HF directory, .gguf file or tandem alias")
    p.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (vLLM's benchmarks use 1.0; 0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--output-json", default=None, help="write the results to this JSON file")
    p.add_argument("--disable-detokenize", action="store_true",
                   help="do not make the outputs' text (as vLLM: detokenization left out of the timing)")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)


def _check_positive(flag: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ConfigError(flag, f"must be >= {minimum}, got {value}")


def _make_llm(args: argparse.Namespace) -> Any:
    from tandem.engine.args import engine_kwargs
    from tandem.engine.llm import LLM

    return LLM(args.model, **engine_kwargs(args))


def _sampling_params(args: argparse.Namespace, max_tokens: int | None) -> Any:
    from tandem.sampling_params import SamplingParams

    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, ignore_eos=True,
                          max_tokens=max_tokens, detokenize=not args.disable_detokenize)


def spec_summary(before: Any, after: Any) -> dict[str, Any] | None:
    """Speculation counters accumulated between two ``SpecStats`` snapshots (None if no drafts)."""
    drafts = after.num_drafts - before.num_drafts
    if drafts <= 0:
        return None
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [
        (a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)) / drafts
        for i, a in enumerate(after.accepted_per_pos)
    ]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "per_position_acceptance_rates": per_pos,
    }


def format_spec_summary(spec: dict[str, Any]) -> str:
    rates = ", ".join(f"{r:.3f}" for r in spec["per_position_acceptance_rates"])
    return (
        "Speculative decoding:\n"
        f"  Mean acceptance length (tau): {spec['mean_acceptance_length']:.2f}\n"
        f"  Drafts: {spec['num_drafts']}, drafted tokens: {spec['num_draft_tokens']}, "
        f"accepted tokens: {spec['num_accepted_tokens']}\n"
        f"  Draft acceptance rate: {100 * spec['acceptance_rate']:.1f}%\n"
        f"  Per-position acceptance rate: {rates}"
    )


def _engine_info(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    eng = llm.engine
    spec = eng.spec
    import torch

    return {
        "model": args.model,
        "device": str(eng.device),
        "dtype": str(eng.dtype).replace("torch.", ""),
        "torch_num_threads": torch.get_num_threads(),
        "speculative_config": None if spec is None else {
            k: v for k, v in vars(spec).items() if v is not None
        },
    }


def _write_json(path: str, data: dict[str, Any]) -> None:
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=4) + "\n", encoding="utf-8")


def _errors(outputs: list[Any]) -> list[str]:
    return [o.error for o in outputs if getattr(o, "error", None)]


# --------------------------------------------------------------------------------------------
# bench latency
# --------------------------------------------------------------------------------------------


def dummy_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[dict[str, list[int]]]:
    """vLLM's dummy batch: ``batch_size`` prompts of ``input_len`` random ids (seeded)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(_DUMMY_VOCAB, vocab_size), size=(batch_size, input_len))
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def latency_result(latencies: list[float], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    arr = np.asarray(latencies, dtype=float)
    pct = np.percentile(arr, LATENCY_PERCENTILES)
    return {
        "avg_latency": float(arr.mean()),
        "latencies": [float(x) for x in arr],
        "percentiles": {str(p): float(v) for p, v in zip(LATENCY_PERCENTILES, pct)},
        **(extra or {}),
    }


def run_latency(args: argparse.Namespace) -> int:
    _check_positive("--input-len", args.input_len)
    _check_positive("--output-len", args.output_len)
    _check_positive("--batch-size", args.batch_size)
    _check_positive("--num-iters", args.num_iters)
    _check_positive("--num-iters-warmup", args.num_iters_warmup, minimum=0)
    _check_positive("--n", args.n)
    llm = _make_llm(args)
    prompts = dummy_prompts(args.batch_size, args.input_len, llm.engine.arch.vocab_size, args.seed)
    params = _sampling_params(args, args.output_len)
    print(f"Latency: batch {args.batch_size}, input {args.input_len}, output {args.output_len} tokens, "
          f"n={args.n}, temperature {args.temperature}")

    def run_once() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        errs = _errors(outs)
        if errs:
            raise ConfigError("--input-len", f"requests failed: {errs[0]}")
        return dt

    for i in range(args.num_iters_warmup):
        dt = run_once()
        if not args.disable_tqdm:
            print(f"Warmup iteration {i + 1}/{args.num_iters_warmup}: {dt:.3f} s")
    before = llm.engine.stats.spec.copy()
    latencies = []
    for i in range(args.num_iters):
        latencies.append(run_once())
        if not args.disable_tqdm:
            print(f"Profiling iteration {i + 1}/{args.num_iters}: {latencies[-1]:.3f} s")
    spec = spec_summary(before, llm.engine.stats.spec)
    result = latency_result(latencies, {
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "n": args.n, "temperature": args.temperature, "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup, "spec_decode": spec, "load_avg_1m": _loadavg(),
        **_engine_info(llm, args),
    })
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, v in result["percentiles"].items():
        print(f"{p}% percentile latency: {v} seconds")
    if spec is not None:
        print(format_spec_summary(spec))
    if args.output_json:
        _write_json(args.output_json, result)
    return 0


def add_latency_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "latency", help="latency of one batch, in process (vLLM bench latency compatible)",
        description="Time LLM.generate on one batch of random-token prompts: average and percentile "
                    "latency of --num-iters runs after --num-iters-warmup untimed runs.",
    )
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-iters-warmup", type=int, default=2, help="untimed runs (vLLM: 10)")
    p.add_argument("--num-iters", type=int, default=5, help="timed runs (vLLM: 30)")
    _add_common_args(p)
    p.set_defaults(func=run_latency)
    return p


# --------------------------------------------------------------------------------------------
# bench throughput
# --------------------------------------------------------------------------------------------


def _dataset_options(args: argparse.Namespace) -> dict[str, Any]:
    """Loader options for ``sample_requests``; --input-len/--output-len override per dataset."""
    from tandem.bench.datasets import normalize_dataset_name

    name = normalize_dataset_name(args.dataset_name)
    out_len = args.output_len
    if name == "random":
        return {"input_len": args.input_len if args.input_len is not None else args.random_input_len,
                "output_len": out_len if out_len is not None else args.random_output_len,
                "range_ratio": args.random_range_ratio, "prefix_len": args.random_prefix_len}
    if name == "sharegpt":
        return {"output_len": out_len, "path": args.dataset_path}
    if name == "humaneval":
        return {"output_len": out_len if out_len is not None else 128, "path": args.dataset_path}
    if name == "prefix_repetition":
        return {"prefix_len": args.prefix_repetition_prefix_len,
                "suffix_len": args.prefix_repetition_suffix_len,
                "num_prefixes": args.prefix_repetition_num_prefixes,
                "output_len": out_len if out_len is not None else 128}
    return {"path": args.dataset_path, "output_len": out_len if out_len is not None else 256}


def throughput_result(outputs: list[Any], elapsed: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "output_tokens_per_second": output_tokens / elapsed,
        **(extra or {}),
    }


def run_throughput(args: argparse.Namespace) -> int:
    from tandem.bench.datasets import sample_requests

    _check_positive("--num-prompts", args.num_prompts)
    _check_positive("--n", args.n)
    if args.input_len is not None:
        _check_positive("--input-len", args.input_len, minimum=0)
    if args.output_len is not None:
        _check_positive("--output-len", args.output_len)
    llm = _make_llm(args)
    requests = sample_requests(args.dataset_name, llm.get_tokenizer(), args.num_prompts, seed=args.seed,
                               **_dataset_options(args))
    prompts = [r.prompt for r in requests]
    params = [_sampling_params(args, r.expected_output_len) for r in requests]
    if any(not isinstance(p, str) for p in prompts):
        raise ConfigError("--dataset-name", "chat-message prompts are not supported offline; use text prompts")
    before = llm.engine.stats.spec.copy()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - t0
    errs = _errors(outputs)
    if errs:
        print(f"warning: {len(errs)} of {len(outputs)} requests failed, e.g. {errs[0]}")
    ok = [o for o in outputs if not getattr(o, "error", None)]
    spec = spec_summary(before, llm.engine.stats.spec)
    result = throughput_result(ok, elapsed, {
        "dataset_name": args.dataset_name, "num_failed": len(errs), "temperature": args.temperature,
        "n": args.n, "seed": args.seed, "spec_decode": spec, "load_avg_1m": _loadavg(),
        **_engine_info(llm, args),
    })
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
    print(f"Total num output tokens:  {result['total_output_tokens']}")
    if spec is not None:
        print(format_spec_summary(spec))
    if args.output_json:
        _write_json(args.output_json, result)
    return 0 if not errs else 1


def add_throughput_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "throughput", help="offline throughput of a prompt set, in process (vLLM bench throughput compatible)",
        description="Submit --num-prompts prompts to one LLM.generate call and report requests/s, "
                    "total tokens/s and output tokens/s (plus speculative-decoding acceptance).",
    )
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random",
                   help="random | sharegpt | humaneval | prefix-repetition | custom (default: random)")
    g.add_argument("--dataset-path", default=None, help="file for custom; optional local copy for sharegpt/humaneval")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", type=int, default=None, help="random: prompt length (default 1024)")
    g.add_argument("--output-len", type=int, default=None,
                   help="output length for every request (default: random 128, humaneval 128, "
                        "sharegpt the reply's length)")
    g.add_argument("--random-input-len", type=int, default=1024, help=argparse.SUPPRESS)
    g.add_argument("--random-output-len", type=int, default=128, help=argparse.SUPPRESS)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    _add_common_args(p)
    p.set_defaults(func=run_throughput)
    return p


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
