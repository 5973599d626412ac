"""HeadRunner: runs an EAGLE head over SeqChunks with its own one-layer paged KV cache.

The head's KV tensors have as many slots as the target's and use the target's block tables (like a
draft model's), so the scheduler's allocation — with ``lookahead = k`` spare slots — covers it. Head
position ``p`` holds the head's attention state for "target feature at p, token at p + 1".

``forward(chunks, rows, hidden)`` runs one step over a flat batch: each chunk's tokens (the *next*
tokens of its positions), ``hidden`` [T, H] the hidden input per query row — the previous step's
feedback, or ``None`` for a proposal's first step: the target's features of the rows' positions,
gathered from the feature cache by the step's own slot mapping (head position ``p`` sits in the slot
of target position ``p``) and fused (``EagleHead.step0_hidden``). It returns, for the flat rows
``rows``, the greedy draft token (a target id, on the device) and the feedback for the next step.
A step of a proposal chained on a verify still on the device (``chain``: ``HeadChain``) is fixed on
the device after its input copy (worker/chain.py: ``head_chain_fixup``). Torch ops on any device
(``TORCH_KERNELS``); the CUDA head runner (gpu_head_runner.py) runs its graphed steps on the target's
fused kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tandem.config.runner import RunnerConfig
from tandem.kv.feature_cache import FeatureCache, require_features
from tandem.models.eagle import EagleHead
from tandem.models.forward_context import ForwardContext, KVCache
from tandem.models.torch_kernels import TORCH_KERNELS
from tandem.worker import cpu_attention
from tandem.worker.attention import TorchAttention
from tandem.worker.batch import HeadChain, SeqChunk
from tandem.worker.chain import head_chain_fixup, head_chain_room, pack_chain, verify_rows_fed
from tandem.worker.head_step import HeadStep
from tandem.worker.input_packer import layout, pack, pack_fed, step_tensors


class HeadRunner:
    def __init__(self, head: EagleHead, kv_cache: KVCache, block_size: int, device: torch.device,
                 features: FeatureCache | None = None) -> None:
        self.head = head
        self.features = features  # the target's features (a proposal's first step reads them)
        self.kv_caches = [kv_cache]
        self.block_size = block_size
        self.device = device
        # on the CPU a step's one request goes to tandem's C attention (cpu_attention.py), as a packed
        # target's does: every row as a decode computes it, whatever the step's row count
        self.attention = TorchAttention(cpu_kernel=device.type == "cpu" and cpu_attention.available())

    def warm_up(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> None:
        """Nothing to compile or capture on the torch path."""

    def forward_chain(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor, token_ids: torch.Tensor, steps: int,
                      chain: HeadChain | None = None) -> list[torch.Tensor] | None:
        """None: the torch path runs chain steps one at a time (the CUDA runner may take them in one
        graph: ``GpuHeadRunner.forward_chain``)."""
        return None

    def forward_proposal(self, chunks: Sequence[SeqChunk], rows: Sequence[int], steps: int,
                         chain: HeadChain | None = None) -> torch.Tensor | None:
        """None: the torch path runs a proposal's steps one at a time (the CUDA runner may take the
        whole proposal in one graph: ``GpuHeadRunner.forward_proposal``)."""
        return None

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], rows: Sequence[int], hidden: torch.Tensor | None,
                token_ids: torch.Tensor | None = None, chain: HeadChain | None = None) -> HeadStep:
        """``hidden`` None: the target's features from the feature cache. ``token_ids`` ([len(chunks)]
        on the device) replaces the tokens of single-token chunks (the previous step's drafts, kept
        on the device). ``chain``: the step of a proposal chained on a launched verify, fixed on the
        device (worker/chain.py: ``head_chain_fixup``)."""
        qlens = [len(c.token_ids) for c in chunks]
        t_total = sum(qlens)
        if hidden is not None and hidden.shape[0] != t_total:
            raise ValueError(f"hidden has {hidden.shape[0]} rows for {t_total} query tokens")
        n, w = len(chunks), max(1, max(len(c.block_ids) for c in chunks))
        fed = verify_rows_fed(chain, qlens) if chain is not None else None
        buf = np.empty(layout(t_total, n, w)[-1] + len(rows) + head_chain_room(chain, fed, n), dtype=np.int64)
        length, t, r_off, identity = pack(self.block_size, buf, chunks, qlens, n, None, w, rows)
        end = pack_fed(buf, length, fed, fed.rows if fed is not None else ())
        if chain is not None:
            end, c_off = pack_chain(buf, end, chain.verify, qlens, None)
        inputs = torch.from_numpy(buf[:end]).to(self.device)
        if chain is not None:
            head_chain_fixup(inputs, chain, fed, t, n, w, self.block_size, length, c_off,
                             None if identity else r_off, max(qlens))
        ids, pos, meta = step_tensors(inputs, t, n, w, self.block_size, max(qlens))
        if token_ids is not None:
            if any(q != 1 for q in qlens):
                raise ValueError("token_ids needs one token per single-token chunk")
            ids = token_ids
        if hidden is None:
            hidden = self.head.step0_hidden(require_features(self.features).gather(meta.slot_mapping))
        ctx = ForwardContext(meta, self.kv_caches, TORCH_KERNELS, self.attention)
        out = self.head(ids, pos, hidden.to(self.head.fc.weight.dtype), ctx)
        if not identity:
            out = out.index_select(0, inputs[r_off:r_off + len(rows)])
        logits = self.head.logits(out)
        return HeadStep(self.head.draft_to_target[logits.argmax(dim=-1)], self.head.feedback(out), logits)


class AnyHeadRunner(Protocol):
    head: EagleHead

    def forward(self, chunks: Sequence[SeqChunk], rows: Sequence[int], hidden: torch.Tensor | None,
                token_ids: torch.Tensor | None = None, chain: HeadChain | None = None) -> HeadStep: ...

    def forward_chain(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor, token_ids: torch.Tensor, steps: int,
                      chain: HeadChain | None = None) -> list[torch.Tensor] | None: ...

    def forward_proposal(self, chunks: Sequence[SeqChunk], rows: Sequence[int], steps: int,
                         chain: HeadChain | None = None) -> torch.Tensor | None: ...

    def warm_up(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> None: ...


def make_head_runner(head: EagleHead, kv_cache: KVCache, block_size: int, device: torch.device,
                     cfg: RunnerConfig, *, max_model_len: int, lookahead: int,
                     features: FeatureCache | None = None) -> AnyHeadRunner:
    """The CUDA head runner (Triton attention, graphs unless ``cfg.cuda_graphs`` is off) on CUDA
    unless ``cfg.backend == "torch"``; this torch runner otherwise."""
    if device.type == "cuda" and cfg.backend != "torch":
        from tandem.worker.gpu_head_runner import GpuHeadRunner  # imports Triton: CUDA only

        return GpuHeadRunner(head, kv_cache, block_size, device, max_model_len=max_model_len,
                             lookahead=lookahead, use_graphs=cfg.cuda_graphs, max_graph_batch=cfg.max_graph_batch,
                             features=features)
    return HeadRunner(head, kv_cache, block_size, device, features)

