"""``bench sweep --server NAME=URL ...``: the same workload table against servers already running.

Each ``--server`` is one method (start ``tandem serve`` once per speculative config, e.g. the
baseline on :8000 and n-gram on :8001); the first is the baseline. Every workload runs at every
concurrency against every server through ``bench serve``'s client (streaming; code completion on
``/v1/completions``, the chat workloads on ``/v1/chat/completions``), and the rows, table, JSON and
plot are the offline sweep's. Unlike the offline sweep, a server's state is not reset between cells:
a suffix server's global tree has seen the previous cells' answers (run one concurrency per server
start for cold numbers). The policy's drafting share is not read from the server (None).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tandem.bench.sweep_spec import WORKLOADS, CellResult, Workload
from tandem.errors import ConfigError


def parse_servers(items: Sequence[str]) -> list[tuple[str, str]]:
    """``["base=http://127.0.0.1:8000", ...]`` → [(name, url)]; names unique."""
    out = []
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ConfigError("--server", f"takes NAME=http://HOST:PORT, got {item!r}")
        out.append((name, url.rstrip("/")))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ConfigError("--server", f"names must be unique, got {names}")
    return out


def _cut(r: Any, tokenizer: Any, limit: int) -> Any:
    """A prompt of more than ``limit`` tokens keeps its last ``limit`` (decoded back to text)."""
    from tandem.bench.samples import SampleRequest
    from tandem.bench.tokens import decode, encode

    if not isinstance(r.prompt, str) or r.prompt_len <= limit:
        return r
    return SampleRequest(decode(tokenizer, encode(tokenizer, r.prompt)[-limit:]), limit, r.expected_output_len)


def run_server_cells(servers: Sequence[tuple[str, str]], workloads: Sequence[str], concurrencies: Sequence[int],
                     args: Any) -> list[CellResult]:
    from tandem.bench.datasets import sample_requests
    from tandem.bench.serve import DEFAULT_ENDPOINTS, ClientConfig, get_default_model, run_benchmark
    from tandem.bench.workload import load_tokenizer

    cells: list[CellResult] = []
    for name, url in servers:
        model = asyncio.run(get_default_model(url))
        tokenizer = load_tokenizer(args.tokenizer or model)
        for w in workloads:
            wl: Workload = WORKLOADS[w]
            opts: dict[str, Any] = {"output_len": args.output_len}
            if wl.dataset == "repeated_task":
                opts["repeats"] = args.repeated_task_repeats
            requests = sample_requests(wl.dataset, tokenizer, args.num_prompts, seed=args.seed, **opts)
            if args.max_prompt_len:
                requests = [_cut(r, tokenizer, args.max_prompt_len) for r in requests]
            backend = "openai-chat" if wl.chat else "openai"
            temp = args.code_temperature if w == "code" else wl.temperature
            client = ClientConfig(api_url=url + DEFAULT_ENDPOINTS[backend], model=model, backend=backend,
                                  temperature=temp, ignore_eos=args.ignore_eos)
            for c in concurrencies:
                best = None
                tputs: list[float] = []
                for _ in range(max(1, args.runs)):
                    res = asyncio.run(run_benchmark(requests, client, url, max_concurrency=c, seed=args.seed,
                                                    tokenizer=tokenizer, disable_tqdm=True, initial_test=False,
                                                    quiet=True))
                    tputs.append(res.metrics.output_throughput)
                    if best is None or res.metrics.output_throughput > best.metrics.output_throughput:
                        best = res
                assert best is not None
                m, sd = best.metrics, best.spec_decode
                errors = [r.error for r in best.results if getattr(r, "error", None)]
                if errors:
                    print(f"[{name}] {w} c={c}: {len(errors)} requests failed, e.g. {errors[0][:300]}", flush=True)
                cells.append(CellResult(
                    w, c, name, m.completed, m.total_output, best.duration, m.output_throughput, m.mean_tpot_ms,
                    m.mean_itl_ms, m.mean_ttft_ms,
                    sd.acceptance_rate / 100 if sd is not None and sd.acceptance_rate is not None else None,
                    sd.acceptance_length if sd is not None else None, None, m.failed, None, tuple(tputs)))
                print(f"[{name}] {w} c={c}: {m.output_throughput:.1f} tok/s, TPOT {m.mean_tpot_ms:.2f} ms", flush=True)
    return cells
