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

from collections.abc import Callable, Sequence

import torch

from tandem.sample.rows import SamplingRow
from tandem.sample.seeded import NOISE, Randomness, SeededStream

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


def draw_rows(
    sources: Sequence[Randomness],
    counts: Sequence[int],
    draw: Callable[[int, torch.Generator], torch.Tensor],
    device: torch.device,
    positions: Sequence[int] | None = None,
    purpose: int = NOISE,
) -> torch.Tensor | None:
    """Stack counts[i] draws (rows of ``draw``) per item i, in item order.

    Items sharing one ``torch.Generator`` (by identity) get one ``draw(n, generator)`` call covering
    their rows in order; a generator used by a single item gives the same values whatever the other
    items are. A ``SeededStream`` item draws its row j from the generator of (positions[i] + j,
    ``purpose``): the same values whatever was drawn before. Returns None when nothing is drawn.
    """
    total = sum(counts)
    if total == 0:
        return None
    if not any(isinstance(s, SeededStream) for s in sources):
        groups = group_by_generator(sources)  # type: ignore[arg-type]
        if len(groups) == 1:
            return draw(total, groups[0][0])
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
            draws.append(draw(len(rows), gen))
            order.extend(rows)
    for i, s in enumerate(sources):
        if isinstance(s, SeededStream):
            assert positions is not None
            for j in range(counts[i]):
                draws.append(draw(1, s.generator(positions[i] + j, purpose, device)))
                order.append(starts[i] + j)
    stacked = torch.cat(draws)
    out = torch.empty_like(stacked)
    return out.index_copy_(0, torch.tensor(order, dtype=torch.long, device=device), stacked)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row: a sample from each row of probs (normalised or not)."""
    return (probs / noise).argmax(dim=-1)


def sample(
    probs: torch.Tensor, rows: Sequence[SamplingRow], default_generator: torch.Generator,
    purpose: int = NOISE,
) -> torch.Tensor:
    """One token per row: [num_rows] int64 on probs' device.

    probs: [num_rows, vocab] from ``probs_from_logits``. Greedy rows take the argmax and consume no
    randomness; random rows race against Exp(1) noise from ``row.generator or default_generator``
    (a seeded row: its stream at position ``len(row.output_token_ids)`` for ``purpose``).
    """
    if probs.dim() != 2 or probs.shape[0] != len(rows):
        raise ValueError(
            f"expected probs of shape [num_rows={len(rows)}, vocab], got {tuple(probs.shape)}"
        )
    out = probs.argmax(dim=-1)  # [num_rows]
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        return out
    vocab = probs.shape[1]
    device = probs.device
    gens = [
        g if (g := rows[i].generator) is not None else default_generator for i in random_rows
    ]
    noise = draw_rows(
        gens, [1] * len(gens), lambda n, g: draw_exponential(n, vocab, g, device), device,
        [len(rows[i].output_token_ids) for i in random_rows], purpose,
    )  # [n_random, vocab]
    assert noise is not None  # len(gens) > 0
    ridx = torch.tensor(random_rows, dtype=torch.long, device=device)
    tokens = exponential_race(probs.index_select(0, ridx).float(), noise)
    return out.index_copy_(0, ridx, tokens)
