"""TorchRunner: one model, its KV cache and the device; runs a forward over SeqChunks with torch ops.

Returns float32 logits only for the rows the caller asks for (sampled positions), so a long prefill
chunk never materialises a [T, vocab] tensor unless prompt logprobs are requested.
Used for the target and, with its own instance, for a draft model.

The CPU path, and the reference on any device (``RunnerConfig.backend = "torch"``); on CUDA the
factory in ``runner.py`` picks ``GpuModelRunner`` (device-side inputs, Triton attention, fused
layers, CUDA graphs) instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.kv.feature_cache import FeatureCache
from tandem.models.decoder import CausalLM, KVCache
from tandem.models.forward_context import ForwardContext
from tandem.models.quant.q4_linear import Q4Linear
from tandem.models.torch_kernels import LONE_VERIFY_KERNELS, ROWWISE_KERNELS, TORCH_KERNELS
from tandem.sample.argmax import greedy_ids
from tandem.sample.rejection import accept_matching
from tandem.worker import cpu_attention
from tandem.worker.attention import TorchAttention
from tandem.worker.batch import ChainedFrom, FedTokens, SeqChunk
from tandem.worker.input_packer import layout, locate, pack, step_tensors
from tandem.worker.lone_decode import LoneDecoder
from tandem.worker.step_output import StepOutput


class TorchRunner:
    def __init__(self, model: CausalLM, kv_caches: list[KVCache], block_size: int,
                 device: torch.device, batch_invariant: bool = False, script: bool = True,
                 feature_layers: tuple[int, ...] = (), feature_cache: FeatureCache | None = None,
                 max_verify_rows: int = 1) -> None:
        self.model = model
        self.max_verify_rows = max_verify_rows  # a verify's query rows at most (k + 1): see _long_verify
        # EAGLE: with a feature cache, every forward also computes these layers' input hidden states
        # for all query rows and writes them to their slots there (the head reads them there)
        self.feature_layers = tuple(feature_layers) if feature_cache is not None else ()
        self.feature_cache = feature_cache
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # batch-invariant mode: every row alone through the linears, norms, attention and LM head
        self.invariant = batch_invariant
        self.kernels = ROWWISE_KERNELS if batch_invariant else TORCH_KERNELS
        # A batch-1 verify on the CPU runs its float linears row by row when the model also has packed
        # quantized ones: their bf16 activations turn a float linear's row-count-dependent rounding
        # (~1e-7) into different greedy tokens (gemma-3-270m's GGUF). An all-float model keeps one
        # matmul per linear (4 GEMVs would read its weights 4 times; its fp32 rows differ by ~1e-7),
        # so its verify's attention is one masked call per layer too, not a decode's row by row.
        packed = any(hasattr(m, "forward_lowp") for m in model.modules())
        # Linears on tandem's CPU kernel (cpu_q4): a step's one short-query request also takes tandem's
        # CPU attention (cpu_attention.py), here and in the scripted step (lone_decode.py) alike
        own = (device.type == "cpu" and not batch_invariant and any(isinstance(m, Q4Linear) for m in model.modules())
               and cpu_attention.available())
        self.attention = TorchAttention(rowwise=batch_invariant, exact_verify=packed or device.type != "cpu",
                                        cpu_kernel=own)
        self._verify_kernels = (LONE_VERIFY_KERNELS if packed and device.type == "cpu" and not batch_invariant
                                else None)
        # batch-1 decode / verify steps of a packed int4 model run as one TorchScript function
        # (lone_decode.py; RunnerConfig.cpu_script). None: not built yet; False: not this model
        self._lone: LoneDecoder | None | bool = None if (script and device.type == "cpu" and not batch_invariant) else False

    def forward_logits(self, chunks: Sequence[SeqChunk], rows: Sequence[int],
                       token_ids: torch.Tensor | None = None, argmax_only: bool = False,
                       fed: FedTokens | None = None, chain: ChainedFrom | None = None) -> torch.Tensor:
        # (host reads of device values: fine on this path, where nothing runs ahead of the host)
        if fed is not None and fed.rows:
            chunks = substitute(chunks, fed.rows, fed.values.index_select(
                0, torch.tensor(fed.src, device=fed.values.device)).tolist())
        if chain is not None:
            chunks = _chained(chunks, chain)
        return self.forward(chunks, rows, token_ids, argmax_only=argmax_only).logits

    def forward_ids(self, chunks: Sequence[SeqChunk], rows: Sequence[int], token_ids: torch.Tensor | None = None,
                    fed: FedTokens | None = None, chain: ChainedFrom | None = None) -> torch.Tensor:
        return greedy_ids(self.forward_logits(chunks, rows, token_ids, argmax_only=True, fed=fed, chain=chain))

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], rows: Sequence[int], token_ids: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = (), argmax_only: bool = False) -> StepOutput:
        """Run the chunks; return logits [len(rows), V] for flat query rows ``rows``, and for *every*
        query row the hidden states entering each layer of ``aux_layers`` (the EAGLE-3 hook; id
        ``num_layers`` means the final post-norm hidden state, what EAGLE-1 heads read).

        ``token_ids`` ([len(chunks)] int64 on the model's device), for chunks of one token each:
        the tokens to run instead of the chunks' own (placeholders), so a caller can feed tokens it
        sampled on the device without reading them on the host (the draft loop does).

        With a feature cache, ``aux_layers`` must be empty or the runner's ``feature_layers``.
        """
        if self.feature_cache is not None:
            if aux_layers and tuple(aux_layers) != self.feature_layers:
                raise ValueError(f"this runner computes features of layers {self.feature_layers}, not {aux_layers}")
            aux_layers = self.feature_layers
        if token_ids is not None:
            if any(len(c.token_ids) != 1 for c in chunks) or token_ids.shape != (len(chunks),):
                raise ValueError("token_ids needs one token per single-token chunk")
            # a host read: fine on this path, where nothing runs ahead of the host
            chunks = [SeqChunk([t], c.start, c.block_ids) for c, t in zip(chunks, token_ids.tolist())]
        if (len(chunks) == 1 and LoneDecoder.MAX_ROWS < len(chunks[0].token_ids) <= self.max_verify_rows
                and self._verify_kernels is not None and list(rows) == list(range(len(chunks[0].token_ids)))):
            return self._long_verify(chunks[0], aux_layers, argmax_only)
        if (len(chunks) == 1 and 0 < len(chunks[0].token_ids) <= LoneDecoder.MAX_ROWS
                and list(rows) == list(range(len(chunks[0].token_ids)))):  # a batch-1 decode or verify
            if self._lone is None:
                self._lone = LoneDecoder.build(self.model, self.kv_caches, self.block_size,
                                               self.attention.cpu_kernel) or False
            if self._lone:
                c = chunks[0]
                logits, aux = self._lone.logits(c.token_ids, c.start, c.block_ids, argmax_only, aux_layers)
                if self.feature_cache is not None:
                    self.feature_cache.write_positions(c.block_ids, c.start, _concat(aux))
                return StepOutput(logits, aux)
        vocab = self.model.arch.vocab_size
        if not chunks:
            return StepOutput(torch.empty((0, vocab), dtype=torch.float32, device=self.device), [])
        qlens = [len(c.token_ids) for c in chunks]
        n, w = len(chunks), max(1, max(len(c.block_ids) for c in chunks))
        buf = np.empty(layout(sum(qlens), n, w)[-1] + len(rows), dtype=np.int64)
        length, t, r_off, identity = pack(self.block_size, buf, chunks, qlens, n, None, w, rows)
        inputs = torch.from_numpy(buf[:length]).to(self.device)  # no copy on CPU
        ids, pos, meta = step_tensors(inputs, t, n, w, self.block_size, max(qlens))
        kernels = self.kernels
        if n == 1 and 1 < qlens[0] <= LoneDecoder.MAX_ROWS and self._verify_kernels is not None:
            kernels = self._verify_kernels  # a batch-1 verify's rows bitwise its decodes (torch_kernels.py)
        ctx = ForwardContext(meta, self.kv_caches, kernels, self.attention)
        hidden, aux = self.model(ids, pos, ctx, aux_layers)
        if self.model.arch.num_layers in aux_layers:
            aux.append(hidden)
        if self.feature_cache is not None:
            self.feature_cache.write(meta.slot_mapping, _concat(aux))
        if not identity:
            hidden = hidden.index_select(0, inputs[r_off:r_off + len(rows)])
        if self.invariant and hidden.shape[0] > 1:
            logits = torch.cat([self.model.compute_logits(hidden[i:i + 1]) for i in range(hidden.shape[0])])
        else:
            logits = self.model.compute_logits(hidden, argmax_only)
        return StepOutput(logits, aux)

    def _long_verify(self, chunk: SeqChunk, aux_layers: tuple[int, ...], argmax_only: bool) -> StepOutput:
        """A batch-1 verify of more than ``LoneDecoder.MAX_ROWS`` rows (suffix decoding's k = 24) on a
        packed CPU model, as consecutive verifies of at most that many rows: each row is then bitwise
        its decode (the lone path), where the long-query attention (SDPA over a causal mask) rounds
        differently and greedy speculation drifted from plain decoding (docs/performance.md §34).
        (A prefill whose every row is wanted, for prompt logprobs, is split only when it is no
        longer than a verify: ``max_verify_rows``.)"""
        m = LoneDecoder.MAX_ROWS
        parts = [SeqChunk(chunk.token_ids[i:i + m], chunk.start + i, chunk.block_ids)
                 for i in range(0, len(chunk.token_ids), m)]
        outs = [self.forward([p], list(range(len(p.token_ids))), aux_layers=aux_layers, argmax_only=argmax_only)
                for p in parts]
        aux = [torch.cat(parts) for parts in zip(*(o.aux_hidden for o in outs))]
        return StepOutput(torch.cat([o.logits for o in outs]), aux)

    @property
    def fast_query_limit(self) -> int | None:
        """A packed CPU model verifies at most ``LoneDecoder.MAX_ROWS`` rows in one step; a longer
        batch-1 verify runs as consecutive ones (``_long_verify``), each costing about a step (on the
        2-core CPU, suffix decoding's k = 24 read 1.11-1.27x where drafts cut at 7 read 1.65-1.68x,
        docs/performance.md §36). None for float models (one forward for any length)."""
        return LoneDecoder.MAX_ROWS if self._verify_kernels is not None else None

    def warm_up(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> None:
        """Nothing to compile or capture on the torch path."""


def substitute(chunks: Sequence[SeqChunk], flat_rows: Sequence[int], ids: Sequence[int]) -> list[SeqChunk]:
    """The chunks with the tokens at these flat query rows replaced."""
    flat = [list(c.token_ids) for c in chunks]
    for (i, j), tok in zip(locate([len(t) for t in flat], flat_rows), ids):
        flat[i][j] = tok
    return [SeqChunk(t, c.start, c.block_ids) for t, c in zip(flat, chunks)]


def _chained(chunks: Sequence[SeqChunk], chain: ChainedFrom) -> list[SeqChunk]:
    """The chunks as ``chain`` leaves them (worker/chain.py), from a host read of the verify's rows."""
    rows = chain.row_tokens.tolist()
    out = []
    for c, off, drafts in zip(chunks, chain.offsets, chain.drafts):
        verdict = accept_matching(rows[off:off + len(drafts) + 1], [drafts])
        rejected = len(drafts) - verdict.num_accepted[0]
        out.append(SeqChunk([verdict.token_ids[0][-1], *c.token_ids[1:]], c.start - rejected, c.block_ids))
    return out


def _concat(aux: list[torch.Tensor]) -> torch.Tensor:
    return aux[0] if len(aux) == 1 else torch.cat(aux, dim=-1)
