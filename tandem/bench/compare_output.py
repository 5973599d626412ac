"""What ``bench compare`` writes besides its table: PNG plots and the results JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem.bench.compare_config import CompareConfig
from tandem.bench.compare_table import CompareRow, RunSummary, format_assumptions


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
