"""Per-step attention metadata shared by every layer of one model's forward pass.

A step's query tokens are flattened: request i owns rows ``query_start[i]:query_start[i+1]`` of the
``[num_tokens, ...]`` activations. Its context (cached KV plus the new tokens) has ``seq_lens[i]``
positions; the new tokens are the last ``query_len`` of them, so query row r of request i sits at
position ``seq_lens[i] - query_len + r`` (causal offset). KV for the new tokens is written to the
flat slots in ``slot_mapping`` (slot = block_id * block_size + offset) before attention reads it.

Built once per step by the model runner (host side), consumed by an attention backend.
The CPU (torch) backend reads the host lists and ``context_slots``; the CUDA (Triton) backend reads
the ``*_d`` device tensors instead (there the host lists may be empty: a CUDA graph's metadata is
captured once and refilled in place on device, see ``worker/gpu_runner.py``). On that path a
request's rows may be padded: ``query_start_d`` is the padded layout, ``query_lens_d`` the real
query lengths, and padding tokens have slot -1 (nothing written).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int
    query_start: list[int]  # [num_reqs + 1] host ints
    seq_lens: list[int]  # [num_reqs] context length incl. this step's tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat KV slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32 (padded with 0)
    block_size: int
    # CPU backend: per request, the flat slots of positions 0..seq_len-1 (computed once per step).
    context_slots: list[torch.Tensor]
    # CUDA backend only (None on CPU): device copies, see the module docstring.
    seq_lens_d: torch.Tensor | None = None  # [num_reqs]
    query_start_d: torch.Tensor | None = None  # [num_reqs + 1]
    query_lens_d: torch.Tensor | None = None  # [num_reqs]
    max_query_len: int = 0  # host bound on query_lens_d (sizes the kernel grid)
    num_kv_splits: int = 1  # split-KV pieces per (request, kv head)
    # CPU backend: index/mask plans built by the first layer and reused by the others, keyed by
    # sliding window (layers of one model share everything but the window).
    plans: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start[i + 1] - self.query_start[i]
