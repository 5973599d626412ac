"""EAGLE head steps on CUDA: Triton attention over the head's paged KV, CUDA graphs for small steps.

Same contract as ``HeadRunner.forward`` (``head_runner.py``), same packing as the target's CUDA
runner (one pinned int64 buffer, one host→device copy per step), plus a static hidden-input buffer:

- **bucketed** (every request ≤ ``max_graph_q`` query rows — chain steps are 1 row, catch-ups after
  a verify 1..k+1 — and ≤ ``max_graph_batch`` requests): requests padded to the step's longest query
  and the batch to a bucket, and a graph captured for ``(bucket, q)`` runs the head, its argmax over
  the draft vocabulary and the id map, leaving the draft ids and the feedback rows in static outputs.
  Two sets of graphs: a proposal's first step (``hidden`` None) gathers the target's features by the
  step's slot mapping from the feature cache and fuses them inside its graph (no host work, no copy);
  a chain step's feedback rows are copied to their padded places first.
- **chain** (``forward_chain``: a proposal's one-row steps 2..k, every request taking the same k, at
  most ``SMALL_BATCH`` requests): one graph per (bucket, steps) runs them all — after the first, each
  step's position, context length and KV slot advance on the device (``input_packer.advance_one``) and
  its id and hidden row are the step before's draft and feedback — so the host stages and replays once
  per proposal instead of once per step (on the H100 a step's host work, ~160 µs, was what an EAGLE
  round at batch 1 waited on: docs/performance.md §50).
- **eager** (a catch-up over a whole prompt): exact layout, the same ops without a graph.

A step of a proposal chained on a verify still on the device (``HeadChain``) is fixed on the
device after its input copy, outside the graph (worker/chain.py: ``head_chain_fixup``); its inputs
are staged in 2 (k + 2) pinned buffers, so that packing a step never waits for a copy queued behind
that verify.

The layer runs on the target's fused CUDA kernels (``cuda_kernels.py``) where its shape allows
(``fused_supported``): skinny Triton matmuls with the norms and residual adds fused in for up to
``MAX_ROWS`` rows, the norm and the LM head in one of them, cuBLAS for more; else the torch ops. The
head is one layer: its cost is launches, which the graph and the fused kernels cut. Outputs of a
bucketed step are views of static tensors, valid until this runner's next step (the proposer feeds
them straight into the next step, which copies them in first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.kv.feature_cache import FeatureCache, require_features
from tandem.models.eagle import EagleHead
from tandem.models.forward_context import ForwardContext, KVCache, LayerKernels
from tandem.models.torch_kernels import TORCH_KERNELS
from tandem.worker.batch import HeadChain, SeqChunk
from tandem.worker.chain import (HEAD, chain_select, head_chain_fixup, head_chain_room, pack_chain,
                                  verify_rows_fed)
from tandem.worker.cuda_graphs import BATCH_BUCKETS, SMALL_BATCH, CapturedStep, GraphCache, batch_bucket
from tandem.worker.cuda_kernels import MAX_ROWS, CublasKernels, SkinnyKernels, default_row_rows, fused_supported
from tandem.worker.head_step import HeadStep
from tandem.worker.input_packer import HostStaging, advance_one, layout, pack, pack_fed, padded_rows, step_tensors
from tandem.worker.triton_attention import MAX_SPLITS, num_sms, pick_num_splits, tile_shape
from tandem.worker.triton_attention_backend import TritonAttention

MAX_GRAPH_Q = 8
EAGER_WARM_Q = 512  # padded eager steps from the features (``eager_pad``) up to this many rows run at start


def eager_pad(qlens: Sequence[int]) -> int | None:
    """The query length an eager step from the features pads every request to (a catch-up over the
    positions the head idled through, its first step after a prompt): the longest one's next power of
    two above ``MAX_ROWS`` (cuBLAS there), so the matmul shapes repeat. Each new row count had cost
    its first linear calls 0.5-1.5 ms of host time: the catch-ups of the policy's explorations took
    2.6-9.8 ms each on the H100 (docs/performance.md §51)."""
    q = max(qlens)
    return 1 << (q - 1).bit_length() if q > MAX_ROWS else None


class GpuHeadRunner:
    def __init__(self, head: EagleHead, kv_cache: KVCache, block_size: int, device: torch.device, *,
                 max_model_len: int, lookahead: int, use_graphs: bool = True, max_graph_batch: int = 256,
                 max_graph_q: int = MAX_GRAPH_Q, features: FeatureCache | None = None) -> None:
        self.head = head
        self.features = features  # the target's features (a proposal's first step reads them)
        self.kv_caches = [kv_cache]
        self.block_size = block_size
        self.device = device
        arch = head.cfg.layer
        self.kv_heads, self.group = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
        self.sms = num_sms(device)
        self.attention = TritonAttention(fused_rope=arch.head_dim % 2 == 0)
        self.fused = fused_supported(arch)
        self._skinny = SkinnyKernels(default_row_rows(arch))
        self._cublas = CublasKernels()
        self.table_width = -(-(max_model_len + lookahead) // block_size)
        self.max_graph_batch, self.max_graph_q = max_graph_batch, max_graph_q
        # (bucket, q) → graph: fed hidden rows (chain steps) / reading the feature cache (first steps)
        self.graphs = GraphCache(device) if use_graphs else None
        self.graphs_f = GraphCache(device) if use_graphs else None
        # (bucket, steps) → a proposal's one-row chain steps in one graph (forward_chain)
        self.graphs_c = GraphCache(device) if use_graphs else None
        # (bucket, q, steps) → a whole proposal (first step and chain steps) in one graph (forward_proposal)
        self.graphs_p = GraphCache(device) if use_graphs else None
        self.lookahead = lookahead
        tmax = max_graph_batch * max_graph_q
        self._static = torch.zeros(layout(tmax, max_graph_batch, self.table_width)[-1] + tmax,
                                   dtype=torch.int64, device=device)
        dtype = head.fc.weight.dtype
        self._hidden_in = torch.zeros(tmax, head.cfg.hidden_size, dtype=dtype, device=device)
        self._eager = torch.empty(0, dtype=torch.int64, device=device)
        # a proposal graph's chain steps (``_derive_chain``: filled on the device)
        self._chain_in = torch.zeros(layout(SMALL_BATCH, SMALL_BATCH, self.table_width)[-1], dtype=torch.int64,
                                     device=device)
        self._arange = torch.arange(SMALL_BATCH + 1, device=device)
        # (two rounds of steps in flight: a chained proposal's steps queue behind the verify computing)
        self._host = HostStaging(device, count=2 * (lookahead + 2))
        self.num_graph_steps = self.num_eager_steps = self.num_proposal_graphs = 0

    def _splits(self, b: int, qmax: int, max_seq: int | None) -> int:
        q_tiles = -(-qmax // tile_shape(qmax, self.group)[1])
        return min(MAX_SPLITS, pick_num_splits(b, self.kv_heads, q_tiles, max_seq, self.sms))

    def _run(self, buf: torch.Tensor, t: int, b: int, w: int, q: int, splits: int, hidden: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, meta = step_tensors(buf, t, b, w, self.block_size, q, splits)
        kernels = self._kernels(t)
        if hidden is None:
            hidden = self.head.step0_hidden(require_features(self.features).gather(meta.slot_mapping), kernels)
        out = self.head(ids, pos, hidden, ForwardContext(meta, self.kv_caches, kernels, self.attention))
        tok = self.head.draft_to_target[self.head.logits(out, kernels).argmax(dim=-1)]
        return tok, self.head.feedback(out, kernels)

    def _kernels(self, rows: int) -> LayerKernels:
        """The layer kernels of a step of ``rows`` rows (the target runner's choice)."""
        if not self.fused:
            return TORCH_KERNELS
        return self._skinny if rows <= MAX_ROWS else self._cublas

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], rows: Sequence[int], hidden: torch.Tensor | None,
                token_ids: torch.Tensor | None = None, chain: HeadChain | None = None) -> HeadStep:
        qlens = [len(c.token_ids) for c in chunks]
        n, qmax = len(chunks), max(qlens)
        if hidden is not None:
            hidden = hidden.to(self._hidden_in.dtype)
        b = batch_bucket(n, self.max_graph_batch) if qmax <= self.max_graph_q else None
        if b is None or max(len(c.block_ids) for c in chunks) > self.table_width:
            return self._forward_eager(chunks, qlens, rows, hidden, token_ids, chain)
        self.num_graph_steps += 1
        q, w = qmax, self.table_width
        graphs = self.graphs if hidden is not None else self.graphs_f
        if graphs is not None and graphs.get((b, q)) is None:
            fit = graphs.best_fit(b, q)  # captured at start (warm_up_plan): no capture while serving
            if fit is not None:
                b, q = fit
        _, r_off, identity = self._stage(chunks, qlens, rows, hidden, token_ids, chain, b, q)
        if graphs is not None:
            step = graphs.get((b, q)) or self._capture(graphs, b, q, hidden is not None)
            step.graph.replay()
            tok, fb = step.logits, step.features
            assert fb is not None
        else:
            tok, fb = self._run(self._static, b * q, b, w, q, self._splits(b, q, None),
                                None if hidden is None else self._hidden_in[: b * q])
        if not identity:
            sel = self._static[r_off:r_off + len(rows)]
            tok, fb = tok.index_select(0, sel), fb.index_select(0, sel)
        return HeadStep(tok, fb, None)

    def _stage(self, chunks: Sequence[SeqChunk], qlens: list[int], rows: Sequence[int], hidden: torch.Tensor | None,
               token_ids: torch.Tensor | None, chain: HeadChain | None, b: int, q: int, select: bool = False
               ) -> tuple[int, int, bool]:
        """A bucketed step's inputs in the static buffer (one host→device copy), a chained step fixed
        up on the device, its fed ids and hidden rows in place: (T, rows offset, rows are the identity).
        ``select`` (one row per request): the rows always at the layout's end, ``b`` of them (a
        padding request's row 0), as a proposal graph reads them (``forward_proposal``)."""
        n, w = len(chunks), self.table_width
        fed = verify_rows_fed(chain, qlens) if chain is not None else None
        i, buf = self._host.acquire(layout(b * q, b, w)[-1] + max(len(rows), b) + head_chain_room(chain, fed, n))
        length, t, r_off, identity = pack(self.block_size, buf, chunks, qlens, b, q, w, rows)
        if select:
            r_off = layout(b * q, b, w)[-1]
            if identity:  # (q = 1 and no padding request: row i is request i's)
                buf[r_off:r_off + n] = np.arange(n)
            buf[r_off + n:r_off + b] = 0
            length, identity = r_off + b, False
        end = pack_fed(buf, length, fed, padded_rows(qlens, q, fed.rows) if fed is not None else ())
        if chain is not None:
            end, c_off = pack_chain(buf, end, chain.verify, qlens, q)
        self._host.send(i, end, self._static)
        if chain is not None:  # (before the fed ids: a chain step's first id is the previous draft)
            head_chain_fixup(self._static, chain, fed, t, b, w, self.block_size, length, c_off,
                             None if identity else r_off, q)
        if token_ids is not None:
            self._static[: n * q: q].copy_(token_ids, non_blocking=True)
        if hidden is not None:
            if all(ql == q for ql in qlens):
                self._hidden_in[: n * q].copy_(hidden)
            else:
                dest = [i * q + j for i, ql in enumerate(qlens) for j in range(ql)]
                self._hidden_in.index_copy_(0, torch.tensor(dest, device=self.device), hidden)
        return t, r_off, identity

    @torch.inference_mode()
    def forward_proposal(self, chunks: Sequence[SeqChunk], rows: Sequence[int], steps: int,
                         chain: HeadChain | None = None) -> torch.Tensor | None:
        """A whole proposal in one graph: the first step from the features (``forward`` with
        ``hidden`` None: ``chunks``, one output row per chunk at ``rows``, fixed up on the device when
        ``chain``) and ``steps`` one-row chain steps after it, whose inputs the graph derives on the
        device from the first step's selected rows (``_derive_chain``). One host staging and one
        replay per proposal instead of two; the drafts [steps + 1, len(chunks)] (a view of the graph's
        output: valid until its next replay), or None where no graph holds this batch, query length
        and step count (captured at start for the small buckets: callers then take the steps apart)."""
        qlens = [len(c.token_ids) for c in chunks]
        n = len(chunks)
        found = self._proposal_graph(n, max(qlens), steps)
        if found is None or max(len(c.block_ids) for c in chunks) > self.table_width:
            return None
        b, q, captured = found
        self._stage(chunks, qlens, rows, None, None, chain, b, q, select=True)
        captured.graph.replay()
        self.num_graph_steps += steps + 1
        self.num_proposal_graphs += 1
        return captured.logits[:, :n]

    def _proposal_graph(self, n: int, q: int, steps: int) -> tuple[int, int, CapturedStep] | None:
        """The captured proposal graph of the smallest bucket holding ``n`` requests and the shortest
        first step holding ``q`` rows each, for exactly ``steps`` chain steps."""
        if self.graphs_p is None:
            return None
        for b in BATCH_BUCKETS:
            if b >= n:
                for qq in range(q, self.max_graph_q + 1):
                    found = self.graphs_p.get((b, qq, steps))
                    if found is not None:
                        return b, qq, found
        return None

    def _derive_chain(self, b: int, q: int, tok: torch.Tensor, fb: torch.Tensor) -> torch.Tensor:
        """(Inside a proposal graph.) From a first step of ``b`` requests × ``q`` rows in ``_static``,
        its draft ids and feedback of all rows: the first chain step packed in ``_chain_in``
        (``layout(b, b, w)``) — per real request one row at its selected row's position + 1 (that
        row moved back by a chained verify's rejections already: ``chain_select``), context one
        longer, KV slot from its block table, id its draft; padding requests stay padding — and its
        hidden rows in ``_hidden_in``. Returns the selected drafts [b]."""
        w, bs, src, dst = self.table_width, self.block_size, self._static, self._chain_in
        if src.is_cuda:  # one launch (triton_proposal.py); the ops below are its reference
            from tandem.worker.triton_proposal import chain_entry_cuda

            return chain_entry_cuda(src, dst, tok, fb, self._hidden_in, b, q, w, bs)
        o1, o2 = layout(b * q, b, w), layout(b, b, w)
        sel = src[o1[-1]:o1[-1] + b]
        draft = tok.index_select(0, sel)
        self._hidden_in[:b].copy_(fb.index_select(0, sel))
        real = src[o1[5]:o1[5] + b].clamp(max=1)
        pos = (src[o1[1]:o1[1] + b * q].index_select(0, sel) + 1) * real
        table = src[o1[6]:o1[6] + b * w]
        col = torch.div(pos, bs, rounding_mode="floor").clamp_(max=w - 1)
        block = table.view(b, w).gather(1, col.unsqueeze(1)).squeeze(1)
        dst[o2[0]:o2[0] + b].copy_(draft)
        dst[o2[1]:o2[1] + b].copy_(pos)
        dst[o2[2]:o2[2] + b].copy_(torch.where(real > 0, block * bs + pos % bs, -1))
        dst[o2[3]:o2[3] + b].copy_((pos + 1) * real)
        dst[o2[4]:o2[4] + b + 1].copy_(self._arange[:b + 1])
        dst[o2[5]:o2[5] + b].copy_(real)
        dst[o2[6]:o2[6] + b * w].copy_(table)
        return draft

    def _capture_proposal(self, b: int, q: int, steps: int) -> CapturedStep:
        w = self.table_width
        split_q, split_1 = self._splits(b, q, None), self._splits(b, 1, None)

        def run() -> torch.Tensor:
            tok, fb = self._run(self._static, b * q, b, w, q, split_q, None)
            first = self._derive_chain(b, q, tok, fb)
            return torch.stack([first, *self._chain_steps(self._chain_in, b, steps, split_1)])

        assert self.graphs_p is not None
        return self.graphs_p.capture((b, q, steps), run)

    @torch.inference_mode()
    def forward_chain(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor, token_ids: torch.Tensor, steps: int,
                      chain: HeadChain | None = None) -> list[torch.Tensor] | None:
        """``steps`` one-row fed steps of a proposal (drafts 2 .. steps + 1) in one graph: the first
        packed as ``forward`` packs one (one-token ``chunks``, ids ``token_ids``, hidden rows ``hidden``,
        fixed up on the device when ``chain``), each later one advanced on the device (``advance_one``:
        position, context and KV slot one further; its id and hidden row the step before's draft and
        feedback). One host staging and one replay instead of ``steps``. Per step the drafts [len(chunks)]
        (views of the graph's outputs: valid until its next replay); None where no graph holds this
        batch and step count (graphs are captured at start for the small buckets: callers then step
        one at a time)."""
        n = len(chunks)
        graph = self._chain_graph(n, steps)
        if (graph is None or any(len(c.token_ids) != 1 for c in chunks)
                or max(len(c.block_ids) for c in chunks) > self.table_width):
            return None
        b, captured = graph
        self._stage(chunks, [1] * n, range(n), hidden.to(self._hidden_in.dtype), token_ids, chain, b, 1)
        captured.graph.replay()
        self.num_graph_steps += steps
        return [captured.logits[j, :n] for j in range(steps)]

    def _chain_graph(self, n: int, steps: int) -> tuple[int, CapturedStep] | None:
        """The captured chain graph of the smallest bucket holding ``n`` requests, for exactly ``steps``
        steps (more would write the head's KV past the slots the scheduler reserved)."""
        if self.graphs_c is None:
            return None
        for b in BATCH_BUCKETS:
            if b >= n:
                found = self.graphs_c.get((b, steps))
                if found is not None:
                    return b, found
        return None

    def _chain_steps(self, buf: torch.Tensor, b: int, steps: int, splits: int) -> list[torch.Tensor]:
        """(Inside a graph.) ``steps`` one-row steps of ``b`` requests packed in ``buf`` (``layout(b, b,
        w)``), hidden rows in ``_hidden_in``: each later one fed the step before's draft and feedback and
        advanced on the device (``advance_one``). The drafts per step."""
        w = self.table_width
        hidden = self._hidden_in[:b]
        toks = []
        for j in range(steps):
            tok, fb = self._run(buf, b, b, w, 1, splits, hidden)
            toks.append(tok)
            if j + 1 < steps:
                if buf.is_cuda:  # one launch (triton_proposal.py) for the three below
                    from tandem.worker.triton_proposal import advance_one_cuda

                    advance_one_cuda(buf, tok, fb, hidden, b, w, self.block_size)
                    continue
                hidden.copy_(fb)
                buf[:b].copy_(tok)
                advance_one(buf, b, w, self.block_size)
        return toks

    def _capture_chain(self, b: int, steps: int) -> CapturedStep:
        splits = self._splits(b, 1, None)
        assert self.graphs_c is not None
        return self.graphs_c.capture((b, steps), lambda: torch.stack(self._chain_steps(self._static, b, steps, splits)))

    def _capture(self, graphs: GraphCache, b: int, q: int, fed: bool) -> CapturedStep:
        """The graph of a (bucket, q) step: ``fed`` hidden rows from ``_hidden_in``, else the features."""
        w = self.table_width
        return graphs.capture((b, q), lambda: self._run(
            self._static, b * q, b, w, q, self._splits(b, q, None), self._hidden_in[: b * q] if fed else None))

    def _forward_eager(self, chunks: Sequence[SeqChunk], qlens: list[int], rows: Sequence[int],
                       hidden: torch.Tensor | None, token_ids: torch.Tensor | None,
                       chain: HeadChain | None = None) -> HeadStep:
        self.num_eager_steps += 1
        if hidden is not None:  # the fused kernels add into EAGLE-3's residual (this input) in place
            hidden = hidden.clone()
        n = len(chunks)
        w = max(1, max(len(c.block_ids) for c in chunks))
        fed = verify_rows_fed(chain, qlens) if chain is not None else None
        q_pad = eager_pad(qlens) if hidden is None and chain is None else None
        cap = layout(n * q_pad if q_pad else sum(qlens), n, w)[-1] + len(rows) + head_chain_room(chain, fed, n)
        if self._eager.numel() < cap:
            self._eager = torch.empty(max(cap, 2 * self._eager.numel()), dtype=torch.int64, device=self.device)
        i, buf = self._host.acquire(cap)
        length, t, r_off, identity = pack(self.block_size, buf, chunks, qlens, n, q_pad, w, rows)
        end = pack_fed(buf, length, fed, fed.rows if fed is not None else ())
        if chain is not None:
            end, c_off = pack_chain(buf, end, chain.verify, qlens, None)
        self._host.send(i, end, self._eager)
        if chain is not None:
            head_chain_fixup(self._eager, chain, fed, t, n, w, self.block_size, length, c_off,
                             None if identity else r_off, max(qlens))
        if token_ids is not None:
            self._eager[:n].copy_(token_ids, non_blocking=True)
        max_seq = max(c.start + ql for c, ql in zip(chunks, qlens))
        q = q_pad or max(qlens)
        tok, fb = self._run(self._eager, t, n, w, q, self._splits(n, q, max_seq), hidden)
        if not identity:
            sel = self._eager[r_off:r_off + len(rows)]
            tok, fb = tok.index_select(0, sel), fb.index_select(0, sel)
        return HeadStep(tok, fb, None)

    def warm_up(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> None:
        """Capture the small steps' graphs now: first steps (catch-ups of 1..k+1 rows, from the
        features) for every query length, chain steps (fed, q = 1)."""
        self._compile_select()
        self._compile_eager()
        if self.graphs is None or self.graphs_f is None:
            return
        w = self.table_width
        with torch.inference_mode():
            for n in batch_sizes:
                b = batch_bucket(n, self.max_graph_batch)
                for q in query_lens:
                    for graphs, fed in ((self.graphs_f, False), (self.graphs, True)):
                        if (b is None or q > self.max_graph_q or graphs.get((b, q)) is not None
                                or (fed and q != 1) or (not fed and self.features is None)):
                            continue
                        i, buf = self._host.acquire(layout(b * q, b, w)[-1])
                        length, _, _, _ = pack(self.block_size, buf, [], [], b, q, w, None)
                        self._host.send(i, length, self._static)
                        self._capture(graphs, b, q, fed)
                if b is None or b > SMALL_BATCH:
                    continue
                # chain graphs (forward_chain) for the small buckets: proposals of 3 .. k drafts
                if self.graphs_c is not None:
                    for steps in range(2, self.lookahead):
                        if self.graphs_c.get((b, steps)) is None:
                            i, buf = self._host.acquire(layout(b, b, w)[-1])
                            length, _, _, _ = pack(self.block_size, buf, [], [], b, 1, w, None)
                            self._host.send(i, length, self._static)
                            self._capture_chain(b, steps)
                # whole proposals (forward_proposal) of 2 .. k drafts after a first step of q rows
                if self.graphs_p is not None and self.features is not None:
                    for q in query_lens:
                        for steps in range(1, self.lookahead):
                            if q <= self.max_graph_q and self.graphs_p.get((b, q, steps)) is None:
                                i, buf = self._host.acquire(layout(b * q, b, w)[-1] + b)
                                length, _, _, _ = pack(self.block_size, buf, [], [], b, q, w, None)
                                buf[length:length + b] = 0  # (every request's selected row: 0)
                                self._host.send(i, length + b, self._static)
                                self._capture_proposal(b, q, steps)

    @torch.inference_mode()
    def _compile_eager(self) -> None:
        """Compile now the kernel variants an eager step can pick (1..64 rows: the one-row and
        tensor-core skinny matmuls, the cuBLAS body's norms; attention with and without split-KV),
        fed and from the features, and run the padded shapes of steps from the features up to
        ``EAGER_WARM_Q`` rows (``eager_pad``: cuBLAS's first call of a shape is slow), on all-padding
        steps (no KV slot read or written)."""
        w = self.table_width
        dev = torch.empty(layout(EAGER_WARM_Q, 1, w)[-1], dtype=torch.int64, device=self.device)
        q = 1
        while q <= EAGER_WARM_Q:
            i, buf = self._host.acquire(layout(q, 1, w)[-1])
            length, _, _, _ = pack(self.block_size, buf, [], [], 1, q, w, None)
            self._host.send(i, length, dev)
            for splits in (1, 2):
                if q <= 64:
                    self._run(dev, q, 1, w, q, splits, self._hidden_in.new_zeros(q, self._hidden_in.shape[1]))
                if self.features is not None:
                    self._run(dev, q, 1, w, q, splits, None)
            q *= 2
        torch.cuda.synchronize(self.device)

    def _compile_select(self) -> None:
        """Compile ``chain_select``'s one variant now (a chained catch-up's; on a scratch buffer)."""
        dev = torch.tensor([0, 0, 1, 0, 0, -1], dtype=torch.int64, device=self.device)
        chain_select(dev, 0, 1, 1, HEAD + 1, dev[:1].clone())
        torch.cuda.synchronize(self.device)

