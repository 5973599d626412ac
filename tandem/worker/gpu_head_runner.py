"""EAGLE head steps on CUDA: Triton attention over the head's paged KV, CUDA graphs for small steps.

Same contract as ``HeadRunner.forward`` (``head_runner.py``), same packing as the target's CUDA
runner (one pinned int64 buffer, one host→device copy per step), plus a static hidden-input buffer:

- **bucketed** (every request ≤ ``max_graph_q`` query rows — chain steps are 1 row, catch-ups after
  a verify 1..k+1 — and ≤ ``max_graph_batch`` requests): requests padded to the step's longest query
  and the batch to a bucket; the hidden rows are copied to their padded places, and a graph captured
  for ``(bucket, q)`` runs the head, its argmax over the draft vocabulary and the id map, leaving the
  draft ids and the feedback rows in static outputs.
- **eager** (a catch-up over a whole prompt): exact layout, the same ops without a graph.

The linears are cuBLAS (torch ops); the head is one layer, its cost is launches, which the graph
removes. Outputs of a bucketed step are views of static tensors, valid until this runner's next
step (the proposer feeds them straight into the next step, which copies them in first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.models.eagle import EagleHead
from tandem.models.forward_context import ForwardContext, KVCache
from tandem.models.torch_kernels import TORCH_KERNELS
from tandem.worker.batch import SeqChunk
from tandem.worker.cuda_graphs import GraphCache, batch_bucket
from tandem.worker.head_step import HeadStep
from tandem.worker.input_packer import HostStaging, layout, pack, step_tensors
from tandem.worker.triton_attention import MAX_SPLITS, num_sms, pick_num_splits, tile_shape
from tandem.worker.triton_attention_backend import TritonAttention

MAX_GRAPH_Q = 8


class GpuHeadRunner:
    def __init__(self, head: EagleHead, kv_cache: KVCache, block_size: int, device: torch.device, *,
                 max_model_len: int, lookahead: int, use_graphs: bool = True, max_graph_batch: int = 256,
                 max_graph_q: int = MAX_GRAPH_Q) -> None:
        self.head = head
        self.kv_caches = [kv_cache]
        self.block_size = block_size
        self.device = device
        arch = head.cfg.layer
        self.kv_heads, self.group = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
        self.sms = num_sms(device)
        self.attention = TritonAttention(fused_rope=arch.head_dim % 2 == 0)
        self.table_width = -(-(max_model_len + lookahead) // block_size)
        self.max_graph_batch, self.max_graph_q = max_graph_batch, max_graph_q
        self.graphs = GraphCache(device) if use_graphs else None
        tmax = max_graph_batch * max_graph_q
        self._static = torch.zeros(layout(tmax, max_graph_batch, self.table_width)[-1] + tmax,
                                   dtype=torch.int64, device=device)
        dtype = head.fc.weight.dtype
        self._hidden_in = torch.zeros(tmax, head.cfg.hidden_size, dtype=dtype, device=device)
        self._eager = torch.empty(0, dtype=torch.int64, device=device)
        self._host = HostStaging(device)
        self.num_graph_steps = self.num_eager_steps = 0

    def _splits(self, b: int, qmax: int, max_seq: int | None) -> int:
        q_tiles = -(-qmax // tile_shape(qmax, self.group)[1])
        return min(MAX_SPLITS, pick_num_splits(b, self.kv_heads, q_tiles, max_seq, self.sms))

    def _run(self, buf: torch.Tensor, t: int, b: int, w: int, q: int, splits: int, hidden: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, meta = step_tensors(buf, t, b, w, self.block_size, q, splits)
        out = self.head(ids, pos, hidden, ForwardContext(meta, self.kv_caches, TORCH_KERNELS, self.attention))
        tok = self.head.draft_to_target[self.head.logits(out).argmax(dim=-1)]
        return tok, self.head.feedback(out)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], rows: Sequence[int], hidden: torch.Tensor,
                token_ids: torch.Tensor | None = None) -> HeadStep:
        qlens = [len(c.token_ids) for c in chunks]
        n, qmax = len(chunks), max(qlens)
        hidden = hidden.to(self._hidden_in.dtype)
        b = batch_bucket(n, self.max_graph_batch) if qmax <= self.max_graph_q else None
        if b is None or max(len(c.block_ids) for c in chunks) > self.table_width:
            return self._forward_eager(chunks, qlens, rows, hidden, token_ids)
        self.num_graph_steps += 1
        q, w = qmax, self.table_width
        if self.graphs is not None and self.graphs.get((b, q)) is None:
            fit = self.graphs.best_fit(b, q)  # captured at start (warm_up_plan): no capture while serving
            if fit is not None:
                b, q = fit
        i, buf = self._host.acquire(layout(b * q, b, w)[-1] + len(rows))
        length, t, r_off, identity = pack(self.block_size, buf, chunks, qlens, b, q, w, rows)
        self._host.send(i, length, self._static)
        if token_ids is not None:
            self._static[: n * q: q].copy_(token_ids, non_blocking=True)
        if all(ql == q for ql in qlens):
            self._hidden_in[: n * q].copy_(hidden)
        else:
            dest = [i * q + j for i, ql in enumerate(qlens) for j in range(ql)]
            self._hidden_in.index_copy_(0, torch.tensor(dest, device=self.device), hidden)
        if self.graphs is not None:
            step = self.graphs.get((b, q))
            if step is None:
                step = self.graphs.capture((b, q), lambda: self._run(
                    self._static, b * q, b, w, q, self._splits(b, q, None), self._hidden_in[: b * q]))
            step.graph.replay()
            tok, fb = step.logits, step.features
            assert fb is not None
        else:
            tok, fb = self._run(self._static, b * q, b, w, q, self._splits(b, q, None), self._hidden_in[: b * q])
        if not identity:
            sel = self._static[r_off:r_off + len(rows)]
            tok, fb = tok.index_select(0, sel), fb.index_select(0, sel)
        return HeadStep(tok, fb, None)

    def _forward_eager(self, chunks: Sequence[SeqChunk], qlens: list[int], rows: Sequence[int],
                       hidden: torch.Tensor, token_ids: torch.Tensor | None) -> HeadStep:
        self.num_eager_steps += 1
        n = len(chunks)
        w = max(1, max(len(c.block_ids) for c in chunks))
        cap = layout(sum(qlens), n, w)[-1] + len(rows)
        if self._eager.numel() < cap:
            self._eager = torch.empty(max(cap, 2 * self._eager.numel()), dtype=torch.int64, device=self.device)
        i, buf = self._host.acquire(cap)
        length, t, r_off, identity = pack(self.block_size, buf, chunks, qlens, n, None, w, rows)
        self._host.send(i, length, self._eager)
        if token_ids is not None:
            self._eager[:n].copy_(token_ids, non_blocking=True)
        max_seq = max(c.start + ql for c, ql in zip(chunks, qlens))
        tok, fb = self._run(self._eager, t, n, w, max(qlens), self._splits(n, max(qlens), max_seq), hidden)
        if not identity:
            sel = self._eager[r_off:r_off + len(rows)]
            tok, fb = tok.index_select(0, sel), fb.index_select(0, sel)
        return HeadStep(tok, fb, None)

    def warm_up(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> None:
        """Capture the small steps' graphs now (chain steps: q = 1; catch-ups: 1..k+1)."""
        if self.graphs is None:
            return
        w = self.table_width
        with torch.inference_mode():
            for n in batch_sizes:
                b = batch_bucket(n, self.max_graph_batch)
                for q in query_lens:
                    if b is None or q > self.max_graph_q or self.graphs.get((b, q)) is not None:
                        continue
                    i, buf = self._host.acquire(layout(b * q, b, w)[-1])
                    length, _, _, _ = pack(self.block_size, buf, [], [], b, q, w, None)
                    self._host.send(i, length, self._static)
                    self.graphs.capture((b, q), lambda b=b, q=q: self._run(
                        self._static, b * q, b, w, q, self._splits(b, q, None), self._hidden_in[: b * q]))
