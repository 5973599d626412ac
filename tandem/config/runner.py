"""RunnerConfig: how the model runner executes a step. Every knob but ``cpu_script``,
``screened_head`` and ``cpu_onednn`` is a no-op on CPU.

These were ``TANDEM_*`` environment variables; they are configuration now (``LLM(runner_config=...)``
or the CLI), and the variables remain only as documented debug overrides parsed in one place
(``tandem/config/env.py``, applied by :func:`with_debug_overrides`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from tandem.config.validate import check_bool, check_choice, check_int

RUNNER_BACKENDS = ("auto", "torch", "cuda")
MULTIROW_MODES = ("auto", "rows", "dot")


@dataclass(frozen=True)
class RunnerConfig:
    # "auto": the CUDA runner (Triton attention, fused layers, CUDA graphs) on CUDA devices, the
    # torch runner elsewhere; "torch": the plain torch path on any device (reference, debugging).
    backend: str = "auto"
    cuda_graphs: bool = True  # replay captured graphs for small steps (vLLM: not enforce_eager)
    fused: bool = True  # fused layer kernels (norm+residual, rope+KV write, skinny matmuls)
    # Steps of at most this many rows take the skinny Triton matmuls; None: per model
    # (worker/cuda_kernels.default_skinny_rows); 0: never (cuBLAS only).
    skinny_rows: int | None = None
    # Skinny steps of 2+ rows: "rows" one program per row (each row bitwise its 1-row product), "dot"
    # tensor cores (weight rows x 16-row tiles of x), "auto" one program per row up to
    # worker/cuda_kernels.default_row_rows rows, tensor cores above
    skinny_multirow: str = "auto"
    max_graph_batch: int = 256  # largest batch bucket with a CUDA graph
    kv_splits: int | None = None  # force the split-KV count of the attention kernel (None: chosen per step)
    pdl: bool = True  # programmatic dependent launch on Hopper+
    skinny_defer: bool | None = None  # deferred reduction in the skinny matmul (None: per shape)
    # CPU torch runner: batch-1 decode / verify steps of a packed int4 model as one TorchScript
    # function (worker/lone_decode.py; the eager step's ops and bits, without its Python)
    cpu_script: bool = True
    # CPU: argmax-only rows (greedy, no logits processing, no logprobs) take the LM head's argmax
    # through an 8-bit packed copy of the head, confirmed exactly (models/quant/screened_head.py)
    screened_head: bool = True
    # CPU, speculation on: a float32 target's (and draft's) decoder linears and LM head keep a copy
    # prepacked for oneDNN, which multiplies a verify's 3+ rows in little more than one row's time
    # (models/onednn_linear.py)
    cpu_onednn: bool = True

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, RUNNER_BACKENDS)
        for key in ("cuda_graphs", "fused", "pdl", "cpu_script", "screened_head", "cpu_onednn"):
            check_bool(key, getattr(self, key))
        check_bool("skinny_defer", self.skinny_defer, optional=True)
        check_int("skinny_rows", self.skinny_rows, minimum=0, optional=True)
        check_choice("skinny_multirow", self.skinny_multirow, MULTIROW_MODES)
        check_int("max_graph_batch", self.max_graph_batch, minimum=1)
        check_int("kv_splits", self.kv_splits, minimum=1, optional=True)


def with_debug_overrides(cfg: RunnerConfig, overrides: dict[str, Any] | None = None) -> RunnerConfig:
    """``cfg`` with the ``TANDEM_*`` debug variables applied (``config/env.py``); they win."""
    from tandem.config.env import runner_overrides

    values = runner_overrides() if overrides is None else overrides
    known = {f.name for f in fields(RunnerConfig)}
    return replace(cfg, **{k: v for k, v in values.items() if k in known}) if values else cfg
