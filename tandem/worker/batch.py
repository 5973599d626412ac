"""Flatten a step's sequences into model inputs and attention metadata.

A ``SeqChunk`` is one request's query tokens for one forward pass of one model (target or draft):
tokens at positions ``start .. start + len - 1``, whose KV goes into the request's blocks. The same
builder serves prefill chunks, decodes, k+1-token verifies and draft-model catch-ups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.worker.attn_metadata import AttentionMetadata


@dataclass(frozen=True)
class SeqChunk:
    token_ids: Sequence[int]
    start: int  # position of token_ids[0]
    block_ids: Sequence[int]


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata


def build_inputs(chunks: Sequence[SeqChunk], block_size: int, device: torch.device) -> ModelInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    context_slots: list[torch.Tensor] = []
    max_blocks = max((len(c.block_ids) for c in chunks), default=0)
    tables = torch.zeros(len(chunks), max(max_blocks, 1), dtype=torch.int32)
    offsets = torch.arange(block_size)
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        end = c.start + n
        if end > len(c.block_ids) * block_size:
            raise RuntimeError(f"sequence of {end} tokens exceeds its {len(c.block_ids)} KV blocks")
        ids.extend(c.token_ids)
        positions.extend(range(c.start, end))
        for p in range(c.start, end):
            slots.append(c.block_ids[p // block_size] * block_size + p % block_size)
        query_start.append(query_start[-1] + n)
        seq_lens.append(end)
        blocks = torch.tensor(c.block_ids, dtype=torch.long)
        tables[i, : len(c.block_ids)] = blocks.to(torch.int32)
        context_slots.append((blocks[:, None] * block_size + offsets[None, :]).flatten()[:end].to(device))
    meta = AttentionMetadata(
        num_tokens=len(ids),
        query_start=query_start,
        seq_lens=seq_lens,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=tables.to(device),
        block_size=block_size,
        context_slots=context_slots,
    )
    return ModelInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
    )
