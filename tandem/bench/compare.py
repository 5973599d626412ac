"""``bench compare``: the same workload against several ``tandem serve`` configurations.

For each config (a JSON dict of ``tandem serve`` options) a fresh server subprocess is started,
``GET /health`` is awaited, the identical workload (same seed, same prompts) is run at every
``--concurrency`` level, and the server is stopped. One table then compares the configs per
concurrency against the first (baseline) config, with PNG plots and a results JSON.

Config dict → server command: ``[python, -m, tandem.serve, MODEL, --port, P, ...]`` where each key
becomes ``--key-with-dashes``; dict values are passed as JSON, lists as separate values, ``True``
as a bare flag and ``False`` as ``--no-key``. Prefix caching is OFF (``--no-enable-prefix-caching``)
unless the config sets ``"enable_prefix_caching": true``, so cache hits cannot masquerade as
speculative gains. Keys that are not server options: ``name``, ``model`` (overrides ``--model``),
``cost_c``, ``cost_v``, ``draft_cost_ratio``.

Engine efficiency η (ASSUMPTIONS — printed with every table):
- measured speedup = baseline mean TPOT / config mean TPOT (same concurrency);
- cost-model speedup S = (1 − α^{k+1}) / ((1 − α)(k·c + 1 + v))  (Leviathan et al.), with
  k = ``speculative_config.num_speculative_tokens``;
  α = per-token acceptance, solved from the measured per-position acceptance p_i (fractions) as the
      α whose i.i.d. model accepts as many tokens per draft: Σ_{i=1..k} α^i = Σ_i p_i (= τ − 1),
      so the model's tokens-per-step (1 − α^{k+1})/(1 − α) equals the measured τ;
  c = ``cost_c`` if given, else 0 for n-gram/suffix proposers (drafting on the CPU, no model),
      else ``draft_cost_ratio`` (e.g. draft/target parameter ratio) if given, else unknown (η n/a);
  v = ``cost_v`` if given, else 0 (verifying k+1 tokens assumed to cost the same as decoding one);
- η = measured speedup / S. η ≈ 1: the engine delivers what acceptance allows; η < 1: overheads
  (verify cost, scheduling, batching — S is a batch-1 model, so η falls with concurrency by design).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tandem.errors import TandemError

META_KEYS = frozenset({"name", "model", "cost_c", "cost_v", "draft_cost_ratio"})
FREE_DRAFT_METHODS = frozenset({"ngram", "suffix", "prompt_lookup"})


class CompareError(TandemError, RuntimeError):
    """A comparison cannot proceed (bad config file, server failed to start…)."""


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompareConfig:
    name: str
    options: dict[str, Any]  # tandem serve options, META_KEYS removed
    model: str | None = None
    method: str | None = None
    k: int | None = 0  # num_speculative_tokens; 0 = no speculation; None = not stated (variable)
    cost_c: float | None = None
    cost_v: float = 0.0
    c_source: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any], fallback_name: str) -> CompareConfig:
        if not isinstance(d, dict):
            raise CompareError(f"config {fallback_name!r} must be a JSON object of tandem serve options")
        spec = d.get("speculative_config")
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise CompareError(f"config {fallback_name!r}: speculative_config is not JSON: {exc}") from exc
        spec = spec or {}
        method = spec.get("method")
        k: int | None = 0
        if spec:  # None: speculation with a variable/unstated k (taken from the measured positions)
            k = None if spec.get("num_speculative_tokens") is None else int(spec["num_speculative_tokens"])
        if "cost_c" in d:
            cost_c, source = float(d["cost_c"]), "cost_c from config"
        elif k == 0:
            cost_c, source = 0.0, "no speculation"
        elif method in FREE_DRAFT_METHODS:
            cost_c, source = 0.0, f"{method} proposer: drafting cost taken as 0"
        elif "draft_cost_ratio" in d:
            cost_c, source = float(d["draft_cost_ratio"]), "draft_cost_ratio from config"
        else:
            cost_c, source = None, "unknown: give cost_c or draft_cost_ratio"
        return cls(
            name=str(d.get("name") or fallback_name),
            options={k_: v for k_, v in d.items() if k_ not in META_KEYS},
            model=d.get("model"),
            method=method,
            k=k,
            cost_c=cost_c,
            cost_v=float(d.get("cost_v", 0.0)),
            c_source=source,
        )


def load_config(path: str | Path) -> CompareConfig:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CompareError(f"cannot read config {path}: {exc}") from exc
    return CompareConfig.from_dict(data, Path(path).stem)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def server_command(model: str, port: int, options: dict[str, Any]) -> list[str]:
    """The ``tandem serve`` argv for one config (see module docstring for the mapping)."""
    opts = dict(options)
    opts["enable_prefix_caching"] = bool(opts.get("enable_prefix_caching", False))
    cmd = [sys.executable, "-m", "tandem.serve", model, "--port", str(port)]
    for key, value in opts.items():
        if value is None:
            continue
        if isinstance(value, bool):
            cmd.append(_flag(key) if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            cmd += [_flag(key), json.dumps(value)]
        elif isinstance(value, list):
            cmd += [_flag(key), *map(str, value)]
        else:
            cmd += [_flag(key), str(value)]
    return cmd


# --------------------------------------------------------------------------------------------
# Server subprocess
# --------------------------------------------------------------------------------------------


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """One ``tandem serve`` subprocess in its own session; output goes to ``log_path``."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, name: str) -> None:
        self.cmd, self.port, self.log_path, self.name = cmd, port, log_path, name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, startup_timeout_s: float) -> None:
        if not _port_free(self.port):
            raise CompareError(f"port {self.port} is in use; pick another with --port-base")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + startup_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise CompareError(
                    f"server for config {self.name!r} exited with code {rc} before becoming healthy.\n"
                    f"command: {shlex.join(self.cmd)}\nlast lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise CompareError(
                    f"server for config {self.name!r} not healthy after {startup_timeout_s:.0f} s "
                    f"(raise --server-timeout?).\nlast lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)  # its own session: the server and its children
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


# --------------------------------------------------------------------------------------------
# Arithmetic: α, cost model, rows
# --------------------------------------------------------------------------------------------


def estimate_alpha(mean_accepted: float, k: int) -> float:
    """α with Σ_{i=1..k} α^i = mean accepted tokens per draft (bisection; clamps to [0, 1])."""
    if k <= 0 or mean_accepted <= 0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, k + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def cost_model_speedup(alpha: float, k: int, c: float, v: float = 0.0) -> float:
    """S = (1 − α^{k+1}) / ((1 − α)(k·c + 1 + v)); at α = 1 the numerator ratio is k + 1."""
    tokens_per_step = (k + 1.0) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens_per_step / (k * c + 1.0 + v)


@dataclass
class RunSummary:
    """What the table needs from one (config, concurrency) run. ``spec_decode``: SpecDecodeStats dict."""

    config: str
    concurrency: int
    mean_tpot_ms: float
    mean_ttft_ms: float
    output_throughput: float
    completed: int
    failed: int
    spec_decode: dict[str, Any] | None = None
    duration: float = 0.0


@dataclass
class CompareRow:
    concurrency: int
    config: str
    tpot_ms: float
    ttft_ms: float
    output_throughput: float
    speedup_tpot: float | None
    speedup_throughput: float | None
    tau: float | None
    acceptance_rate: float | None  # percent
    alpha: float | None
    k: int
    model_speedup: float | None
    efficiency: float | None
    failed: int


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 and num > 0 else None


def compute_rows(
    configs: Sequence[CompareConfig], runs: dict[tuple[str, int], RunSummary], concurrencies: Sequence[int]
) -> list[CompareRow]:
    """One row per (concurrency, config) that ran; the first config is the baseline."""
    rows = []
    base = configs[0].name
    for conc in concurrencies:
        b = runs.get((base, conc))
        for cfg in configs:
            r = runs.get((cfg.name, conc))
            if r is None:
                continue
            sp_tpot = _ratio(b.mean_tpot_ms, r.mean_tpot_ms) if b else None
            sp_tput = _ratio(r.output_throughput, b.output_throughput) if b else None
            sd = r.spec_decode or {}
            tau = sd.get("acceptance_length")
            per_pos = [p / 100.0 for p in sd.get("per_position_acceptance_rates") or []]
            k = len(per_pos) if cfg.k is None else cfg.k
            alpha = model_s = eff = None
            if k == 0:
                alpha, model_s = None, 1.0 / (1.0 + cfg.cost_v)
            elif per_pos or tau is not None:
                mean_acc = sum(per_pos) if per_pos else tau - 1.0
                alpha = estimate_alpha(mean_acc, k)
                if cfg.cost_c is not None:
                    model_s = cost_model_speedup(alpha, k, cfg.cost_c, cfg.cost_v)
            if model_s and sp_tpot is not None:
                eff = sp_tpot / model_s
            rows.append(
                CompareRow(
                    concurrency=conc,
                    config=cfg.name,
                    tpot_ms=r.mean_tpot_ms,
                    ttft_ms=r.mean_ttft_ms,
                    output_throughput=r.output_throughput,
                    speedup_tpot=sp_tpot,
                    speedup_throughput=sp_tput,
                    tau=tau,
                    acceptance_rate=sd.get("acceptance_rate"),
                    alpha=alpha,
                    k=k,
                    model_speedup=model_s,
                    efficiency=eff,
                    failed=r.failed,
                )
            )
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_assumptions(configs: Sequence[CompareConfig]) -> str:
    lines = [
        "η = measured TPOT speedup / cost-model S;  S = (1 − α^(k+1)) / ((1 − α)(k·c + 1 + v))",
        "α solved from measured per-position acceptance: Σ_{i=1..k} α^i = Σ_i p_i (= τ − 1)",
    ]
    for c in configs:
        c_txt = "unknown" if c.cost_c is None else f"{c.cost_c:g}"
        k_txt = "from measured positions" if c.k is None else str(c.k)
        lines.append(f"  {c.name}: k={k_txt}, c={c_txt} ({c.c_source}), v={c.cost_v:g}"
                     + (" (cost_v from config)" if c.cost_v else " (assumed)"))
    return "\n".join(lines)


def format_table(rows: Sequence[CompareRow], configs: Sequence[CompareConfig]) -> str:
    head = (
        f"{'conc':>5} {'config':<18} {'TPOT ms':>9} {'TTFT ms':>9} {'out tok/s':>10} "
        f"{'xTPOT':>6} {'xtput':>6} {'tau':>5} {'acc %':>6} {'alpha':>6} {'S':>5} {'eta':>5} {'fail':>4}"
    )
    title = f" Speculative decoding comparison (baseline: {configs[0].name}) "
    out = [f"{title:=^{len(head)}}", head, "-" * len(head)]
    last_conc = None
    for r in rows:
        if last_conc is not None and r.concurrency != last_conc:
            out.append("")
        last_conc = r.concurrency
        out.append(
            f"{r.concurrency:>5} {r.config[:18]:<18} {r.tpot_ms:>9.2f} {r.ttft_ms:>9.2f} {r.output_throughput:>10.1f} "
            f"{_fmt(r.speedup_tpot, '.2f'):>6} {_fmt(r.speedup_throughput, '.2f'):>6} {_fmt(r.tau, '.2f'):>5} "
            f"{_fmt(r.acceptance_rate, '.1f'):>6} {_fmt(r.alpha, '.3f'):>6} {_fmt(r.model_speedup, '.2f'):>5} "
            f"{_fmt(r.efficiency, '.2f'):>5} {r.failed:>4}"
        )
    out += ["=" * len(head), format_assumptions(configs)]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Plots and results JSON
# --------------------------------------------------------------------------------------------


def aggregate_per_position(runs: Sequence[RunSummary]) -> list[float]:
    """Per-position acceptance (%) over several runs, weighted by each run's number of drafts."""
    total_drafts = 0.0
    acc: list[float] = []
    for r in runs:
        sd = r.spec_decode or {}
        drafts, rates = sd.get("num_drafts") or 0, sd.get("per_position_acceptance_rates") or []
        if drafts <= 0 or not rates:
            continue
        acc += [0.0] * (len(rates) - len(acc))
        for i, rate in enumerate(rates):
            acc[i] += rate * drafts
        total_drafts += drafts
    return [a / total_drafts for a in acc] if total_drafts else []


def write_plots(
    configs: Sequence[CompareConfig],
    runs: dict[tuple[str, int], RunSummary],
    concurrencies: Sequence[int],
    out_dir: str | Path,
) -> list[Path]:
    """TPOT vs concurrency, throughput vs concurrency, per-position acceptance bars (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, ylabel, fname in (
        ("mean_tpot_ms", "mean TPOT (ms)", "tpot_vs_concurrency.png"),
        ("output_throughput", "output throughput (tok/s)", "throughput_vs_concurrency.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for cfg in configs:
            pts = [(c, getattr(runs[(cfg.name, c)], key)) for c in concurrencies if (cfg.name, c) in runs]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cfg.name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(concurrencies), [str(c) for c in concurrencies])
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        paths.append(out / fname)

    per_cfg = {
        cfg.name: aggregate_per_position([r for (n, _), r in runs.items() if n == cfg.name]) for cfg in configs
    }
    per_cfg = {n: v for n, v in per_cfg.items() if v}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if per_cfg:
        width = 0.8 / len(per_cfg)
        for j, (name, rates) in enumerate(per_cfg.items()):
            ax.bar([i + j * width for i in range(len(rates))], rates, width=width, label=name)
        n_pos = max(len(v) for v in per_cfg.values())
        ax.set_xticks([i + 0.4 - width / 2 for i in range(n_pos)], [str(i) for i in range(n_pos)])
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative decoding counters", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (% of drafts)")
    ax.set_ylim(0, 100)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "per_position_acceptance.png", dpi=120)
    plt.close(fig)
    paths.append(out / "per_position_acceptance.png")
    return paths


def results_json(
    configs: Sequence[CompareConfig],
    runs: dict[tuple[str, int], RunSummary],
    rows: Sequence[CompareRow],
    meta: dict[str, Any],
    errors: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        **meta,
        "configs": [asdict(c) for c in configs],
        "runs": [asdict(r) for r in runs.values()],
        "rows": [asdict(r) for r in rows],
        "assumptions": format_assumptions(configs),
        "errors": errors or {},
    }


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


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

    configs = [load_config(p) for p in args.config]
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
