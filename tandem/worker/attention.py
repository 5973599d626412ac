"""Paged attention in plain torch (the CPU path, and the reference for GPU kernels).

KV cache layout per layer: ``[num_blocks * block_size, num_kv_heads, head_dim]`` for K and for V,
i.e. a flat slot dimension; block ``b`` owns slots ``b*block_size : (b+1)*block_size``.

Long queries (prefill chunks) run one request at a time through SDPA over the gathered context.
Short queries (decodes, k+1-token verifies) of all requests are padded into one batched
matmul-softmax-matmul: per-call overhead dominates there, and CPU SDPA's thread pool showed
10-100x latency spikes for tiny calls on a loaded 2-core machine.
Masking: causal with offset (query row r of a request with context L and q new tokens sits at
position L - q + r), optionally a sliding window (key j visible iff j > pos - window, as HF Gemma3).

``TorchAttention`` is the backend object the torch runner hands the model (rope, q/k norm, KV write
and attention in torch ops); the CUDA runner hands it ``TritonAttention`` instead
(``triton_attention_backend.py``). The torch code stays the CPU path and the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.models.forward_context import KVCache
from tandem.worker import cpu_attention
from tandem.worker.attn_metadata import AttentionMetadata

if TYPE_CHECKING:
    from tandem.models.decoder import Attention

# Requests whose query is at most this long go through the padded batched path.
_BATCHED_MAX_QUERY = 8


def write_kv(
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def _mask(q_len: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Bool mask [q_len, ctx]: True = attend. None when every key is visible (single decode)."""
    if q_len == 1 and (window is None or ctx <= window):
        return None
    qpos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    kpos = torch.arange(ctx, device=device)[None, :]
    m = kpos <= qpos
    if window is not None:
        m = m & (kpos > qpos - window)
    return m


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    rowwise: bool = False,
    exact_verify: bool = True,
    cpu_kernel: bool = False,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """``exact_verify``: a lone verify's rows each as a decode at its position computes them (see
    ``_Plan``); False where the caller's linears give a verify's rows other bits than a decode's
    anyway (then the verify is one masked call per layer). ``cpu_kernel``: the short queries go to
    ``cpu_attention`` (every row as a decode at its position computes it, one call for all: a step's
    one request through ``attend``, as the scripted CPU step does, several through ``attend_rows``), so
    a row's bits do not depend on the other requests of its step."""
    if rowwise:
        return _rowwise_attention(q, k_cache, v_cache, _host(meta), scale, sliding_window)
    plan = meta.plans.get(sliding_window)
    use_c = cpu_kernel and sliding_window is None and cpu_attention.fits(q, k_cache)
    if plan is None:
        plan = meta.plans[sliding_window] = _Plan(_host(meta), sliding_window, q.device, exact_verify, use_c)
    threads = torch.get_num_threads()
    if plan.long or threads == 1 or q.device.type != "cpu":
        return _paged_attention(q, k_cache, v_cache, plan, scale, use_c)
    # Short queries only (decodes, verifies): tiny ops, which some kernels (softmax) still split over
    # the intra-op threads. On a loaded 2-core machine waiting for a descheduled second thread cost up
    # to 2.6 ms per softmax of [3, 3, 200] (2.2 µs on one thread); one thread is as fast when idle.
    torch.set_num_threads(1)
    try:
        return _paged_attention(q, k_cache, v_cache, plan, scale, use_c)
    finally:
        torch.set_num_threads(threads)


def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _Plan,
                     scale: float, use_c: bool = False) -> torch.Tensor:
    host = plan.host
    if use_c and plan.alone:  # one request, one short query: the C kernel, all rows in one call
        return _c_single(q, k_cache, v_cache, host, plan.single[0], plan.single_range, scale)
    if plan.alone and plan.row_masks is None:  # one request, one short query (a batch-1 decode)
        i, neg_mask = plan.single
        k, v = _context(k_cache, v_cache, host, i, plan.single_range, q.dtype)
        return _grouped_attention(q, k, v, neg_mask, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous (q may be a view of qkv)
    gqa = q.shape[1] != k_cache.shape[1]
    for i, mask in zip(plan.long, plan.long_masks):
        s, e = host.query_start[i], host.query_start[i + 1]
        slots = host.context_slots[i]
        k = k_cache.index_select(0, slots).transpose(0, 1)  # [kvh, ctx, d]
        v = v_cache.index_select(0, slots).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
            enable_gqa=gqa,
        )  # [h, q_len, d]
        out[s:e] = o.transpose(0, 1)
    if plan.single is not None:
        i, neg_mask = plan.single
        s, e = host.query_start[i], host.query_start[i + 1]
        if use_c:
            out[s:e] = _c_single(q[s:e], k_cache, v_cache, host, i, plan.single_range, scale)
            return out
        k, v = _context(k_cache, v_cache, host, i, plan.single_range, q.dtype)
        if plan.row_masks is None:
            out[s:e] = _grouped_attention(q[s:e], k, v, neg_mask, scale)
        else:  # a lone verify: each row exactly as a decode at its position computes it (see _Plan)
            ctx = k.shape[0]
            for r, row_mask in enumerate(plan.row_masks):
                c = ctx - (e - s) + 1 + r
                out[s + r:s + r + 1] = _grouped_attention(q[s + r:s + r + 1], k[:c], v[:c], row_mask, scale)
    elif plan.short:
        if plan.c_plan is not None:  # every row as its request's lone step computes it, in one call
            cpu_attention.attend_rows(q, k_cache, v_cache, plan.c_plan, scale, out)
        else:
            _batched_short(q, k_cache, v_cache, plan, scale, out)
    return out


def _c_single(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, host: _HostMeta, i: int,
              slot_range: range | None, scale: float) -> torch.Tensor:
    """Request ``i``'s rows ``q`` through ``cpu_attention.attend`` (its context a slot range or a gather)."""
    n = host.seq_lens[i]
    if slot_range is not None:
        return cpu_attention.attend(q, k_cache, v_cache, slot_range.start, None, n, scale)
    return cpu_attention.attend(q, k_cache, v_cache, 0, host.context_slots[i], n, scale)


def _rowwise_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, host: _HostMeta,
                       scale: float, window: int | None) -> torch.Tensor:
    """Batch-invariant mode: every query row — of a prefill chunk, a verify or a decode, in any batch —
    computed alone over exactly the context a decode at its position sees, with a decode's op shapes
    (the lone-verify rule of ``_Plan`` applied to every row), so its bits never depend on the step."""
    out = torch.empty_like(q)
    for i in range(host.num_reqs):
        ql, ctx, s = host.query_len(i), host.seq_lens[i], host.query_start[i]
        if ql == 0:
            continue
        k, v = _context(k_cache, v_cache, host, i, host.slot_range(i), q.dtype)
        for r in range(ql):
            c = ctx - ql + 1 + r
            mask = _mask(1, c, window, q.device)
            out[s + r:s + r + 1] = _grouped_attention(q[s + r:s + r + 1], k[:c], v[:c],
                                                      None if mask is None else ~mask, scale)
    return out


def _context(k_cache: torch.Tensor, v_cache: torch.Tensor, host: _HostMeta, i: int, slot_range: range | None,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of request ``i``'s whole context, [ctx, kvh, d]: a view of the cache when its slots are
    one contiguous range (its blocks allocated in order: the common case of one request), else a gather."""
    if slot_range is not None:
        k, v = k_cache[slot_range.start:slot_range.stop], v_cache[slot_range.start:slot_range.stop]
    else:
        slots = host.context_slots[i]
        k, v = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    if k.dtype != dtype:
        k, v = k.to(dtype), v.to(dtype)
    return k, v


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, neg_mask: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """q [q_len, h, d] over contiguous k, v [ctx, kvh, d] (a prefix view of a gathered context has
    the same strides as a fresh gather of that prefix: same op shapes, same bits)."""
    q_len, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    if q_len == 1:  # a decode (or one verify row): [1, h, d] is [kvh, g, d] already
        qg = q.reshape(kvh, g, d)
    else:
        qg = q.reshape(q_len, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * q_len, d)
    scores = torch.bmm(qg, k.permute(1, 2, 0)).mul_(scale)  # [kvh, g*q_len, ctx]
    if neg_mask is not None:
        scores = scores.view(kvh, g, q_len, -1).masked_fill_(neg_mask, float("-inf")).view(kvh, g * q_len, -1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if probs.dtype != q.dtype:
        probs = probs.to(q.dtype)
    o = torch.bmm(probs, v.transpose(0, 1))  # [kvh, g*q_len, d]
    if q_len == 1:
        return o.view(1, h, d)
    return o.view(kvh, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, h, d)


class _HostMeta:
    """Host-side lists of one step's metadata, read once per step (the torch backend loops on the host)."""

    def __init__(self, meta: AttentionMetadata) -> None:
        self.num_reqs = meta.num_reqs
        self.query_start: list[int] = meta.query_start.tolist()
        self.query_lens: list[int] = meta.query_lens.tolist()
        self.seq_lens: list[int] = meta.seq_lens.tolist()
        self.block_size = meta.block_size
        self.block_tables = meta.block_tables
        self._context_slots: list[torch.Tensor] | None = None

    @property
    def context_slots(self) -> list[torch.Tensor]:
        """Per request, the flat slots of positions 0 .. seq_len - 1 (built on first use: a lone decode
        over consecutive blocks reads a cache view instead)."""
        if self._context_slots is None:
            bs = self.block_size
            offsets = torch.arange(bs, device=self.block_tables.device)
            self._context_slots = [
                (self.block_tables[i, : -(-n // bs)][:, None] * bs + offsets[None, :]).flatten()[:n]
                for i, n in enumerate(self.seq_lens)
            ]
        return self._context_slots

    def query_len(self, i: int) -> int:
        return self.query_lens[i]

    def slot_range(self, i: int) -> range | None:
        """Request ``i``'s context slots as one range when its blocks are consecutive, else None."""
        n, bs = self.seq_lens[i], self.block_size
        if n == 0:
            return None
        blocks = self.block_tables[i, : -(-n // bs)].tolist()
        if blocks != list(range(blocks[0], blocks[0] + len(blocks))):
            return None
        return range(blocks[0] * bs, blocks[0] * bs + n)


def _host(meta: AttentionMetadata) -> _HostMeta:
    host = meta.plans.get("host")
    if host is None:
        host = meta.plans["host"] = _HostMeta(meta)
    return host


class _Plan:
    """Per-step, per-window gather indices and masks, built once and shared by all layers."""

    def __init__(self, meta: _HostMeta, window: int | None, dev: torch.device, exact_verify: bool = True,
                 c_rows: bool = False) -> None:
        self.host = meta
        self.c_plan: cpu_attention.RowPlan | None = None  # ``c_rows``: several short requests' rows for C
        self.short = [i for i in range(meta.num_reqs) if meta.query_len(i) <= _BATCHED_MAX_QUERY]
        self.long = [i for i in range(meta.num_reqs) if meta.query_len(i) > _BATCHED_MAX_QUERY]
        self.long_masks = [_mask(meta.query_len(i), meta.seq_lens[i], window, dev) for i in self.long]
        self.single: tuple[int, torch.Tensor | None] | None = None
        # A lone verify (batch-1 speculation) runs row by row, each row over exactly the context a
        # decode at its position sees, with the decode's op shapes: its rows are then bitwise what
        # decoding would compute, so greedy speculation cannot drift from plain decoding through
        # attention rounding (it did on the packed int4 path, whose bf16 activations amplify 1e-7
        # differences). Costs k + 1 small calls per layer instead of one, so only with ``exact_verify``
        # (the runner's float32 linears give a verify's rows other bits than a decode's: then one call).
        self.row_masks: list[torch.Tensor | None] | None = None
        self.single_range: range | None = None
        self.alone = False
        if len(self.short) == 1:  # nothing to batch with: no padding, gather or scatter
            i = self.short[0]
            ql, ctx = meta.query_len(i), meta.seq_lens[i]
            mask = _mask(ql, ctx, window, dev)
            self.single = (i, None if mask is None else ~mask)
            self.single_range = meta.slot_range(i)
            self.alone = meta.num_reqs == 1 and not self.long
            if ql > 1 and exact_verify:
                rows = [_mask(1, ctx - ql + 1 + r, window, dev) for r in range(ql)]
                self.row_masks = [None if m is None else ~m for m in rows]
            return
        if c_rows and self.short:  # no padded batch to lay out
            self.c_plan = cpu_attention.RowPlan([(meta.query_start[i], meta.context_slots[i], meta.query_len(i))
                                                 for i in self.short])
        if not self.short or c_rows:
            return
        reqs = self.short
        n = len(reqs)
        max_q = max(meta.query_len(i) for i in reqs)
        max_ctx = max(meta.seq_lens[i] for i in reqs)
        # Gather index [n, max_ctx]; padding points at slot 0 and is masked out below.
        gather = torch.zeros(n, max_ctx, dtype=torch.long, device=dev)
        q_rows = torch.zeros(n, max_q, dtype=torch.long, device=dev)
        q_valid = torch.zeros(n, max_q, dtype=torch.bool, device=dev)
        for j, i in enumerate(reqs):
            gather[j, : meta.seq_lens[i]] = meta.context_slots[i]
            ql = meta.query_len(i)
            q_rows[j, :ql] = torch.arange(meta.query_start[i], meta.query_start[i] + ql, device=dev)
            q_valid[j, :ql] = True
        ctx_lens = torch.tensor([meta.seq_lens[i] for i in reqs], device=dev)
        q_lens = torch.tensor([meta.query_len(i) for i in reqs], device=dev)
        # Position of query row r of request j: ctx_len - q_len + r.
        qpos = (ctx_lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]  # [n, max_q]
        kpos = torch.arange(max_ctx, device=dev)[None, None, :]
        mask = (kpos <= qpos[:, :, None]) & (kpos < ctx_lens[:, None, None])  # [n, max_q, max_ctx]
        if window is not None:
            mask = mask & (kpos > qpos[:, :, None] - window)
        self.n, self.max_q, self.max_ctx = n, max_q, max_ctx
        self.gather, self.q_rows, self.q_valid = gather, q_rows, q_valid
        # [n, 1, 1, max_q, max_ctx]; None when every key is visible to every row (lone decodes)
        self.neg_mask = None if bool(mask.all()) else ~mask[:, None, None]
        self.out_rows = q_rows[q_valid]
        self.gather_flat, self.q_rows_flat = gather.view(-1), q_rows.view(-1)
        self.uniform = bool(q_valid.all())


def _batched_short(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _Plan,
                   scale: float, out: torch.Tensor) -> None:
    """Padded short queries (≤ _BATCHED_MAX_QUERY) of all requests in one batched attention."""
    n, max_q, max_ctx = plan.n, plan.max_q, plan.max_ctx
    kvh, d = k_cache.shape[1], k_cache.shape[2]
    k = k_cache.index_select(0, plan.gather_flat).view(n, max_ctx, kvh, d).to(q.dtype)
    v = v_cache.index_select(0, plan.gather_flat).view(n, max_ctx, kvh, d).to(q.dtype)
    g = q.shape[1] // kvh
    # Query heads grouped by their KV head: [n, kvh, g * max_q, d] (row = head-in-group, query).
    qb = q.index_select(0, plan.q_rows_flat).reshape(n, max_q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(n, kvh, g * max_q, d)
    scores = torch.matmul(qb, k.permute(0, 2, 3, 1)) * scale  # [n, kvh, g*max_q, max_ctx]
    if plan.neg_mask is not None:
        scores = scores.view(n, kvh, g, max_q, max_ctx).masked_fill(plan.neg_mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(n, kvh, g * max_q, max_ctx)
    o = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [n, kvh, g*max_q, d]
    o = o.view(n, kvh, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(n, max_q, kvh * g, d)
    if plan.uniform:  # every request has max_q rows: no padding rows to drop
        out.index_copy_(0, plan.out_rows, o.reshape(n * max_q, kvh * g, d))
    else:
        out[plan.out_rows] = o[plan.q_valid]


class TorchAttention:
    """The torch attention backend: q/k norm and rope in torch, ``index_copy_`` KV write, paged
    attention above. Reference numerics (HF's order of operations)."""

    def __init__(self, rowwise: bool = False, exact_verify: bool = True, cpu_kernel: bool = False) -> None:
        self.rowwise = rowwise  # batch-invariant mode: every query row alone (``_rowwise_attention``)
        self.exact_verify = exact_verify  # a lone verify's rows as decodes compute them (``_Plan``)
        self.cpu_kernel = cpu_kernel  # a step's one short-query request through cpu_attention.py

    def forward(self, attn: Attention, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:  # [T, H * D]
        q, k, v = split_qkv(attn, qkv, positions) if attn.q_norm is not None else _rope_qk(attn, qkv, positions)
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, attn.scale, attn.sliding_window, self.rowwise,
                            self.exact_verify, self.cpu_kernel)
        return o.reshape(qkv.shape[0], attn.q_size)


def split_qkv(attn: Attention, qkv: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (per-head normed if the model has q/k norms, rotated) and v of a packed projection."""
    t = qkv.shape[0]
    q = qkv[:, : attn.q_size].reshape(t, attn.num_heads, attn.head_dim)
    k = qkv[:, attn.q_size: attn.q_size + attn.kv_size].reshape(t, attn.num_kv_heads, attn.head_dim)
    v = qkv[:, attn.q_size + attn.kv_size:].reshape(t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.rotary(positions, q, k)
    return q, k, v


def _rope_qk(attn: Attention, qkv: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``split_qkv`` without q/k norms, rotating q and k as one tensor (half the ops; the same values,
    element for element). q and k are views of that tensor: contiguous only for one token."""
    t, h = qkv.shape[0], attn.num_heads
    qk = qkv[:, : attn.q_size + attn.kv_size].reshape(t, h + attn.num_kv_heads, attn.head_dim)
    qk = attn.rotary.rotate(positions, qk)
    v = qkv[:, attn.q_size + attn.kv_size:].reshape(t, attn.num_kv_heads, attn.head_dim)
    return qk[:, :h], qk[:, h:], v
