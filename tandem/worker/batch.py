"""``SeqChunk``: one request's query tokens for one forward pass of one model (target or draft).

Tokens at positions ``start .. start + len - 1``, whose KV goes into the request's blocks. Prefill
chunks, decodes, k+1-token verifies and draft-model catch-ups are all SeqChunks; the one input
packer (``input_packer.py``) flattens a step's chunks into model inputs and attention metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SeqChunk:
    token_ids: Sequence[int]
    start: int  # position of token_ids[0]
    block_ids: Sequence[int]
