"""SamplingRow: one position at which a token is sampled, with everything the math needs.

The engine gathers, for one step, N rows in a fixed order:

- a plain decode request contributes 1 row;
- a request verifying k draft tokens contributes k + 1 contiguous rows; row j is the target's
  distribution after the j-th draft token, so its ``output_token_ids`` already include drafts
  ``0..j-1`` (penalties and ``min_tokens`` see the drafts as if they had been generated);
- a prefill chunk that completes the prompt contributes 1 row.

Invariants: rows are immutable; ``output_token_ids`` holds only tokens *before* the row's
position; ``generator`` is the request's own randomness (a ``SeededStream`` when ``params.seed`` is
given, drawn at the row's position ``len(output_token_ids)``; a ``torch.Generator`` drawn as a
stream) or None, in which case the sampler uses the shared default generator handed to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload


from tandem.sample.seeded import Randomness
from tandem.sampling_params import SamplingParams


class ExtendedTokens(Sequence[int]):
    """``base + extra`` without copying ``base``.

    The history of row j of a verify step is the request's output plus drafts[:j];
    ``process_logits`` counts ``base`` once for all k + 1 rows and only the suffixes per row.
    """

    __slots__ = ("base", "extra")

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self.base = base
        self.extra = extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __iter__(self) -> Iterator[int]:
        yield from (int(t) for t in self.base)
        yield from (int(t) for t in self.extra)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token index out of range")
        nb = len(self.base)
        return int(self.base[i]) if i < nb else int(self.extra[i - nb])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"ExtendedTokens({list(self)!r})"


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    # Sequences of ints, or 1-D int64 CPU tensors (no conversion cost: keep one per request).
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated tokens before this position (incl. earlier drafts)
    eos_token_ids: tuple[int, ...] = ()  # model EOS ids: masked while len(output) < min_tokens
    generator: Randomness | None = None  # None → the shared default generator


def rows_for_request(
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    draft_token_ids: Sequence[int] = (),
    eos_token_ids: tuple[int, ...] = (),
    generator: Randomness | None = None,
) -> list[SamplingRow]:
    """The k + 1 rows of a request verifying k drafts (k = 0: the single decode/prefill row).

    Row j sees ``output + drafts[:j]`` as its history, exactly what the request's output would be if
    drafts 0..j-1 are accepted.
    """
    rows = [SamplingRow(params, prompt_token_ids, output_token_ids, eos_token_ids, generator)]
    drafts = [int(t) for t in draft_token_ids]
    for j in range(1, len(drafts) + 1):
        history = ExtendedTokens(output_token_ids, drafts[:j])
        rows.append(SamplingRow(params, prompt_token_ids, history, eos_token_ids, generator))
    return rows
