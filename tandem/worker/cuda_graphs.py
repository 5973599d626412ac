"""CUDA graphs for decode / verify / draft steps: one graph per (batch bucket, query length) (an
EAGLE head's whole proposals: per (bucket, first-step rows, chain steps), ``gpu_head_runner.py``).

A step whose requests all have ≤ ``max_q`` query tokens (decodes: 1, verifies: k + 1, draft
catch-ups: 1..k + 1) and ≤ ``max_batch`` requests replays a graph captured for
``(bucket(num_reqs), max query length)``: every request is padded to that query length and the
batch to the bucket with empty requests (query length 0, context 0, KV slot -1), whose rows come
out as zeros/garbage and are never read. The graph reads its inputs from one static device buffer
that the runner refills with a single host→device copy per step, and writes logits for all
``bucket × q`` rows into a static output tensor.

Graphs are captured when the engine starts (``warm_up_plan``: every batch bucket up to
``max_num_seqs`` for decodes and for full verifies, every query length for batches up to 8), so no
request waits for a capture (a capture costs a warm-up run first: Triton JIT, cuBLAS workspaces;
~0.1 s for an 8B model). A step whose (bucket, q) has no graph runs in the smallest captured graph
that fits it; only a step that fits none is captured on first use. All graphs share one memory pool:
they never run concurrently, and each keeps its own output tensor alive, so only scratch memory is
shared. Invariant for callers: the logits a graph returns are overwritten by the next replay of the
same runner.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192,
                                  224, 256)


SMALL_BATCH = 8  # batches up to this get a graph for every query length 1..k + 1


def warm_up_plan(max_num_seqs: int, max_batch: int, max_q: int) -> list[tuple[list[int], list[int]]]:
    """(batch sizes, query lengths) to capture at start: every query length ``1..max_q`` for the
    buckets up to ``SMALL_BATCH`` (verifies of any draft length at batch 1, where latency counts);
    above, decodes (q = 1) and full verifies (q = ``max_q``), which any shorter verify fits into.
    Buckets go up to the one holding ``max_num_seqs`` (at most ``max_batch``)."""
    top = batch_bucket(min(max_num_seqs, max_batch), max_batch) or max_batch
    buckets = [b for b in BATCH_BUCKETS if b <= top]
    small = [b for b in buckets if b <= SMALL_BATCH]
    large = [b for b in buckets if b > SMALL_BATCH]
    plan = [(small, list(range(1, max_q + 1)))]
    if large:
        plan.append((large, sorted({1, max_q})))
    return plan


def batch_bucket(n: int, max_batch: int) -> int | None:
    """Smallest bucket ≥ n (capped at ``max_batch``), or None when n exceeds ``max_batch``."""
    if n > max_batch:
        return None
    for b in BATCH_BUCKETS:
        if b >= n:
            return min(b, max_batch)
    return max_batch


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket * q, vocab] float32, static
    # [bucket * q, F] static: the features an EAGLE head reads (runner.feature_layers), if any
    features: torch.Tensor | None = None
    ids: torch.Tensor | None = None  # [bucket * q] static: every row's argmax (the target runner's graphs)


class GraphCache:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[tuple[int, ...], CapturedStep] = {}
        self._pool: object | None = None
        self.capture_seconds = 0.0
        self._fits: dict[tuple[int, int], tuple[int, ...] | None] = {}  # best_fit, memoised per step shape

    def get(self, key: tuple[int, ...]) -> CapturedStep | None:
        return self.graphs.get(key)

    def best_fit(self, b: int, q: int) -> tuple[int, ...] | None:
        """The captured (bucket, q) with bucket ≥ b and q' ≥ q that pads least, if any (looked up once
        per shape: steps that replay a larger graph ask every time)."""
        if (b, q) in self._fits:
            return self._fits[(b, q)]
        fits = [k for k in self.graphs if k[0] >= b and k[1] >= q]
        best = min(fits, key=lambda k: (k[0] * k[1], k)) if fits else None
        self._fits[(b, q)] = best
        return best

    def capture(self, key: tuple[int, ...],
                run: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]) -> CapturedStep:
        """Warm up ``run`` (which reads only static buffers) on a side stream, then capture it (with
        Python's cyclic garbage collector off)."""
        import time

        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            run()
        stream.wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # No cyclic garbage collection inside a capture: since torch 2.9 ``torch.cuda.graph`` no longer
        # collects before capturing, so a collection triggered mid-capture could finalize a dead
        # engine's graphs, pools or Triton kernels — CUDA calls that invalidate this capture
        # ("operation failed due to a previous error during capture"; pytorch/pytorch#161037, vLLM's
        # freeze_gc_for_cudagraph_capture). Seen on the H200 as intermittent capture failures in
        # test processes that build many engines.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = run()
        finally:
            if gc_was_on:
                gc.enable()
        torch.cuda.synchronize(self.device)
        outs = out if isinstance(out, tuple) else (out,)
        step = CapturedStep(graph, *outs)
        self.graphs[key] = step
        self._fits.clear()
        self.capture_seconds += time.perf_counter() - t0
        return step
