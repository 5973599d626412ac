"""``bench compare``'s table: per (concurrency, config) speedups, acceptance and engine efficiency η.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.bench.compare_config import CompareConfig


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
