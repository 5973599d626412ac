"""Per-step attention metadata shared by every layer of one model's forward pass — one shape for
every attention backend, built by the runner from the one input packer's buffer.

A step's query tokens are flattened (possibly padded, see ``worker/input_packer.py``): request i
owns rows ``query_start[i] : query_start[i] + query_lens[i]``. Its context (cached KV plus the new
tokens) has ``seq_lens[i]`` positions; the new tokens are the last ``query_lens[i]`` of them, so query
row r of request i sits at position ``seq_lens[i] - query_lens[i] + r`` (causal offset). KV for the
new tokens is written to the flat slots in ``slot_mapping`` (slot = block_id * block_size + offset;
-1 = padding, nothing written) before attention reads it. Padding requests have query length 0 and
context 0.

All tensors live on the model's device (on CUDA they are slices of one device buffer that a captured
graph's replays refill in place). ``plans`` is scratch for backends that prepare host-side index
plans once per step and share them across layers (the torch backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, width] int64 (padded with 0)
    seq_lens: torch.Tensor  # [num_reqs] context length incl. this step's tokens
    query_start: torch.Tensor  # [num_reqs + 1] first row of each request
    query_lens: torch.Tensor  # [num_reqs] real query rows of each request
    max_query_len: int  # host bound on query_lens (sizes kernel grids)
    num_kv_splits: int = 1  # Triton backend: split-KV pieces per (request, kv head)
    plans: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
