"""GPU model runner: device-side step inputs, Triton attention, fused layers, CUDA graphs.

``ModelRunner`` delegates here on CUDA. Per step the host builds every integer input — token ids,
positions, KV slots, context lengths, query starts/lengths, block tables, and the rows whose logits
are wanted — with numpy into one pinned int64 buffer, and sends it in one asynchronous copy. No
step needs a host sync of its own (the caller's sampler syncs once when it reads tokens).

Two ways to run a step:
- **bucketed** (decode, verify, draft steps: every request ≤ ``max_graph_q`` query tokens, at most
  ``max_graph_batch`` requests): requests padded to the step's max query length and the batch to a
  bucket, then a captured CUDA graph is replayed (``cuda_graphs.py``); logits for all padded rows.
- **eager** (prefill chunks, mixed long steps): exact layout, logits only for the wanted rows.

Layout of the int64 buffer for T tokens, B requests, block-table width W (bucketed: T = B·q):
``[ids T | positions T | slots T | seq_lens B | query_start B+1 | query_lens B | tables B·W | rows R]``.
Padding tokens: id 0, position 0, slot -1 (no KV write); padding requests: query length 0, context
0 (attention writes zeros). Host buffers are double-buffered and guarded by events, so the host
never overwrites bytes an in-flight copy still reads.

Env switches (for benchmarks and debugging): ``TANDEM_CUDA_GRAPHS=0`` (eager only),
``TANDEM_FUSED=0`` (run ``CausalLM.forward``, still with Triton attention), ``TANDEM_GEMV=0`` (fused
layers with cuBLAS matmuls only, no skinny Triton matmuls), ``TANDEM_GEMV_ROWS`` (steps of at most this
many rows use the skinny matmuls; default 1, 6 for small models), ``TANDEM_GEMV_MULTIROW=dot`` (their
2+ row steps on 16-row tensor-core tiles instead of one program per row),
``TANDEM_MAX_GRAPH_BATCH`` (default 256), ``TANDEM_KV_SPLITS`` (force the split-KV count).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from tandem.models.decoder import CausalLM, KVCache
from tandem.worker.attn_metadata import AttentionMetadata
from tandem.worker.batch import SeqChunk
from tandem.worker.cuda_graphs import CapturedStep, GraphCache, batch_bucket
from tandem.worker.fused_forward import default_gemv_rows, fused_forward, fused_supported
from tandem.worker.triton_argmax import argmax_rows
from tandem.worker.triton_attention import MAX_SPLITS, num_sms, pick_num_splits, tile_shape

MAX_GRAPH_Q = 8
# Steps of at most this many requests and tokens are packed by plain Python loops (_pack_small).
_SMALL_PACK_REQS = 8
_SMALL_PACK_TOKENS = 64
# A step whose exact bucket has no graph yet runs in the smallest captured graph that fits it (more
# padding, no capture stall while serving); the exact bucket is captured once it has missed this often.
CAPTURE_AFTER_MISSES = 8


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


def _layout(t: int, b: int, w: int) -> tuple[int, int, int, int, int, int, int, int]:
    """Offsets of ids, positions, slots, seq_lens, query_start, query_lens, tables, and the end."""
    o_ids, o_pos, o_slot = 0, t, 2 * t
    o_seq = 3 * t
    o_qs = o_seq + b
    o_ql = o_qs + b + 1
    o_bt = o_ql + b
    end = o_bt + b * w
    return o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end


def _longs(seqs: Sequence[Sequence[int]]) -> np.ndarray:
    return np.frombuffer(array("q", chain.from_iterable(seqs)), dtype=np.int64)


class _HostStaging:
    """Two pinned int64 buffers used alternately; each waits for its last copy before reuse."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.bufs: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 2
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.i = 0

    def acquire(self, n: int) -> tuple[int, np.ndarray]:
        self.i ^= 1
        i = self.i
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
        if self.bufs[i].numel() < n:
            self.bufs[i] = torch.empty(max(n, 2 * self.bufs[i].numel(), 4096), dtype=torch.int64,
                                       pin_memory=self.pin)
        return i, self.bufs[i].numpy()

    def send(self, i: int, n: int, dst: torch.Tensor) -> None:
        dst[:n].copy_(self.bufs[i][:n], non_blocking=self.pin)
        if self.pin:
            ev = self.events[i] or torch.cuda.Event()
            if self.device.index in (None, torch.cuda.current_device()):
                ev.record()  # the current stream of the current device: the copy's (cheaper lookup)
            else:
                ev.record(torch.cuda.current_stream(self.device))
            self.events[i] = ev


class GpuModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[KVCache], block_size: int, device: torch.device,
                 *, use_graphs: bool | None = None, fused: bool | None = None,
                 pad_to_buckets: bool | None = None, max_graph_batch: int | None = None,
                 max_graph_q: int = MAX_GRAPH_Q) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        arch = model.arch
        want_fused = _env_flag("TANDEM_FUSED", True) if fused is None else fused
        self.fused = want_fused and fused_supported(arch)
        # Steps of at most this many rows take the skinny Triton matmuls (fused_forward.default_gemv_rows).
        rows_env = os.environ.get("TANDEM_GEMV_ROWS")
        self.gemv_rows = (int(rows_env) if rows_env else default_gemv_rows(arch)) if _env_flag("TANDEM_GEMV", True) else 0
        self.gemv_dot = os.environ.get("TANDEM_GEMV_MULTIROW", "rows") == "dot"  # 2+ rows on tensor cores
        cuda = device.type == "cuda"
        if use_graphs is None:
            use_graphs = cuda and _env_flag("TANDEM_CUDA_GRAPHS", True)
        self.use_graphs = bool(use_graphs and cuda)
        self.pad = self.use_graphs if pad_to_buckets is None else pad_to_buckets
        self.max_graph_batch = max_graph_batch or int(os.environ.get("TANDEM_MAX_GRAPH_BATCH", "256"))
        self.max_graph_q = max_graph_q
        layers = model.model.layers
        max_pos = layers[0].self_attn.rotary.cos.shape[0] if len(layers) else 1
        # Lookahead (draft) slots may run past max_model_len by up to k: leave room for 64.
        self.table_width = -(-(max_pos + 64) // block_size)
        self.kv_heads = arch.num_kv_heads
        self.group = arch.num_heads // arch.num_kv_heads
        self.sms = num_sms(device)
        self.graphs = GraphCache(device) if self.use_graphs else None
        tmax = self.max_graph_batch * max_graph_q
        static_len = _layout(tmax, self.max_graph_batch, self.table_width)[-1] + tmax
        self._static = torch.zeros(static_len, dtype=torch.int64, device=device) if self.pad else None
        self._eager = torch.empty(0, dtype=torch.int64, device=device)
        self._host = _HostStaging(device)
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self._misses: dict[tuple[int, int], int] = {}

    # ---- public ------------------------------------------------------------------------------
    def forward_logits(self, chunks: Sequence[SeqChunk], rows: Sequence[int],
                       token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(rows), V] float32 for flat (unpadded) query rows ``rows`` of the chunks.

        Bucketed steps may return a view of a graph's static output: valid until this runner's
        next forward. ``token_ids`` (device, one per single-token chunk) overwrite the chunks'
        placeholder ids on the device after the input copy: no host read of sampled tokens.
        """
        n = len(chunks)
        if n == 0:
            return torch.empty((0, self.model.arch.vocab_size), dtype=torch.float32, device=self.device)
        qlens = [len(c.token_ids) for c in chunks]
        qmax = max(qlens)
        if self.pad and qmax <= self.max_graph_q:
            b = batch_bucket(n, self.max_graph_batch)
            if b is not None and max(len(c.block_ids) for c in chunks) <= self.table_width:
                return self._run_bucketed(chunks, qlens, rows, b, qmax, token_ids)
        return self._run_eager(chunks, qlens, rows, token_ids)

    # ---- host packing ------------------------------------------------------------------------
    def _pack(self, buf: np.ndarray, chunks: Sequence[SeqChunk], qlens: list[int], b: int,
              q_pad: int | None, w: int, rows: Sequence[int] | None) -> tuple[int, int, int, bool]:
        """Fill buf; return (length incl. rows, T, rows offset, rows are the identity)."""
        if 0 < len(chunks) <= _SMALL_PACK_REQS and sum(qlens) <= _SMALL_PACK_TOKENS:
            return self._pack_small(buf, chunks, qlens, b, q_pad, w, rows)
        return self._pack_numpy(buf, chunks, qlens, b, q_pad, w, rows)

    def _pack_numpy(self, buf: np.ndarray, chunks: Sequence[SeqChunk], qlens: list[int], b: int,
                    q_pad: int | None, w: int, rows: Sequence[int] | None) -> tuple[int, int, int, bool]:
        n = len(chunks)
        bs = self.block_size
        ql = np.asarray(qlens, dtype=np.int64)
        total = int(ql.sum()) if n else 0
        if q_pad is not None:
            t = b * q_pad
            qstart = np.arange(b + 1, dtype=np.int64) * q_pad
        else:
            t = total
            qstart = np.zeros(b + 1, dtype=np.int64)
            np.cumsum(ql, out=qstart[1:n + 1])
        o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end = _layout(t, b, w)
        buf[o_ids:o_slot] = 0  # ids and positions of padding
        buf[o_slot:o_seq] = -1  # padding tokens write no KV
        buf[o_seq:end] = 0
        buf[o_qs:o_qs + b + 1] = qstart
        r_off = end
        if n == 0:
            return end, t, r_off, False
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        nb = np.fromiter((len(c.block_ids) for c in chunks), dtype=np.int64, count=n)
        ends = starts + ql
        if (ends > nb * bs).any():
            i = int(np.argmax(ends > nb * bs))
            raise RuntimeError(f"sequence of {int(ends[i])} tokens exceeds its {int(nb[i])} KV blocks")
        table = buf[o_bt:end].reshape(b, w)
        nbt = int(nb.sum())
        if nbt:
            cum_b = np.zeros(n, dtype=np.int64)
            np.cumsum(nb[:-1], out=cum_b[1:])
            table[np.repeat(np.arange(n), nb), np.arange(nbt) - np.repeat(cum_b, nb)] = _longs(
                [c.block_ids for c in chunks])
        tok_req = np.repeat(np.arange(n), ql)
        cum_q = np.zeros(n, dtype=np.int64)
        np.cumsum(ql[:-1], out=cum_q[1:])
        within = np.arange(total) - np.repeat(cum_q, ql)
        trow = qstart[tok_req] + within  # padded row of each real token
        pos = starts[tok_req] + within
        buf[o_ids + trow] = _longs([c.token_ids for c in chunks])
        buf[o_pos + trow] = pos
        buf[o_slot + trow] = table[tok_req, pos // bs] * bs + pos % bs
        buf[o_seq:o_seq + n] = ends
        buf[o_ql:o_ql + n] = ql
        if rows is None:
            return end, t, r_off, True
        r = np.fromiter(rows, dtype=np.int64)
        prow = trow[r] if len(r) else r
        identity = len(prow) == t and bool((prow == np.arange(t)).all())
        if not identity:
            buf[r_off:r_off + len(prow)] = prow
            return r_off + len(prow), t, r_off, False
        return r_off, t, r_off, True

    def _pack_small(self, buf: np.ndarray, chunks: Sequence[SeqChunk], qlens: list[int], b: int,
                    q_pad: int | None, w: int, rows: Sequence[int] | None) -> tuple[int, int, int, bool]:
        """``_pack`` for a few short requests (decode / verify steps at small batch) with plain Python
        loops: the same bytes, without numpy's per-call overhead (~70 → ~15 µs for one decode)."""
        bs = self.block_size
        if q_pad is not None:
            t = b * q_pad
            qstart = [i * q_pad for i in range(b + 1)]
        else:
            t = sum(qlens)
            qstart = [0] * (b + 1)
            for i, q in enumerate(qlens):
                qstart[i + 1] = qstart[i] + q
        o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end = _layout(t, b, w)
        buf[o_ids:o_slot] = 0
        buf[o_slot:o_seq] = -1
        buf[o_seq:end] = 0
        buf[o_qs:o_qs + b + 1] = qstart
        trows: list[int] = []
        for i, (c, q) in enumerate(zip(chunks, qlens)):
            blocks = c.block_ids
            stop = c.start + q
            if stop > len(blocks) * bs:
                raise RuntimeError(f"sequence of {stop} tokens exceeds its {len(blocks)} KV blocks")
            if blocks:
                buf[o_bt + i * w:o_bt + i * w + len(blocks)] = blocks
            row = qstart[i]
            for j, tok in enumerate(c.token_ids):
                pos = c.start + j
                buf[o_ids + row] = tok
                buf[o_pos + row] = pos
                buf[o_slot + row] = blocks[pos // bs] * bs + pos % bs
                trows.append(row)
                row += 1
            buf[o_seq + i] = stop
            buf[o_ql + i] = q
        if rows is None:
            return end, t, end, True
        prow = [trows[r] for r in rows]
        if len(prow) == t and prow == list(range(t)):
            return end, t, end, True
        buf[end:end + len(prow)] = prow
        return end + len(prow), t, end, False

    def _meta(self, dev: torch.Tensor, t: int, b: int, w: int, qmax: int, splits: int
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end = _layout(t, b, w)
        meta = AttentionMetadata(
            num_tokens=t, query_start=[], seq_lens=[], slot_mapping=dev[o_slot:o_seq],
            block_tables=dev[o_bt:end].view(b, w), block_size=self.block_size, context_slots=[],
            seq_lens_d=dev[o_seq:o_qs], query_start_d=dev[o_qs:o_ql], query_lens_d=dev[o_ql:o_bt],
            max_query_len=qmax, num_kv_splits=splits,
        )
        return dev[o_ids:o_pos], dev[o_pos:o_slot], meta

    def _splits(self, b: int, qmax: int, max_seq: int | None) -> int:
        forced = os.environ.get("TANDEM_KV_SPLITS")
        if forced:
            return min(MAX_SPLITS, max(1, int(forced)))
        q_tiles = -(-qmax // tile_shape(qmax, self.group)[1])
        return pick_num_splits(b, self.kv_heads, q_tiles, max_seq, self.sms)

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.fused:
            return fused_forward(self.model, ids, pos, meta, self.kv_caches, self.gemv_rows, self.gemv_dot)
        hidden, _ = self.model(ids, pos, meta, self.kv_caches)
        return hidden

    # ---- eager -------------------------------------------------------------------------------
    def _run_eager(self, chunks: Sequence[SeqChunk], qlens: list[int], rows: Sequence[int],
                   token_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.num_eager_steps += 1
        n = len(chunks)
        w = max(1, max(len(c.block_ids) for c in chunks))
        total = sum(qlens)
        cap = _layout(total, n, w)[-1] + len(rows)
        if self._eager.numel() < cap:
            self._eager = torch.empty(max(cap, 2 * self._eager.numel()), dtype=torch.int64, device=self.device)
        i, buf = self._host.acquire(cap)
        length, t, r_off, identity = self._pack(buf, chunks, qlens, n, None, w, rows)
        self._host.send(i, length, self._eager)
        if token_ids is not None:  # one token per request: ids occupy rows 0..n-1
            self._eager[:n].copy_(token_ids, non_blocking=True)
        max_seq = max(c.start + q for c, q in zip(chunks, qlens))
        ids, pos, meta = self._meta(self._eager, t, n, w, max(qlens), self._splits(n, max(qlens), max_seq))
        hidden = self._hidden(ids, pos, meta)
        if not identity:
            hidden = hidden.index_select(0, self._eager[r_off:r_off + len(rows)])
        return self.model.compute_logits(hidden)

    # ---- bucketed (CUDA graphs) --------------------------------------------------------------
    def _static_step(self, b: int, q: int) -> torch.Tensor:
        ids, pos, meta = self._meta(self._static, b * q, b, self.table_width, q, self._splits(b, q, None))
        return self.model.compute_logits(self._hidden(ids, pos, meta))

    def _ensure_graph(self, b: int, q: int) -> CapturedStep:
        assert self.graphs is not None
        step = self.graphs.get((b, q))
        if step is None:  # capture on all-padding inputs (writes nothing, reads nothing)
            w = self.table_width
            i, buf = self._host.acquire(_layout(b * q, b, w)[-1])
            length, _, _, _ = self._pack(buf, [], [], b, q, w, None)
            self._host.send(i, length, self._static)
            step = self.graphs.capture((b, q), lambda: self._static_step(b, q))
        return step

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile now every Triton kernel variant a step can pick at run time: the attention's query
        tile (1..64 query rows) with and without split-KV, and the greedy argmax. Runs eager steps on
        all-padding inputs (no KV slot read or written). Without it the first request of a new shape
        class (e.g. the first prompt short enough for one KV split) waits ~0.5-0.9 s for a compile."""
        w = self.table_width
        # a buffer of its own: tensors made under inference mode must not become the runner's buffers
        dev = torch.empty(_layout(64, 1, w)[-1], dtype=torch.int64, device=self.device)
        q = 1
        while q <= 64:
            cap = _layout(q, 1, w)[-1]
            for splits in (1, 2):
                i, buf = self._host.acquire(cap)
                length, _, _, _ = self._pack(buf, [], [], 1, q, w, None)
                self._host.send(i, length, dev)
                ids, pos, meta = self._meta(dev, q, 1, w, q, splits)
                argmax_rows(self.model.compute_logits(self._hidden(ids, pos, meta)))
            q *= 2
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> int:
        """Capture the graphs these steps will use now (else lazily on first use); returns how many exist."""
        if self.graphs is None:
            return 0
        for n in batch_sizes:
            b = batch_bucket(n, self.max_graph_batch)
            for q in query_lens:
                if b is not None and 1 <= q <= self.max_graph_q:
                    self._ensure_graph(b, q)
        return len(self.graphs.graphs)

    def _run_bucketed(self, chunks: Sequence[SeqChunk], qlens: list[int], rows: Sequence[int], b: int,
                      q: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.num_graph_steps += 1
        w = self.table_width
        if self.graphs is not None and self.graphs.get((b, q)) is None:
            miss = self._misses.get((b, q), 0) + 1
            self._misses[(b, q)] = miss
            fit = self.graphs.best_fit(b, q)
            if fit is not None and miss < CAPTURE_AFTER_MISSES:
                b, q = fit
        step = self._ensure_graph(b, q) if self.graphs is not None else None
        i, buf = self._host.acquire(_layout(b * q, b, w)[-1] + len(rows))
        length, t, r_off, identity = self._pack(buf, chunks, qlens, b, q, w, rows)
        self._host.send(i, length, self._static)
        if token_ids is not None:  # request i's single token sits at padded row i * q
            self._static[: len(chunks) * q: q].copy_(token_ids, non_blocking=True)
        if step is not None:
            step.graph.replay()
            logits = step.logits
        else:  # padded layout without graphs (tests on CPU)
            logits = self._static_step(b, q)
        if identity:
            return logits
        return logits.index_select(0, self._static[r_off:r_off + len(rows)])
