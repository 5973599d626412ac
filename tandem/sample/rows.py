"""SamplingRow: one position at which a token is sampled, with everything the math needs.

The engine gathers, for one step, N rows in a fixed order:

- a plain decode request contributes 1 row;
- a request verifying k draft tokens contributes k + 1 contiguous rows; row j is the target's
  distribution after the j-th draft token, so its ``output_token_ids`` already include drafts
  ``0..j-1`` (penalties and ``min_tokens`` see the drafts as if they had been generated);
- a prefill chunk that completes the prompt contributes 1 row.

Invariants: rows are immutable; ``output_token_ids`` holds only tokens *before* the row's position;
``generator`` is the request's own seeded generator (``params.seed`` given) or None, in which case the
sampler uses the shared default generator handed to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    # Sequences of ints, or 1-D int64 CPU tensors (cheaper: the engine may keep one per request).
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated tokens before this position (incl. earlier drafts)
    eos_token_ids: tuple[int, ...] = ()  # model EOS ids: masked while len(output) < min_tokens
    generator: torch.Generator | None = None  # None → the shared default generator


def rows_for_request(
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    draft_token_ids: Sequence[int] = (),
    eos_token_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> list[SamplingRow]:
    """The k + 1 rows of a request verifying k drafts (k = 0: the single decode/prefill row).

    Row j sees ``output + drafts[:j]`` as its history, exactly what the request's output would be if
    drafts 0..j-1 are accepted.
    """
    rows = [SamplingRow(params, prompt_token_ids, output_token_ids, eos_token_ids, generator)]
    if draft_token_ids:
        base = (
            output_token_ids.tolist()
            if isinstance(output_token_ids, torch.Tensor)
            else list(output_token_ids)
        )
        drafts = list(draft_token_ids)
        for j in range(1, len(drafts) + 1):
            rows.append(
                SamplingRow(params, prompt_token_ids, base + drafts[:j], eos_token_ids, generator)
            )
    return rows
