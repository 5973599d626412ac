"""GPU model runner: device-side step inputs, Triton attention, fused layers, CUDA graphs.

``ModelRunner`` delegates here on CUDA. Per step the host builds every integer input — token ids,
positions, KV slots, context lengths, query starts/lengths, block tables, and the rows whose logits
are wanted — with numpy into one pinned int64 buffer, and sends it in one asynchronous copy. No
step needs a host sync of its own (the caller's sampler syncs once when it reads tokens).

Two ways to run a step:
- **bucketed** (decode, verify, draft steps: every request ≤ ``max_graph_q`` query tokens, at most
  ``max_graph_batch`` requests): requests padded to the step's max query length and the batch to a
  bucket, then a captured CUDA graph is replayed (``cuda_graphs.py``); logits and argmaxes for all
  padded rows (``forward_ids`` takes the argmaxes: a greedy step launches nothing after the replay).
- **eager** (prefill chunks, mixed long steps): exact layout, logits only for the wanted rows.

Layout of the int64 buffer for T tokens, B requests, block-table width W (bucketed: T = B·q):
``[ids T | positions T | slots T | seq_lens B | query_start B+1 | query_lens B | tables B·W | rows R]``.
Padding tokens: id 0, position 0, slot -1 (no KV write); padding requests: query length 0, context
0 (attention writes zeros). Host buffers are double-buffered and guarded by events, so the host
never overwrites bytes an in-flight copy still reads.

Knobs (``RunnerConfig``, config/runner.py; debug overrides through ``TANDEM_*`` variables, config/env.py):
``cuda_graphs`` (off: eager only), ``fused`` (off: the torch layer kernels with Triton attention),
``skinny_rows`` (steps of at most this many rows use the skinny matmuls; default 16; 0: cuBLAS only),
``skinny_multirow`` (2+ row skinny steps: one program per row, tensor cores, or "auto"),
``max_graph_batch``, ``kv_splits``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.config.runner import RunnerConfig
from tandem.errors import ConfigError
from tandem.kv.feature_cache import FeatureCache
from tandem.models.decoder import CausalLM, KVCache
from tandem.models.forward_context import ForwardContext, LayerKernels
from tandem.models.torch_kernels import TORCH_KERNELS
from tandem.sample.argmax import greedy_ids
from tandem.worker.attn_metadata import AttentionMetadata
from tandem.worker.batch import ChainedFrom, FedTokens, SeqChunk
from tandem.worker.cuda_graphs import CapturedStep, GraphCache, batch_bucket
from tandem.worker.cuda_kernels import (
    MAX_ROWS,
    CublasKernels,
    SkinnyKernels,
    default_row_rows,
    default_skinny_rows,
    fused_supported,
    invariant_logits,
)
from tandem.worker.input_packer import HostStaging, feed_rows, layout, pack, pack_fed, padded_rows, step_tensors
from tandem.worker.pdl import set_pdl
from tandem.worker.chain import HEAD, chain_fixup, chain_width, pack_chain
from tandem.worker.step_output import StepOutput
from tandem.worker.triton_argmax import argmax_rows
from tandem.worker.triton_attention import (
    MAX_SPLITS,
    num_sms,
    pick_num_splits,
    tile_shape,
)
from tandem.worker.triton_attention_backend import TritonAttention

MAX_GRAPH_Q = 8


class GpuModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[KVCache], block_size: int, device: torch.device,
                 cfg: RunnerConfig = RunnerConfig(), *, max_model_len: int | None = None, lookahead: int = 0,
                 pad_to_buckets: bool | None = None, max_graph_q: int = MAX_GRAPH_Q,
                 feature_layers: tuple[int, ...] = (), feature_cache: FeatureCache | None = None,
                 batch_invariant: bool = False) -> None:
        self.model = model
        # EAGLE: every step (graphs included) also computes these layers' input hidden states for all
        # query rows (id num_layers: the final post-norm hidden state), writes them to their slots
        # in ``feature_cache`` (the head reads them there) and ``forward`` returns them
        self.feature_layers = tuple(feature_layers)
        self.feature_cache = feature_cache
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.cfg = cfg
        set_pdl(cfg.pdl)
        arch = model.arch
        self.fused = cfg.fused and fused_supported(arch)
        # Steps of at most this many rows take the skinny Triton matmuls (cuda_kernels.default_skinny_rows).
        self.gemv_rows = default_skinny_rows(arch, cfg.skinny_multirow) if cfg.skinny_rows is None else cfg.skinny_rows
        row_rows = {"auto": default_row_rows(arch), "rows": MAX_ROWS, "dot": 1}[cfg.skinny_multirow]
        self._skinny = SkinnyKernels(row_rows=row_rows, defer=cfg.skinny_defer)
        self._cublas = CublasKernels()
        # Batch-invariant mode: one set of kernels for every step (fixed 16-row matmul tiles, the LM
        # head included; attention with fixed tiles and no split-KV), so a row's result does not
        # depend on the step's rows. The builder checks the model is fused-supported.
        self.invariant = batch_invariant
        if batch_invariant:
            if not self.fused:
                raise ConfigError("batch_invariant", f"{arch.family}: the fused CUDA kernels do not cover this "
                                                     "model (or runner_config fused=False), so no batch-invariant mode")
            self._skinny = SkinnyKernels(invariant=True)
        self._attention = TritonAttention(fused_rope=self.fused, fixed_tiles=batch_invariant)
        self.use_graphs = cfg.cuda_graphs and device.type == "cuda"
        self.pad = self.use_graphs if pad_to_buckets is None else pad_to_buckets
        self.max_graph_batch = cfg.max_graph_batch
        self.max_graph_q = max_graph_q
        if max_model_len is None:  # the model's rope table covers exactly the positions it was built for
            layers = model.model.layers
            max_model_len = layers[0].self_attn.rotary.cos.shape[0] if len(layers) else 1
        # A request holds blocks for up to max_model_len + lookahead (draft) tokens (scheduler.py);
        # steps with wider tables (none, by that rule) run eagerly.
        self.table_width = -(-(max_model_len + lookahead) // block_size)
        self.kv_heads = arch.num_kv_heads
        self.group = arch.num_heads // arch.num_kv_heads
        self.sms = num_sms(device)
        self.graphs = GraphCache(device) if self.use_graphs else None
        tmax = self.max_graph_batch * max_graph_q
        static_len = (layout(tmax, self.max_graph_batch, self.table_width)[-1] + 3 * tmax  # + rows, fed rows,
                      + 12 * self.max_graph_batch)  # chain descriptors (8 drafts)
        self._static = torch.zeros(static_len, dtype=torch.int64, device=device) if self.pad else None
        self._eager = torch.empty(0, dtype=torch.int64, device=device)
        self._host = HostStaging(device)
        self._kernels_compiled = False
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self._step_features: torch.Tensor | None = None  # set by _hidden inside a forward
        self._features: torch.Tensor | None = None  # the last forward's features, unpadded rows
        self._want_features = False  # ``forward`` asks for them (the engine reads the feature cache)

    # ---- public ------------------------------------------------------------------------------
    @property
    def fast_query_limit(self) -> int | None:
        """Steps of more query rows per request than this run eagerly (None without graphs:
        every step does)."""
        return self.max_graph_q if self.use_graphs else None

    def forward(self, chunks: Sequence[SeqChunk], rows: Sequence[int], token_ids: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = (), argmax_only: bool = False) -> StepOutput:
        """``forward_logits`` plus the features of every query row. ``aux_layers`` must be the
        runner's ``feature_layers`` (fixed at construction: the graphs compute them)."""
        if tuple(aux_layers) != self.feature_layers:
            raise ValueError(f"this runner computes features of layers {self.feature_layers}, not {aux_layers}")
        self._features, self._want_features = None, True
        try:
            logits = self.forward_logits(chunks, rows, token_ids)
        finally:
            self._want_features = False
        return StepOutput(logits, [] if self._features is None else [self._features])

    def forward_logits(self, chunks: Sequence[SeqChunk], rows: Sequence[int],
                       token_ids: torch.Tensor | None = None, argmax_only: bool = False,
                       fed: FedTokens | None = None, chain: ChainedFrom | None = None) -> torch.Tensor:
        """Logits [len(rows), V] float32 for flat (unpadded) query rows ``rows`` of the chunks.

        Bucketed steps may return a view of a graph's static output: valid until this runner's
        next forward. ``token_ids`` (device, one per single-token chunk) and ``fed`` (device ids for
        given query rows) overwrite the chunks' placeholder ids on the device after the input copy:
        no host read of sampled tokens; ``chain`` fixes a chained step's first ids and positions there
        (``chain.py``).
        ``argmax_only`` changes nothing here (the screened head is a CPU path): full logits.
        """
        if not chunks:
            return torch.empty((0, self.model.arch.vocab_size), dtype=torch.float32, device=self.device)
        qlens = [len(c.token_ids) for c in chunks]
        b = self._bucket_of(chunks, qlens)
        if b is not None:
            return self._run_bucketed(chunks, qlens, rows, b, max(qlens), token_ids, fed, chain)
        return self._run_eager(chunks, qlens, rows, token_ids, fed, chain)

    def forward_ids(self, chunks: Sequence[SeqChunk], rows: Sequence[int], token_ids: torch.Tensor | None = None,
                    fed: FedTokens | None = None, chain: ChainedFrom | None = None) -> torch.Tensor:
        """The greedy token of each row: a bucketed step's graph computes every row's argmax inside
        its replay (``_static_step``), so the step launches nothing after it (the two-kernel Triton
        argmax had cost ~50-90 µs of host time per step on the H100); an eager step's logits go
        through ``greedy_ids``."""
        if not chunks:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        qlens = [len(c.token_ids) for c in chunks]
        b = self._bucket_of(chunks, qlens)
        if b is not None:
            return self._run_bucketed(chunks, qlens, rows, b, max(qlens), token_ids, fed, chain, ids=True)
        return greedy_ids(self._run_eager(chunks, qlens, rows, token_ids, fed, chain))

    def _bucket_of(self, chunks: Sequence[SeqChunk], qlens: list[int]) -> int | None:
        """The batch bucket of a step that runs padded (a graph's shape), or None: it runs eagerly."""
        if not self.pad or max(qlens) > self.max_graph_q:
            return None
        b = batch_bucket(len(chunks), self.max_graph_batch)
        return b if b is not None and max(len(c.block_ids) for c in chunks) <= self.table_width else None

    def _meta(self, dev: torch.Tensor, t: int, b: int, w: int, qmax: int, splits: int
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return step_tensors(dev, t, b, w, self.block_size, qmax, splits)

    def _splits(self, b: int, qmax: int, max_seq: int | None) -> int:
        if self.invariant:
            return 1  # a split's partial sums would depend on how the batch filled the SMs
        if self.cfg.kv_splits is not None:
            return min(MAX_SPLITS, self.cfg.kv_splits)
        q_tiles = -(-qmax // tile_shape(qmax, self.group)[1])
        return pick_num_splits(b, self.kv_heads, q_tiles, max_seq, self.sms)

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The one model forward, with this step's kernels: skinny matmuls for few rows, else cuBLAS
        (fused models), else the torch kernels; Triton attention always. With feature layers, the
        features of all rows go to ``self._step_features`` ([T, F], one concatenation)."""
        if not self.fused:
            kernels: LayerKernels = TORCH_KERNELS
        elif self.invariant or ids.shape[0] <= min(self.gemv_rows, MAX_ROWS):
            kernels = self._skinny
        else:
            kernels = self._cublas
        layers = self.feature_layers
        hidden, aux = self.model(ids, pos, ForwardContext(meta, self.kv_caches, kernels, self._attention), layers)
        if layers:
            if self.model.arch.num_layers in layers:
                aux.append(hidden)
            self._step_features = aux[0] if len(aux) == 1 else torch.cat(aux, dim=-1)
            if self.feature_cache is not None:
                self.feature_cache.write(meta.slot_mapping, self._step_features)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits: the model's LM head, or in batch-invariant mode the same product on the
        fixed tiles."""
        if self.invariant:
            return invariant_logits(hidden, self.model.lm_head_weight)
        return self.model.compute_logits(hidden)

    # ---- eager -------------------------------------------------------------------------------
    def _run_eager(self, chunks: Sequence[SeqChunk], qlens: list[int], rows: Sequence[int],
                   token_ids: torch.Tensor | None = None, fed: FedTokens | None = None,
                   chain: ChainedFrom | None = None) -> torch.Tensor:
        self.num_eager_steps += 1
        n = len(chunks)
        w = max(1, max(len(c.block_ids) for c in chunks))
        total = sum(qlens)
        cap = (layout(total, n, w)[-1] + len(rows) + (2 * len(fed.rows) if fed is not None else 0)
               + (len(chunks) * chain_width(chain) if chain is not None else 0))
        if self._eager.numel() < cap:
            self._eager = torch.empty(max(cap, 2 * self._eager.numel()), dtype=torch.int64, device=self.device)
        i, buf = self._host.acquire(cap)
        length, t, r_off, identity = pack(self.block_size, buf, chunks, qlens, n, None, w, rows)
        end = pack_fed(buf, length, fed, fed.rows if fed is not None else ())
        if chain is not None:
            end, c_off = pack_chain(buf, end, chain, qlens, None)
        self._host.send(i, end, self._eager)
        if token_ids is not None:  # one token per request: ids occupy rows 0..n-1
            self._eager[:n].copy_(token_ids, non_blocking=True)
        if chain is not None:
            chain_fixup(self._eager, t, n, w, self.block_size, c_off, n, chain_width(chain), chain.row_tokens,
                        max(qlens), fed, length)
        else:
            feed_rows(self._eager, t, length, fed)
        max_seq = max(c.start + q for c, q in zip(chunks, qlens))
        ids, pos, meta = self._meta(self._eager, t, n, w, max(qlens), self._splits(n, max(qlens), max_seq))
        hidden = self._hidden(ids, pos, meta)
        if self._want_features:
            self._features = self._step_features
        if not identity:
            hidden = hidden.index_select(0, self._eager[r_off:r_off + len(rows)])
        return self._logits(hidden)

    # ---- bucketed (CUDA graphs) --------------------------------------------------------------
    def _static_step(self, b: int, q: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A padded step on the static buffer: logits, features (if any) and every row's argmax."""
        ids, pos, meta = self._meta(self._static, b * q, b, self.table_width, q, self._splits(b, q, None))
        logits = self._logits(self._hidden(ids, pos, meta))
        return logits, (self._step_features if self.feature_layers else None), greedy_ids(logits)

    def _ensure_graph(self, b: int, q: int) -> CapturedStep:
        assert self.graphs is not None
        step = self.graphs.get((b, q))
        if step is None:  # capture on all-padding inputs (writes nothing, reads nothing)
            w = self.table_width
            i, buf = self._host.acquire(layout(b * q, b, w)[-1])
            length, _, _, _ = pack(self.block_size, buf, [], [], b, q, w, None)
            self._host.send(i, length, self._static)
            step = self.graphs.capture((b, q), lambda: self._static_step(b, q))
        return step

    def warm_up(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> None:
        """Compile every kernel variant (``compile_kernels``, once), then capture these steps' graphs."""
        if not self._kernels_compiled:
            self.compile_kernels()
            self._kernels_compiled = True
        self.capture(batch_sizes, query_lens)

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """Compile now every Triton kernel variant a step can pick at run time: the attention's query
        tile (1..64 query rows) with and without split-KV, and the greedy argmax. Runs eager steps on
        all-padding inputs (no KV slot read or written). Without it the first request of a new shape
        class (e.g. the first prompt short enough for one KV split) waits ~0.5-0.9 s for a compile."""
        w = self.table_width
        # a buffer of its own: tensors made under inference mode must not become the runner's buffers
        dev = torch.empty(layout(64, 1, w)[-1], dtype=torch.int64, device=self.device)
        q = 1
        while q <= 64:
            cap = layout(q, 1, w)[-1]
            for splits in (1, 2):
                i, buf = self._host.acquire(cap)
                length, _, _, _ = pack(self.block_size, buf, [], [], 1, q, w, None)
                self._host.send(i, length, dev)
                ids, pos, meta = self._meta(dev, q, 1, w, q, splits)
                argmax_rows(self._logits(self._hidden(ids, pos, meta)))
            q *= 2
        # a chained step's fix-up (one variant for every graph-sized step), on an all-padding step
        i, buf = self._host.acquire(layout(1, 1, w)[-1] + HEAD + 1)
        length, _, _, _ = pack(self.block_size, buf, [], [], 1, 1, w, None)
        buf[length:length + HEAD + 1] = [0, 1, 0, 0, -1]
        self._host.send(i, length + HEAD + 1, dev)
        chain_fixup(dev, 1, 1, w, self.block_size, length, 1, HEAD + 1, dev[:1].clone(), 1)
        # ... and a verify's fed drafts without a chain (one variant: nothing fed here)
        from tandem.worker.triton_feed import feed_rows_cuda

        feed_rows_cuda(dev, dev[:1].clone(), length, 0)
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
                      q: int, token_ids: torch.Tensor | None = None, fed: FedTokens | None = None,
                      chain: ChainedFrom | None = None, ids: bool = False) -> torch.Tensor:
        """The logits of ``rows`` (``ids``: their argmaxes instead)."""
        self.num_graph_steps += 1
        w = self.table_width
        if self.graphs is not None and self.graphs.get((b, q)) is None:
            # the smallest captured graph that fits (more padding, no capture while serving); a step
            # that fits none is captured now (warm_up_plan captures every shape the engine makes)
            fit = self.graphs.best_fit(b, q)
            if fit is not None:
                b, q = fit
        step = self._ensure_graph(b, q) if self.graphs is not None else None
        i, buf = self._host.acquire(layout(b * q, b, w)[-1] + len(rows) + (2 * len(fed.rows) if fed else 0)
                                    + (len(chunks) * chain_width(chain) if chain is not None else 0))
        length, t, r_off, identity = pack(self.block_size, buf, chunks, qlens, b, q, w, rows)
        end = pack_fed(buf, length, fed, padded_rows(qlens, q, fed.rows) if fed is not None else ())
        if chain is not None:
            end, c_off = pack_chain(buf, end, chain, qlens, q)
        self._host.send(i, end, self._static)
        if token_ids is not None:  # request i's single token sits at padded row i * q
            self._static[: len(chunks) * q: q].copy_(token_ids, non_blocking=True)
        if chain is not None:  # (its fed rows in the same launch)
            chain_fixup(self._static, t, b, w, self.block_size, c_off, len(chunks), chain_width(chain),
                        chain.row_tokens, q, fed, length)
        else:
            feed_rows(self._static, t, length, fed)
        if step is not None:
            step.graph.replay()
            logits, features, argmax = step.logits, step.features, step.ids
        else:  # padded layout without graphs (tests on CPU)
            logits, features, argmax = self._static_step(b, q)
        if features is not None and self._want_features:  # padded rows: request i's at i*q .. i*q + qlens[i]
            n = len(chunks)
            if all(ql == q for ql in qlens):
                self._features = features[: n * q]
            else:
                self._features = torch.cat([features[i * q:i * q + ql] for i, ql in enumerate(qlens)])
        if not ids:
            return logits if identity else logits.index_select(0, self._static[r_off:r_off + len(rows)])
        assert argmax is not None  # (every graph of this runner computes it)
        # (a copy either way: a step's tokens outlive the next replay of its graph)
        return argmax.clone() if identity else argmax.index_select(0, self._static[r_off:r_off + len(rows)])

