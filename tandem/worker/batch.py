"""``SeqChunk``: one request's query tokens for one forward pass of one model (target or draft).

Tokens at positions ``start .. start + len - 1``, whose KV goes into the request's blocks. Prefill
chunks, decodes, k+1-token verifies and draft-model catch-ups are all SeqChunks; the one input
packer (``input_packer.py``) flattens a step's chunks into model inputs and attention metadata.

``ChainedFrom``: a step chained on a verify still on the device (worker/chain.py).

``HeadChain``: an EAGLE head's step of a proposal chained on such a verify (spec_decode/eagle.py).

``FedTokens``: query tokens whose ids are on the device only (drafts an EAGLE head left there): the
chunks carry placeholders at those rows and the runner writes ``values[src[i]]`` into flat query row
``rows[i]`` on the device, after its input copy, so the host never waits for the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SeqChunk:
    token_ids: Sequence[int]
    start: int  # position of token_ids[0]
    block_ids: Sequence[int]


@dataclass(frozen=True)
class FedTokens:
    values: torch.Tensor  # [m] int64 on the model's device
    src: tuple[int, ...]  # index into ``values`` of each fed row
    rows: tuple[int, ...]  # flat (unpadded) query rows of the step that take them


@dataclass(frozen=True)
class ChainedFrom:
    """A step chained on a launched step whose result is on the device only: chunk i's first token
    is the token that step emitted for its request, and the chunk was packed as if that step (a
    verify) accepted every draft it checked for it (worker/chain.py fixes both on the device)."""

    row_tokens: torch.Tensor  # [R] int64 on the device: the step's rows' tokens (a verify's argmaxes)
    offsets: tuple[int, ...]  # per chunk: its request's first row in ``row_tokens``
    drafts: tuple[tuple[int, ...], ...]  # per chunk: the drafts those rows checked (empty: a decode)


@dataclass(frozen=True)
class HeadChain:
    """A head step of a proposal made before the verify it follows was read (spec_decode/eagle.py):
    chunk i belongs to the request of ``verify``'s chunk i and was packed as if that verify accepted
    every draft. ``catch_up`` (the proposal's first step): each chunk's last k_i + 1 rows take the
    verify's row argmaxes on the device (the rows up to the emitted token are then the accepted
    tokens) and its selected output row moves back by the rejected count. Otherwise (a chain step
    of one row per chunk) positions, KV slots and context lengths move back by it (worker/chain.py)."""

    verify: ChainedFrom
    catch_up: bool
