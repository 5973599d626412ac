"""``bench compare``: the same workload against several ``tandem serve`` configurations.

For each config (a JSON dict of ``tandem serve`` options) a fresh server subprocess is started,
``GET /health`` is awaited, the identical workload (same seed, same prompts) is run at every
``--concurrency`` level, and the server is stopped. One table then compares the configs per
concurrency against the first (baseline) config, with PNG plots and a results JSON.

Pieces: configs and their server command (``compare_config.py``), the server subprocess
(``compare_server.py``), the table and η (``compare_table.py``), plots and JSON
(``compare_output.py``).
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.bench.compare_config import CompareError, load_config, server_command
from tandem.bench.compare_output import results_json, write_plots
from tandem.bench.compare_server import ServerProcess
from tandem.bench.compare_table import RunSummary, compute_rows, format_table
from tandem.errors import TandemError


def parse_concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise CompareError(f"--concurrency must be comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise CompareError(f"--concurrency values must be >= 1, got {text!r}")
    return values


def run_compare(args: Any) -> int:
    """Entry for ``tandem bench compare`` (args from ``cli.add_bench_subparsers``)."""
    from tandem.bench.workload import load_tokenizer, sample_from_args
    from tandem.bench.serve import ClientConfig, DEFAULT_ENDPOINTS, get_default_model, result_to_json, run_benchmark

    configs = [load_config(p, i) for i, p in enumerate(args.config)]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise CompareError(f"config names must be unique, got {names}")
    for c in configs:
        if not (c.model or args.model):
            raise CompareError(f"config {c.name!r} has no model: pass --model or put \"model\" in the config")
    concurrencies = parse_concurrencies(args.concurrency)
    out_dir = Path(args.result_dir or f"bench_results/compare-{datetime.now():%Y%m%d-%H%M%S}")
    errors: dict[str, str] = {}
    model0 = configs[0].model or args.model
    tokenizer = load_tokenizer(args.tokenizer or model0, getattr(args, "trust_remote_code", False))
    requests = sample_from_args(args, tokenizer)
    print(f"Workload: {len(requests)} prompts from {args.dataset_name} (seed {args.seed}), "
          f"concurrency {concurrencies}; results → {out_dir}")

    runs: dict[tuple[str, int], RunSummary] = {}
    for i, cfg in enumerate(configs):
        model = cfg.model or args.model
        port = args.port_base + i
        log_path = out_dir / f"server-{cfg.name}.log"
        server = ServerProcess(server_command(model, port, cfg.options), port, log_path, cfg.name)
        print(f"\n[{cfg.name}] starting: {shlex.join(server.cmd)}")
        try:
            server.start(args.server_timeout)
            served = asyncio.run(get_default_model(server.base_url))
            client = ClientConfig(
                api_url=server.base_url + DEFAULT_ENDPOINTS[args.backend],
                model=served,
                backend=args.backend,
                temperature=args.temperature,
                ignore_eos=args.ignore_eos,
            )
            for conc in concurrencies:
                print(f"[{cfg.name}] concurrency {conc}")
                res = asyncio.run(
                    run_benchmark(
                        requests, client, server.base_url, request_rate=args.request_rate,
                        burstiness=args.burstiness, max_concurrency=conc, seed=args.seed,
                        tokenizer=tokenizer, disable_tqdm=args.disable_tqdm, quiet=True,
                    )
                )
                m = res.metrics
                runs[(cfg.name, conc)] = RunSummary(
                    cfg.name, conc, m.mean_tpot_ms, m.mean_ttft_ms, m.output_throughput, m.completed,
                    m.failed, res.spec_decode.to_dict() if res.spec_decode else None, res.duration,
                )
                detail = result_to_json(
                    res, backend=args.backend, model_id=model, tokenizer_id=args.tokenizer or model0,
                    num_prompts=len(requests), request_rate=args.request_rate, burstiness=args.burstiness,
                    max_concurrency=conc, label=cfg.name,
                )
                run_dir = out_dir / "runs"
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / f"{cfg.name}-c{conc}.json").write_text(json.dumps(detail), encoding="utf-8")
                if res.interrupted:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            errors[cfg.name] = "interrupted"
            print(f"[{cfg.name}] interrupted; reporting what was measured")
            break
        except TandemError as exc:
            errors[cfg.name] = str(exc)
            print(f"[{cfg.name}] FAILED: {exc}", file=sys.stderr)
        finally:
            server.stop()

    rows = compute_rows(configs, runs, concurrencies)
    print()
    print(format_table(rows, configs))
    meta = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model": args.model,
        "tokenizer": args.tokenizer or model0,
        "dataset_name": args.dataset_name,
        "num_prompts": len(requests),
        "seed": args.seed,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "concurrencies": concurrencies,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(
        json.dumps(results_json(configs, runs, rows, meta, errors), indent=2), encoding="utf-8"
    )
    if runs:
        for p in write_plots(configs, runs, concurrencies, out_dir):
            print(f"plot: {p}")
    print(f"results: {out_dir / 'compare.json'}")
    return 1 if errors else 0
