"""The data of ``bench sweep``: its workloads, methods and per-cell results (shared by the offline
runner ``sweep.py``, the server runner ``sweep_server.py`` and ``sweep_output.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    name: str
    dataset: str
    temperature: float
    chat: bool


WORKLOADS: dict[str, Workload] = {
    "code": Workload("code", "humaneval", 0.0, chat=False),
    "edit": Workload("edit", "edit", 0.0, chat=True),
    "chat": Workload("chat", "sharegpt", 0.8, chat=True),
    "repeated": Workload("repeated", "repeated_task", 0.0, chat=True),
}


@dataclass(frozen=True)
class Method:
    name: str
    speculative_config: dict[str, Any] | None  # None: no speculation


@dataclass(frozen=True)
class CellResult:
    workload: str
    concurrency: int
    method: str
    num_requests: int
    output_tokens: int
    duration_s: float
    output_throughput: float  # output tokens / s
    mean_tpot_ms: float
    mean_itl_ms: float
    mean_ttft_ms: float
    acceptance_rate: float | None  # accepted / drafted tokens; None without drafts
    mean_acceptance_length: float | None  # 1 + accepted / drafts
    drafting_share: float | None  # the policy's decisions that drafted; None without the policy
    num_errors: int = 0
    # chained verifies: share of the drafts proposed ahead whose assumption held (None: none proposed)
    assumptions_held: float | None = None
    # every timed run's output tokens / s, in order (the best one is the cell's); offline, run i of
    # each method ran beside run i of the others (runs alternate), so their ratios show the noise
    run_throughputs: tuple[float, ...] = ()
