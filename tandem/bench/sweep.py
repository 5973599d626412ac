"""``tandem bench sweep``: the speculation workload table in one command (offline, in-process engine).

For every method (``baseline`` = no speculation, ``ngram``, ``suffix``, or any ``--config`` JSON) one
engine is built — all at once, and each cell alternates the methods' timed runs (A B C A B C ...;
``--interleave``, the default: a machine whose speed drifts weighs on every method of a cell alike); for
every workload, every concurrency and every timed run its state is reset (a fresh proposer and
policy: the suffix proposer's global tree must not remember the previous run's answers to the same
prompts), a few untimed random-token requests warm it up, and the workload runs ``--runs`` times with
at most ``concurrency`` requests in flight (the best run counts). Workloads:

==========  =====================================================  =============
workload    prompts                                                temperature
==========  =====================================================  =============
code        HumanEval completion (raw prompt)                      0.0 (--code-temperature)
edit        "rewrite this function" over HumanEval (chat)          0.0
chat        ShareGPT first turns (chat)                            0.8
repeated    the edit tasks asked again with small changes (chat)   0.0
==========  =====================================================  =============

"chat" prompts go through the model's chat template when it has one. Per cell: mean TPOT and ITL
(the gap between successive outputs of a request, as a streaming client sees it), output throughput,
speedup over the baseline's throughput at the same workload and concurrency, acceptance (rate, mean
acceptance length) and the policy's drafting share. Written: ``sweep.json`` and, with matplotlib
installed, ``sweep.png`` (speedup vs concurrency per workload). The rows, table and plot live in
``sweep_output.py``; ``--server NAME=URL`` (repeated) measures running servers instead
(``sweep_server.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tandem.bench.sweep_spec import WORKLOADS, CellResult, Method, Workload
from tandem.config.cache import CacheConfig
from tandem.errors import ConfigError


# ---- methods -------------------------------------------------------------------------------------
def method_presets(names: Sequence[str], k: int, policy: str) -> list[Method]:
    """``baseline`` / ``ngram`` (k, prompt lookup 1..5: the engine defaults) / ``suffix`` (vLLM's defaults); ``policy``:
    ``default`` leaves ``disable_by_acceptance`` unset, ``on`` / ``off`` set it."""
    out = []
    for name in names:
        if name == "baseline":
            out.append(Method(name, None))
            continue
        if name == "ngram":
            spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k}
        elif name == "suffix":
            spec = {"method": "suffix"}
        else:
            raise ConfigError("--methods", f"unknown method {name!r}", allowed=["baseline", "ngram", "suffix"])
        out.append(Method(name, with_policy(spec, policy)))
    return out


def with_policy(spec: dict[str, Any], policy: str) -> dict[str, Any]:
    if policy == "default" or "disable_by_acceptance" in spec:
        return spec
    return {**spec, "disable_by_acceptance": policy == "on"}


def parse_config(text: str, policy: str) -> Method:
    """``--config``: a JSON file or inline JSON object: a speculative config plus ``"name"``, or
    ``{"name": ..., "speculative_config": {...} | null}``."""
    path = Path(text)
    raw = path.read_text(encoding="utf-8") if not text.lstrip().startswith("{") and path.is_file() else text
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError("--config", f"not a JSON object or file: {text!r} ({exc.msg})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ConfigError("--config", f"needs a JSON object with a \"name\", got {text!r}")
    obj = dict(obj)
    name = obj.pop("name")
    spec = obj.pop("speculative_config") if "speculative_config" in obj else (obj or None)
    if spec is not None and not isinstance(spec, dict):
        raise ConfigError("--config", f"speculative_config of {name!r} must be an object or null")
    if spec is not None:
        from tandem.config.speculative import SpeculativeConfig

        SpeculativeConfig.from_dict(spec)  # a bad key fails now, naming the key, not after an hour
        spec = with_policy(spec, policy)
    return Method(name, spec)


def parse_int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(flag, f"comma-separated integers expected, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise ConfigError(flag, f"values must be >= 1, got {text!r}")
    return values


# ---- prompts -------------------------------------------------------------------------------------
def workload_prompts(engine: Any, workload: Workload, num_prompts: int, seed: int, output_len: int,
                     repeats: int = 4, max_prompt_len: int | None = None) -> list[list[int]]:
    """Token ids of the workload's prompts (chat workloads through the chat template if any). Prompts
    longer than ``max_model_len − output_len`` (or ``max_prompt_len``) keep their last tokens (a
    warning says how many)."""
    from tandem.bench.datasets import sample_requests
    from tandem.loader.tokenizer import apply_chat_template

    tok = engine.tokenizer
    opts: dict[str, Any] = {"output_len": output_len}
    if workload.dataset == "repeated_task":
        opts["repeats"] = repeats
    reqs = sample_requests(workload.dataset, tok, num_prompts, seed=seed, **opts)
    template = workload.chat and getattr(tok, "chat_template", None)
    out = []
    for r in reqs:
        text = r.prompt if isinstance(r.prompt, str) else "\n".join(m.get("content", "") for m in r.prompt)
        if template:
            out.append(apply_chat_template(tok, [{"role": "user", "content": text}], True))
        else:
            out.append(engine.encode(text))
    limit = engine.max_model_len - output_len
    if max_prompt_len:
        limit = min(limit, max_prompt_len)
    if limit < 8:
        raise ConfigError("--output-len", f"{output_len} leaves no room for a prompt within max_model_len "
                          f"{engine.max_model_len}")
    cut = sum(1 for ids in out if len(ids) > limit)
    if cut:
        print(f"warning: {workload.name}: {cut} of {len(out)} prompts cut to their last {limit} tokens "
              f"(max_model_len {engine.max_model_len}, output_len {output_len}, --max-prompt-len {max_prompt_len})")
    return [list(ids[-limit:]) if len(ids) > limit else list(ids) for ids in out]


# ---- one cell ------------------------------------------------------------------------------------
@dataclass
class _Timing:
    arrival: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


def drive(engine: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], concurrency: int
          ) -> dict[str, Any]:
    """Run ``prompts`` through ``engine`` with at most ``concurrency`` in flight; per-request timings."""
    queue = deque(zip(prompts, params))
    timings: dict[str, _Timing] = {}
    itls: list[float] = []
    tpots: list[float] = []
    ttfts: list[float] = []
    out_tokens = errors = 0
    t0 = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and len(timings) < concurrency:
            ids, p = queue.popleft()
            rid = engine.new_request_id()
            engine.add_request(rid, None, p, prompt_token_ids=list(ids))
            timings[rid] = _Timing(time.perf_counter())
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            t = timings.get(o.request_id)
            if t is None:
                continue
            n = max((len(c.token_ids) for c in o.outputs), default=0)
            if n > t.tokens:
                if t.first is None:
                    t.first = now
                    ttfts.append(now - t.arrival)
                elif t.last is not None:
                    itls.append(now - t.last)
                t.last, t.tokens = now, n
            if o.finished:
                del timings[o.request_id]
                if getattr(o, "error", None):
                    errors += 1
                out_tokens += t.tokens
                if t.first is not None and t.tokens > 1:
                    tpots.append((now - t.first) / (t.tokens - 1))
    duration = time.perf_counter() - t0

    def mean_ms(xs: list[float]) -> float:
        return 1000 * sum(xs) / len(xs) if xs else 0.0

    return {"duration_s": duration, "output_tokens": out_tokens, "mean_tpot_ms": mean_ms(tpots),
            "mean_itl_ms": mean_ms(itls), "mean_ttft_ms": mean_ms(ttfts), "num_errors": errors}


def reset_speculation(engine: Any) -> None:
    """A fresh proposer (token proposers: the suffix global tree starts empty) and a fresh policy,
    except its step-cost model: what a step of each shape costs belongs to this machine, not to the
    run (a server has measured it within its first minute), while a fresh one spent a whole run at
    c = 8 learning it again on the H200 (docs/performance.md §44). Acceptance estimates, the guard
    and the proposer's state start afresh."""
    cfg = engine.spec
    if cfg is None:
        return
    from tandem.spec_decode.proposers import TokenProposerAdapter, build_proposer

    old = engine.policy
    if isinstance(engine.proposer, TokenProposerAdapter):
        engine.proposer = build_proposer(cfg, None, engine.generator)
    engine.spec = cfg
    if old is not None and engine.policy is not None:
        engine.policy.cost = old.cost


def run_cell(engine: Any, workload: Workload, method: str, prompts: Sequence[Sequence[int]], concurrency: int,
             output_len: int, *, runs: int = 1, warmup: int = 1, seed: int = 0, ignore_eos: bool = False,
             temperature: float | None = None) -> CellResult:
    """One method's cell: warm-up, then ``runs`` timed runs (the best counts)."""
    return run_cells([engine], workload, [method], prompts, concurrency, output_len, runs=runs, warmup=warmup,
                     seed=seed, ignore_eos=ignore_eos, temperature=temperature)[0]


def run_cells(engines: Sequence[Any], workload: Workload, methods: Sequence[str], prompts: Sequence[Sequence[int]],
              concurrency: int, output_len: int, *, runs: int = 1, warmup: int = 1, seed: int = 0,
              ignore_eos: bool = False, temperature: float | None = None) -> list[CellResult]:
    """One cell for several methods (one engine each): every engine is warmed up, then the timed
    runs alternate between the methods (A B C A B C ...) so that a machine whose speed drifts during
    the cell weighs on every method alike; per method the best run counts (every run's throughput is
    kept: ``CellResult.run_throughputs``)."""
    from tandem.bench.offline import dummy_prompts
    from tandem.sampling_params import SamplingParams

    temp = workload.temperature if temperature is None else temperature
    params = [SamplingParams(temperature=temp, max_tokens=output_len, ignore_eos=ignore_eos,
                             seed=None if temp == 0 else seed + i) for i in range(len(prompts))]
    for engine in engines:
        vocab = engine.arch.vocab_size
        for w in range(warmup):
            warm = [d["prompt_token_ids"] for d in dummy_prompts(min(concurrency, 8), 16, vocab, seed + 1000 + w)]
            drive(engine, warm, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * len(warm),
                  concurrency)
    best: list[tuple[dict[str, Any], Any, Any] | None] = [None] * len(engines)
    tputs: list[list[float]] = [[] for _ in engines]
    for _ in range(max(1, runs)):
        for i, engine in enumerate(engines):
            # every run starts afresh: otherwise the suffix proposer's global cache would hold the
            # previous run's answers to the very same prompts (and the policy its estimates)
            reset_speculation(engine)
            before = engine.stats.spec.copy()
            m = drive(engine, prompts, params, concurrency)
            after = engine.stats.spec.copy()
            tputs[i].append(m["output_tokens"] / m["duration_s"] if m["duration_s"] > 0 else 0.0)
            old = best[i]
            if old is None or tputs[i][-1] > max(tputs[i][:-1]):
                best[i] = (m, before, after)
    return [_cell_result(engine, workload, method, len(prompts), concurrency, b, tuple(t))
            for engine, method, b, t in zip(engines, methods, best, tputs, strict=True)]


def _cell_result(engine: Any, workload: Workload, method: str, num_prompts: int, concurrency: int,
                 best: tuple[dict[str, Any], Any, Any] | None, run_throughputs: tuple[float, ...]) -> CellResult:
    assert best is not None
    m, before, after = best
    drafts = after.num_drafts - before.num_drafts
    dtok = after.num_draft_tokens - before.num_draft_tokens
    acc = after.num_accepted_tokens - before.num_accepted_tokens
    decided = [a - (before.chosen_k[i] if i < len(before.chosen_k) else 0) for i, a in enumerate(after.chosen_k)]
    policy_on = getattr(engine, "policy", None) is not None
    held = after.num_assumed_held - before.num_assumed_held
    failed = after.num_assumed_failed - before.num_assumed_failed
    return CellResult(
        workload.name, concurrency, method, num_prompts, m["output_tokens"], m["duration_s"],
        m["output_tokens"] / m["duration_s"] if m["duration_s"] > 0 else 0.0,
        m["mean_tpot_ms"], m["mean_itl_ms"], m["mean_ttft_ms"],
        acc / dtok if dtok else None, 1 + acc / drafts if drafts else None,
        (sum(decided) - decided[0]) / sum(decided) if policy_on and sum(decided) else (None if not policy_on else 0.0),
        m["num_errors"],
        held / (held + failed) if held + failed else None,
        run_throughputs,
    )


# ---- the sweep -----------------------------------------------------------------------------------
def run_sweep(args: argparse.Namespace) -> int:
    from tandem.bench.sweep_output import format_table, speedup_rows, write_plot

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            raise ConfigError("--workloads", f"unknown workload {w!r}", allowed=list(WORKLOADS))
    concurrencies = parse_int_list("--concurrency", args.concurrency)
    if args.num_prompts < 1 or args.output_len < 1:
        raise ConfigError("--num-prompts" if args.num_prompts < 1 else "--output-len", "must be >= 1")
    out_dir = Path(args.result_dir or f"bench_results/sweep-{datetime.now():%Y%m%d-%H%M%S}")
    if args.server:
        from tandem.bench.sweep_server import parse_servers, run_server_cells

        servers = parse_servers(args.server)
        cells = run_server_cells(servers, workloads, concurrencies, args)
        names = [n for n, _ in servers]
        meta: dict[str, Any] = {"servers": dict(servers)}
    else:
        cells, names, meta = _run_offline(args, workloads, concurrencies)
    rows = speedup_rows(cells, baseline=names[0])
    print()
    print(format_table(rows, workloads, concurrencies, names))
    out_dir.mkdir(parents=True, exist_ok=True)
    meta.update({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "num_prompts": args.num_prompts,
        "output_len": args.output_len, "seed": args.seed, "runs": args.runs, "warmup": args.warmup,
        "policy": args.policy, "baseline": names[0], "workloads": workloads, "concurrencies": concurrencies,
        "temperatures": {w: (args.code_temperature if w == "code" else WORKLOADS[w].temperature) for w in workloads},
    })
    (out_dir / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"results: {out_dir / 'sweep.json'}")
    plot = write_plot(rows, workloads, out_dir / "sweep.png")
    print(f"plot: {plot}" if plot else "plot skipped: matplotlib is not installed (pip install matplotlib)")
    return 1 if any(c.num_errors for c in cells) else 0


def _run_offline(args: argparse.Namespace, workloads: Sequence[str], concurrencies: Sequence[int]
                 ) -> tuple[list[CellResult], list[str], dict[str, Any]]:
    from tandem.config.speculative import DEPRECATED_KWARGS
    from tandem.engine.args import engine_kwargs
    from tandem.engine.llm import LLM

    k = getattr(args, "num_speculative_tokens", None) or 4  # the engine's --num-speculative-tokens
    methods = method_presets([m.strip() for m in args.methods.split(",") if m.strip()], k, args.policy)
    methods += [parse_config(c, args.policy) for c in args.config or []]
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ConfigError("--config", f"method names must be unique, got {names}")
    kw = engine_kwargs(args)
    for key in ("speculative_config", *DEPRECATED_KWARGS):  # speculation comes from the methods
        kw.pop(key, None)
    cells: list[CellResult] = []
    meta: dict[str, Any] = {}

    def measure(llms: Sequence[Any], group: Sequence[Method], w: str, prompts: list[list[int]], c: int) -> None:
        got = run_cells([llm.engine for llm in llms], WORKLOADS[w], [m.name for m in group], prompts, c,
                        args.output_len, runs=args.runs, warmup=args.warmup, seed=args.seed,
                        ignore_eos=args.ignore_eos, temperature=args.code_temperature if w == "code" else None)
        for method, cell in zip(group, got):
            cells.append(cell)
            print(f"[{method.name}] {w} c={c}: {cell.output_throughput:.1f} tok/s, TPOT {cell.mean_tpot_ms:.2f} ms"
                  + (f", acceptance {cell.acceptance_rate:.2f}" if cell.acceptance_rate is not None else "")
                  + (f", chained drafts' assumption held {cell.assumptions_held:.2f}"
                     if cell.assumptions_held is not None else ""),
                  flush=True)

    def prompts_for(llm: Any, w: str) -> list[list[int]]:
        return workload_prompts(llm.engine, WORKLOADS[w], args.num_prompts, args.seed, args.output_len,
                                args.repeated_task_repeats, args.max_prompt_len)

    if args.interleave:  # every engine at once; each cell measures the methods back to back
        llms = [LLM(args.model, **shared_memory(kw, i, len(methods)), speculative_config=m.speculative_config)
                for i, m in enumerate(methods)]
        for w in workloads:
            prompts = prompts_for(llms[0], w)
            for c in concurrencies:
                measure(llms, methods, w, prompts, c)
        meta = _engine_meta(args, llms[0].engine)
        del llms
        _free_memory()
    else:  # one engine at a time (less memory; slow drift of the machine shows between methods)
        for method in methods:
            llm = LLM(args.model, **kw, speculative_config=method.speculative_config)
            meta = meta or _engine_meta(args, llm.engine)
            for w in workloads:
                prompts = prompts_for(llm, w)
                for c in concurrencies:
                    measure([llm], [method], w, prompts, c)
            del llm
            _free_memory()
    meta["methods"] = {m.name: m.speculative_config for m in methods}
    return cells, names, meta


def shared_memory(kw: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    """Engine ``i`` of ``n`` living in one process at once: ``gpu_memory_utilization`` is the share of
    the GPU that the process may fill, and each engine's KV cache takes what the engines before it
    left of that share (``kv_budget_bytes``), so the first would have taken all of it and the next
    found none ("KV cache of 0.0 KiB"). Engine ``i`` fills the process up to ``(i + 1) / n`` of the
    share instead. An explicit ``kv_cache_memory_bytes`` is each engine's as given (and the CPU
    sizes its KV cache by use)."""
    if n <= 1 or kw.get("kv_cache_memory_bytes") is not None:
        return kw
    share = kw.get("gpu_memory_utilization", CacheConfig.gpu_memory_utilization)
    return {**kw, "gpu_memory_utilization": share * (i + 1) / n}


def _engine_meta(args: argparse.Namespace, eng: Any) -> dict[str, Any]:
    return {"model": args.model, "device": str(eng.device), "dtype": str(eng.dtype).replace("torch.", ""),
            "interleave": args.interleave}


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_sweep_parser(subparsers: Any) -> argparse.ArgumentParser:
    from tandem.engine.args import add_engine_args
    from tandem.loader.registry import DEFAULT_MODEL

    p = subparsers.add_parser(
        "sweep", help="speculation methods x workloads x concurrency, offline (the workload table)",
        description="Run code / edit / chat / repeated-task workloads at each concurrency for each "
                    "method (baseline, ngram, suffix, --config ...) in-process and print TPOT, ITL, "
                    "throughput, speedup over the baseline and acceptance; writes sweep.json and sweep.png.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF directory, .gguf file or tandem alias")
    p.add_argument("--workloads", default="code,edit,chat,repeated", help=f"comma-separated from {','.join(WORKLOADS)}")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated max requests in flight")
    p.add_argument("--methods", default="baseline,ngram,suffix",
                   help="comma-separated presets (baseline, ngram, suffix); the first method is the baseline")
    p.add_argument("--config", action="append", default=None, metavar="FILE.json|JSON",
                   help='an extra method: {"name": ..., <speculative config keys>}; repeat')
    p.add_argument("--policy", choices=("default", "on", "off"), default="default",
                   help="the goodput policy (disable_by_acceptance): default = the engine's (on for CUDA)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256, help="max tokens per request")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--code-temperature", type=float, default=0.0, help="the code workload's temperature (<= 0.5)")
    p.add_argument("--repeated-task-repeats", type=int, default=4)
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="prompts longer than this many tokens keep their last ones (default: what fits)")
    p.add_argument("--runs", type=int, default=1, help="timed runs per cell (the best counts)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="load every method's engine at once and measure each cell's methods back to back "
                        "(default; --no-interleave: one engine at a time, less memory)")
    p.add_argument("--warmup", type=int, default=1, help="untimed random-token warm-up batches per cell")
    p.add_argument("--result-dir", default=None, help="default: bench_results/sweep-DATE")
    p.add_argument("--server", action="append", default=None, metavar="NAME=URL",
                   help="measure running servers instead (one per method, the first is the baseline); repeat")
    add_engine_args(p)
    p.set_defaults(func=run_sweep)
    return p
