"""Draw one token per row from ``probs_from_logits`` output, without a host sync.

Random rows are sampled by inverse CDF: one uniform u per row, the token is the first whose
cumulative weight exceeds u · (total weight) — ``cumsum`` and ``searchsorted``, on the device and
on unnormalised rows too (a recovered residual). One uniform per row, not a row of noise per
vocabulary entry: on the 2-core CPU an Exp(1) row over a 49k vocabulary cost ~1 ms, the inverse
CDF ~0.06 ms (docs/performance.md §33).

Uniforms are float32 in [0, 1), so at most 1 − 2**-24 (the largest float32 below 1), and u · total <
total in float32 (a product a hair below a float rounds down to the float below it): the search never
runs off the end. A zero-weight token has an empty interval when the cumulative sum is sequential (CPU); a
parallel scan (CUDA) may round it to a sliver, so a pick of weight 0 falls back to the row's argmax
(a probability of the order of 2**-24 · its mass, and never a token the row forbids).

Reproducibility: a seeded request's uniform at an output position is a function of (seed, position,
purpose) computed on the host (``seeded.SeededStream.uniform``), so a seeded request gets the same
token for the same probabilities whatever else is in the batch, whatever earlier steps drew, and on
any device. Rows without a seed share the default generator in one draw.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.sample.rows import SamplingRow
from tandem.sample.seeded import NOISE, Randomness, SeededStream
from tandem.sample.upload import upload


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


def draw_uniform(num: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[num] i.i.d. float32 U[0, 1) from ``generator``."""
    u = torch.rand(num, dtype=torch.float32, device=generator.device, generator=generator)
    return u.to(device, non_blocking=True)


def draw_rows(
    sources: Sequence[Randomness],
    counts: Sequence[int],
    device: torch.device,
    positions: Sequence[int] | None = None,
    purpose: int = NOISE,
) -> torch.Tensor | None:
    """counts[i] uniforms per item i, stacked in item order: [Σ counts] float32 in [0, 1).

    Items sharing one ``torch.Generator`` (by identity) get one draw covering their rows in order; a
    generator used by a single item gives the same values whatever the other items are. A
    ``SeededStream`` item's value j is its uniform at (positions[i] + j, ``purpose``), computed on
    the host: the same whatever was drawn before and whatever else is in the step. Returns None when
    nothing is drawn.
    """
    total = sum(counts)
    if total == 0:
        return None
    if not any(isinstance(s, SeededStream) for s in sources):
        groups = group_by_generator(sources)  # type: ignore[arg-type]
        if len(groups) == 1:
            return draw_uniform(total, groups[0][0], device)
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
            draws.append(draw_uniform(len(rows), gen, device))
            order.extend(rows)
    keyed: list[float] = []
    for i, s in enumerate(sources):
        if isinstance(s, SeededStream):
            assert positions is not None
            keyed.extend(s.uniform(positions[i] + j, purpose) for j in range(counts[i]))
            order.extend(range(starts[i], starts[i] + counts[i]))
    if keyed:
        draws.append(upload(keyed, torch.float32, device))
    stacked = torch.cat(draws) if len(draws) > 1 else draws[0]
    if order == list(range(total)):
        return stacked
    out = torch.empty_like(stacked)
    return out.index_copy_(0, upload(order, torch.long, device), stacked)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of nonnegative ``weights`` [n, vocab] (normalised or not), drawn with the
    row's uniform ``u`` [n] (from ``draw_rows``): the first token whose cumulative weight exceeds
    u · total. A row's token has weight > 0 (see the module docstring)."""
    w = weights.float()
    cdf = w.cumsum(dim=-1)  # [n, vocab]
    x = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=w.shape[1] - 1)
    picked = w.gather(1, idx[:, None]).squeeze(1)
    return torch.where(picked > 0, idx, w.argmax(dim=-1))


def sample(
    probs: torch.Tensor, rows: Sequence[SamplingRow], default_generator: torch.Generator,
    purpose: int = NOISE, positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """One token per row: [num_rows] int64 on probs' device, queued without a host sync.

    probs: [num_rows, vocab] from ``probs_from_logits``. Greedy rows take the argmax and consume no
    randomness; random rows are drawn by inverse CDF with a uniform from ``row.generator or
    default_generator`` (a seeded row: its uniform at its output position for ``purpose``:
    ``positions[i]`` when given — asynchronous decode, whose rows' outputs end in tokens the host
    has not read — else ``len(row.output_token_ids)``).
    """
    if probs.dim() != 2 or probs.shape[0] != len(rows):
        raise ValueError(
            f"expected probs of shape [num_rows={len(rows)}, vocab], got {tuple(probs.shape)}"
        )
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        return probs.argmax(dim=-1)  # [num_rows]
    device = probs.device
    gens = [
        g if (g := rows[i].generator) is not None else default_generator for i in random_rows
    ]
    u = draw_rows(
        gens, [1] * len(gens), device,
        [positions[i] if positions is not None else len(rows[i].output_token_ids) for i in random_rows], purpose,
    )  # [n_random]
    assert u is not None  # len(gens) > 0
    if len(random_rows) == len(rows):
        return inverse_cdf(probs, u)
    ridx = upload(random_rows, torch.long, device)
    tokens = inverse_cdf(probs.index_select(0, ridx), u)
    return probs.argmax(dim=-1).index_copy_(0, ridx, tokens)
