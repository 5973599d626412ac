"""Draw one token per row from ``probs_from_logits`` output, without a host sync.

Random rows use the exponential race: if E_v ~ Exp(1) i.i.d., then argmax_v p_v / E_v is distributed
as p (it is the first arrival among independent exponential clocks of rates p_v). It needs no
cumulative sum, no division by the total and no ``multinomial``, so it stays on the device and works
on unnormalised rows too.

Reproducibility: the noise of a seeded request's row is drawn from a generator seeded for that row's
output position (``seeded.SeededStream``), so a seeded request gets the same token for the same
probabilities whatever else is in the batch and whatever earlier steps drew. Rows without a seed
share the default generator in one draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sample.rows import SamplingRow
from tandem.sample.seeded import NOISE, Randomness, SeededStream, keyed_generator
from tandem.sample.upload import upload

_TINY = torch.finfo(torch.float32).tiny


def group_by_generator(
    generators: Sequence[torch.Generator],
) -> list[tuple[torch.Generator, list[int]]]:
    """Positions of each distinct generator (by identity), in order of first appearance."""
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for pos, gen in enumerate(generators):
        entry = groups.get(id(gen))
        if entry is None:
            groups[id(gen)] = (gen, [pos])
        else:
            entry[1].append(pos)
    return list(groups.values())


def draw_exponential(
    num_rows: int, vocab: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab] i.i.d. Exp(1) from ``generator`` (drawn on the generator's device)."""
    noise = torch.empty((num_rows, vocab), dtype=torch.float32, device=generator.device)
    noise.exponential_(generator=generator)
    # Exp(1) may round to 0 on some backends; p / 0 would be inf (or NaN for p = 0) and win.
    return noise.clamp_min_(_TINY).to(device, non_blocking=True)


def draw_uniform(num: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[num] i.i.d. U[0, 1) from ``generator``."""
    u = torch.rand(num, dtype=torch.float32, device=generator.device, generator=generator)
    return u.to(device, non_blocking=True)


@dataclass(frozen=True)
class Noise:
    """What one draw is: a row of ``width`` Exp(1) values (the race; width = vocabulary) or one
    U[0, 1) value (an acceptance test)."""

    width: int
    exponential: bool

    def from_generator(self, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """n draws from a running stream: [n, width] (exponential) or [n]."""
        if self.exponential:
            return draw_exponential(n, self.width, generator, device)
        return draw_uniform(n, generator, device)

    def from_keys(self, keys: Sequence[int], device: torch.device) -> torch.Tensor:
        """One draw per 63-bit key (a seeded row: ``SeededStream.key``), each a function of its key
        alone. On CUDA one Triton launch for all of them (``worker/triton_noise.py``: Philox keyed
        per row); elsewhere a generator reseeded per key."""
        if torch.device(device).type == "cuda":
            from tandem.worker.triton_noise import keyed_noise

            rows = keyed_noise(upload(keys, torch.int64, device), self.width if self.exponential else 1,
                               self.exponential)
            return rows if self.exponential else rows[:, 0]
        return torch.cat([self.from_generator(1, keyed_generator(k, device), device) for k in keys])


def draw_rows(
    sources: Sequence[Randomness],
    counts: Sequence[int],
    noise: Noise,
    device: torch.device,
    positions: Sequence[int] | None = None,
    purpose: int = NOISE,
) -> torch.Tensor | None:
    """Stack counts[i] draws of ``noise`` per item i, in item order.

    Items sharing one ``torch.Generator`` (by identity) get one draw of their rows in order; a
    generator used by a single item gives the same values whatever the other items are. A
    ``SeededStream`` item draws its row j by the key of (positions[i] + j, ``purpose``): the same
    values whatever was drawn before and whatever else is in the step (all seeded rows of a call in
    one ``Noise.from_keys``). Returns None when nothing is drawn.
    """
    total = sum(counts)
    if total == 0:
        return None
    if not any(isinstance(s, SeededStream) for s in sources):
        groups = group_by_generator(sources)  # type: ignore[arg-type]
        if len(groups) == 1:
            return noise.from_generator(total, groups[0][0], device)
    elif positions is None:
        raise ValueError("seeded items need their output positions")
    starts: list[int] = []
    acc = 0
    for n in counts:
        starts.append(acc)
        acc += n
    draws: list[torch.Tensor] = []
    order: list[int] = []
    streams = [(i, s) for i, s in enumerate(sources) if not isinstance(s, SeededStream)]
    for gen, items in group_by_generator([s for _, s in streams]):  # type: ignore[misc]
        rows = [starts[streams[i][0]] + j for i in items for j in range(counts[streams[i][0]])]
        if rows:
            draws.append(noise.from_generator(len(rows), gen, device))
            order.extend(rows)
    keys: list[int] = []
    for i, s in enumerate(sources):
        if isinstance(s, SeededStream):
            assert positions is not None
            keys.extend(s.key(positions[i] + j, purpose) for j in range(counts[i]))
            order.extend(range(starts[i], starts[i] + counts[i]))
    if keys:
        draws.append(noise.from_keys(keys, device))
    stacked = torch.cat(draws)
    if order == list(range(total)):
        return stacked
    out = torch.empty_like(stacked)
    return out.index_copy_(0, upload(order, torch.long, device), stacked)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row: a sample from each row of probs (normalised or not)."""
    return (probs / noise).argmax(dim=-1)


def sample(
    probs: torch.Tensor, rows: Sequence[SamplingRow], default_generator: torch.Generator,
    purpose: int = NOISE, positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """One token per row: [num_rows] int64 on probs' device, queued without a host sync.

    probs: [num_rows, vocab] from ``probs_from_logits``. Greedy rows take the argmax and consume no
    randomness; random rows race against Exp(1) noise from ``row.generator or default_generator``
    (a seeded row: its stream at its output position for ``purpose``: ``positions[i]`` when given —
    asynchronous decode, whose rows' outputs end in tokens the host has not read — else
    ``len(row.output_token_ids)``).
    """
    if probs.dim() != 2 or probs.shape[0] != len(rows):
        raise ValueError(
            f"expected probs of shape [num_rows={len(rows)}, vocab], got {tuple(probs.shape)}"
        )
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        return probs.argmax(dim=-1)  # [num_rows]
    vocab = probs.shape[1]
    device = probs.device
    gens = [
        g if (g := rows[i].generator) is not None else default_generator for i in random_rows
    ]
    noise = draw_rows(
        gens, [1] * len(gens), Noise(vocab, exponential=True), device,
        [positions[i] if positions is not None else len(rows[i].output_token_ids) for i in random_rows], purpose,
    )  # [n_random, vocab]
    assert noise is not None  # len(gens) > 0
    if len(random_rows) == len(rows):
        return exponential_race(probs.float(), noise)
    ridx = upload(random_rows, torch.long, device)
    tokens = exponential_race(probs.index_select(0, ridx).float(), noise)
    return probs.argmax(dim=-1).index_copy_(0, ridx, tokens)
