"""What ``bench sweep`` prints and writes: rows with speedups, the tables, and the PNG plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.bench.sweep_spec import CellResult


def speedup_rows(cells: Sequence[CellResult], baseline: str) -> list[dict[str, Any]]:
    """One dict per cell: its fields plus ``speedup`` (output throughput over the baseline method's at
    the same workload and concurrency), ``tpot_speedup`` (baseline TPOT / TPOT) and ``run_speedups``
    (run i's throughput over the baseline's run i, for each timed run: offline the runs alternate
    between methods, so each ratio compares neighbours in time and their spread is the cell's noise)
    and their median ``median_run_speedup`` (where the machine's speed wanders between runs, the
    sturdier figure: the best runs of two methods need not come from the same moment);
    None where the baseline's cell is missing (or, for ``run_speedups``, ran another number of runs)."""
    base = {(c.workload, c.concurrency): c for c in cells if c.method == baseline}
    rows = []
    for c in cells:
        row = asdict(c)
        b = base.get((c.workload, c.concurrency))
        row["speedup"] = c.output_throughput / b.output_throughput if b and b.output_throughput > 0 else None
        row["tpot_speedup"] = b.mean_tpot_ms / c.mean_tpot_ms if b and c.mean_tpot_ms > 0 else None
        paired = b is not None and b is not c and len(c.run_throughputs) == len(b.run_throughputs)
        pairs = list(zip(c.run_throughputs, b.run_throughputs)) if paired else []
        row["run_speedups"] = [x / y for x, y in pairs] if pairs and all(y > 0 for _, y in pairs) else None
        row["median_run_speedup"] = statistics.median(row["run_speedups"]) if row["run_speedups"] else None
        rows.append(row)
    return rows


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(rows: Sequence[dict[str, Any]], workloads: Sequence[str], concurrencies: Sequence[int],
                 methods: Sequence[str]) -> str:
    """The per-cell table (the speedup followed by the range of its runs' paired ratios where a cell
    ran several), then the speedup pivot (workload x concurrency) per method, as Markdown."""
    lines = ["| workload | conc | method | TPOT ms | ITL ms | tok/s | speedup | acceptance | τ | drafting |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['mean_tpot_ms']:.2f} | "
            f"{r['mean_itl_ms']:.2f} | {r['output_throughput']:.1f} | {_f(r['speedup'], '.3f')}×{_spread(r)} | "
            f"{_f(r['acceptance_rate'], '.2f')} | {_f(r['mean_acceptance_length'], '.2f')} | "
            f"{_f(r['drafting_share'] and 100 * r['drafting_share'], '.0f')}{'%' if r['drafting_share'] is not None else ''} |"
        )
    by = {(r["method"], r["workload"], r["concurrency"]): r for r in rows}
    for m in methods[1:]:
        lines += ["", f"speedup of {m} over {methods[0]}: output throughput (best runs; median of the paired runs) / TPOT", "",
                  "| workload | " + " | ".join(str(c) for c in concurrencies) + " |",
                  "|---|" + "---|" * len(concurrencies)]
        for w in workloads:
            cells = [by.get((m, w, c)) for c in concurrencies]
            lines.append(f"| {w} | " + " | ".join(
                f"{_mark(r['speedup'])}{_median(r)} / {_f(r['tpot_speedup'], '.2f')}×" if r else "-" for r in cells) + " |")
    return "\n".join(lines)


def _spread(row: dict[str, Any]) -> str:
    runs = row.get("run_speedups")
    return f" ({min(runs):.2f}–{max(runs):.2f})" if runs and len(runs) > 1 else ""


def _median(row: dict[str, Any]) -> str:
    runs = row.get("run_speedups")
    return f" (median {_mark(row['median_run_speedup'])})" if runs and len(runs) > 2 else ""


def _mark(s: float | None) -> str:
    if s is None:
        return "-"
    return f"**{s:.2f}×**" if s < 0.98 else f"{s:.2f}×"  # bold: slower than the 0.98 rule


def write_plot(rows: Sequence[dict[str, Any]], workloads: Sequence[str], path: str | Path) -> Path | None:
    """Speedup vs concurrency, one panel per workload, one line per method; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8), squeeze=False)
    methods = sorted({r["method"] for r in rows if r["speedup"] is not None}, key=[r["method"] for r in rows].index)
    for ax, w in zip(axes[0], workloads):
        for m in methods:
            pts = sorted((r["concurrency"], r["speedup"]) for r in rows
                         if r["workload"] == w and r["method"] == m and r["speedup"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(w)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("speedup (output tok/s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
