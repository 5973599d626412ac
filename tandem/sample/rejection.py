"""Speculative rejection sampling: verify draft tokens so that the output is the target's.

Glossary (see docs/architecture.md):
- **draft tokens** d_0..d_{k-1}: proposed by a cheap proposer (draft model, EAGLE, n-gram, suffix).
  q_j is the distribution d_j was drawn from; proposers without probabilities (n-gram, suffix,
  greedy drafts) act as a one-hot q_j at d_j (``draft_probs=None``).
- **target distribution** p_j: ``probs_from_logits`` of the target's row j, i.e. after the draft
  tokens d_0..d_{j-1}, with every sampling parameter applied. A request verifying k drafts has k + 1
  contiguous rows; row k follows the last draft.
- **accepted tokens**: d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); verification
  stops at the first rejection.
- **recovered token**: emitted at the first rejection j, sampled from norm(max(p_j − q_j, 0)) (for a
  one-hot q: p_j with d_j removed, renormalised). This correction is what makes the emitted token
  distributed exactly as p_j: P(emit x) = min(p(x), q(x)) + (1 − Σ min(p, q)) · residual(x) = p(x).
- **bonus token**: when all k drafts are accepted, one more token is sampled from p_k for free.
- Every verify step therefore emits num_accepted + 1 tokens (k = 0 is plain sampling of one token).
- **greedy** requests: accept while d_j == argmax p_j; the first mismatch emits argmax p_j; if all
  are accepted the bonus is argmax p_k. No randomness is consumed.
- τ = mean tokens emitted per verify step = 1 + accepted / verify steps; per-position acceptance
  rate = accepted at position i / drafts reaching position i (see ``spec_decode/cost_model.py``).

Deterministic drafts (one-hot q) are verified by coupling: row j samples x_j from p_j as plain
sampling would (inverse CDF with the row's uniform, ``sampler.inverse_cdf``); d_j is accepted iff
x_j == d_j, and the first x_j != d_j is the emitted token. P(accept) = p_j(d_j) and a rejected x_j is distributed as p_j without d_j, so this is
the rejection rule above; and the emitted token at every position is the plain sample there.

Randomness and reproducibility: per request, from its randomness (``generators``), we draw k
uniforms (probabilistic drafts and benchmark mode only) then k + 1 sampling uniforms (one per row),
always the same amount whatever gets accepted. Requests sharing one generator object (the engine's
default) are drawn together. A seeded request (``seeded.SeededStream``) draws each row from its
stream at that row's output position (``positions``), so with deterministic drafts its output is
exactly its output without speculation, token for token, whatever k each step used. A k = 0 request
consumes exactly what ``sampler.sample`` would (one uniform), so it yields the same token.

Vectorisation: p_j(d_j), q_j(d_j), the accept test, the residual of every draft row and the draw of
every row are computed for the whole batch at once; the only host sync is the final transfer of the
accept flags and candidate tokens, after which the python bookkeeping per request is O(k).

Benchmark mode (``synthetic_acceptance_rate``): each draft position is accepted independently with
that probability and the recovered token is sampled from p_j (greedy: argmax p_j). This forces a
chosen acceptance profile to measure engine cost; its output is NOT the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sample.argmax import greedy_ids
from tandem.sample.sampler import draw_rows, inverse_cdf
from tandem.sample.seeded import NOISE, UNIFORM, Randomness
from tandem.sample.upload import upload


@dataclass(frozen=True)
class RejectionOutput:
    # per request: the accepted drafts, then exactly one recovered or bonus token
    token_ids: list[list[int]]
    num_accepted: list[int]  # per request, 0..k_i


def _recover(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Recovery distribution norm(max(p − q, 0)) for probabilistic draft rows: [M, V].

    target_probs: [M, V] p_j; draft_probs: [M, V] q_j. Where the residual is all zero (p ≤ q
    everywhere: rejection had probability 0) fall back to p.
    Module-level on purpose: tests swap it to show that a wrong recovery is detected.
    """
    residual = (target_probs - draft_probs).clamp_min_(0.0)
    total = residual.sum(dim=-1, keepdim=True)  # [M, 1]
    return torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs)


def greedy_verify(logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]]) -> RejectionOutput:
    """``rejection_sample`` for requests that are all greedy, straight from (processed) logits.

    With one-hot target distributions the rejection rule reduces to: accept drafts while they equal
    the target's argmax; then emit the argmax at the first mismatch (the recovery) or after the last
    draft (the bonus). Same tokens as ``rejection_sample`` (argmax ties go to the lowest token id in
    both), without building probability rows: one argmax and one host read per step.
    logits: [Σ(k_i + 1), V], rows of request i contiguous, in request order.
    """
    rows = sum(len(d) + 1 for d in draft_token_ids)
    if logits.dim() != 2 or logits.shape[0] != rows:
        raise ValueError(f"logits must be [sum(k_i + 1)={rows}, vocab], got {tuple(logits.shape)}")
    return accept_matching(greedy_ids(logits).tolist(), draft_token_ids)


def accept_matching(row_tokens: Sequence[int], draft_token_ids: Sequence[Sequence[int]]) -> RejectionOutput:
    """Verification of deterministic drafts from each row's own token (the argmax for greedy rows,
    the plain sample for random ones: the coupling above): d_j is accepted while it equals row j's
    token, and the first row that differs — or the row after the last draft — gives the emitted
    token. ``row_tokens``: Σ(k_i + 1) tokens, rows of request i contiguous, in request order."""
    tokens: list[list[int]] = []
    accepted: list[int] = []
    r = 0
    for d in draft_token_ids:
        k = len(d)
        a = 0
        while a < k and row_tokens[r + a] == int(d[a]):
            a += 1
        tokens.append([int(t) for t in d[:a]] + [int(row_tokens[r + a])])
        accepted.append(a)
        r += k + 1
    return RejectionOutput(tokens, accepted)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    rows_greedy: Sequence[bool],
    generators: Sequence[Randomness],
    synthetic_acceptance_rate: float | None = None,
    positions: Sequence[int] | None = None,
) -> RejectionOutput:
    """Verify each request's drafts; emit accepted drafts + one recovered or bonus token.

    target_probs: [Σ(k_i + 1), V] rows of request i contiguous, in request order.
    draft_token_ids: per request, k_i ≥ 0 tokens. draft_probs: [Σ k_i, V] q at each draft position,
    or None for deterministic drafts (one-hot q). rows_greedy, generators: per request.
    positions: per request, the output position of its first row (needed for seeded requests).
    """
    num_req = len(draft_token_ids)
    if len(rows_greedy) != num_req or len(generators) != num_req:
        raise ValueError(
            f"rows_greedy ({len(rows_greedy)}) and generators ({len(generators)}) must have one "
            f"entry per request ({num_req})"
        )
    ks = [len(d) for d in draft_token_ids]
    total_drafts = sum(ks)
    total_rows = total_drafts + num_req
    if target_probs.dim() != 2 or target_probs.shape[0] != total_rows:
        raise ValueError(
            f"target_probs must be [sum(k_i + 1)={total_rows}, vocab], "
            f"got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, vocab):
        raise ValueError(
            f"draft_probs must be [sum(k_i)={total_drafts}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )
    rate = synthetic_acceptance_rate
    if rate is not None and not 0.0 <= rate <= 1.0:
        raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], got {rate}")
    if num_req == 0:
        return RejectionOutput([], [])
    flat_drafts = [int(t) for d in draft_token_ids for t in d]
    if flat_drafts and not (0 <= min(flat_drafts) and max(flat_drafts) < vocab):
        bad = sorted({t for t in flat_drafts if not 0 <= t < vocab})
        raise ValueError(f"draft token ids must be in [0, {vocab}), got {bad[:10]}")

    device = target_probs.device
    p = target_probs.float()  # [R, V], R = total_rows

    # Row layout. row_start[i]: first target row of request i; draft_start[i]: its first draft.
    row_start: list[int] = []
    draft_start: list[int] = []
    r = d = 0
    for k in ks:
        row_start.append(r)
        draft_start.append(d)
        r += k + 1
        d += k
    draft_rows = [row_start[i] + j for i, k in enumerate(ks) for j in range(k)]
    draft_greedy = [rows_greedy[i] for i, k in enumerate(ks) for _ in range(k)]
    random_req = [i for i in range(num_req) if not rows_greedy[i]]

    target_argmax = p.argmax(dim=-1)  # [R]: greedy choice at every row
    tokens = target_argmax.clone()  # [R]: candidate emitted token at every row

    # --- randomness: per generator, uniforms (acceptance) then one sampling uniform per row ---
    # Counts depend only on k_i and the request's mode, never on what gets accepted.
    coupled = rate is None and draft_probs is None  # one-hot drafts: accept iff the plain sample agrees
    u_counts = [k if (rate is not None or (not rows_greedy[i] and not coupled)) else 0 for i, k in enumerate(ks)]
    uniforms = draw_rows(generators, u_counts, device, positions, UNIFORM)
    if uniforms is None or sum(u_counts) != total_drafts:
        # Greedy and coupled requests (without synthetic mode) draw nothing; their slots are never read.
        full = torch.zeros(total_drafts, dtype=torch.float32, device=device)  # [D]
        if uniforms is not None:
            slots = [draft_start[i] + j for i, c in enumerate(u_counts) for j in range(c)]
            full.index_copy_(0, upload(slots, torch.long, device), uniforms)
        uniforms = full
    # A sampling uniform for every row of random requests, stacked in request order: [Σ_{random i}(k_i + 1)].
    rand_rows = [row_start[i] + j for i in random_req for j in range(ks[i] + 1)]
    rand_pos: dict[int, int] = {}  # request → offset of its rows in rand_rows
    off = 0
    for i in random_req:
        rand_pos[i] = off
        off += ks[i] + 1
    draws = draw_rows(
        [generators[i] for i in random_req],
        [ks[i] + 1 for i in random_req],
        device,
        None if positions is None else [positions[i] for i in random_req],
        NOISE,
    )

    # --- candidate recovered/bonus token at every row of random requests ---
    dtok = upload(flat_drafts, torch.long, device)  # [D]
    if rand_rows:
        assert draws is not None
        ridx = upload(rand_rows, torch.long, device)
        dist = p.index_select(0, ridx)  # [n_rand, V]; bonus rows (and coupled rows) sample p_j as is
        if rate is None and not coupled:
            # Positions (within rand_rows) and indices (within drafts) of random requests' drafts.
            sub_pos = [rand_pos[i] + j for i in random_req for j in range(ks[i])]
            if sub_pos:
                sub_draft = [draft_start[i] + j for i in random_req for j in range(ks[i])]
                sidx = upload(sub_pos, torch.long, device)
                didx = upload(sub_draft, torch.long, device)
                assert draft_probs is not None
                q_sub = draft_probs.float().index_select(0, didx)
                recovered = _recover(dist.index_select(0, sidx), q_sub)
                dist.index_copy_(0, sidx, recovered)
        tokens.index_copy_(0, ridx, inverse_cdf(dist, draws))

    # --- acceptance at every draft position ---
    if total_drafts:
        drows = upload(draft_rows, torch.long, device)  # [D]
        if rate is not None:
            accept = uniforms < rate
        else:
            # greedy rule; coupled random rows: the plain sample (tokens) at row j equals d_j
            accept = dtok == (tokens if coupled else target_argmax).index_select(0, drows)
            if random_req and not coupled:
                assert draft_probs is not None
                p_d = p[drows, dtok]  # [D] p_j(d_j)
                q_d = draft_probs.float()[torch.arange(total_drafts, device=device), dtok]
                # u < p/q without dividing: also right when q_d = 0 (accept) or p_d = 0 (reject)
                random_accept = uniforms * q_d < p_d
                is_greedy = upload(draft_greedy, torch.bool, device)
                accept = torch.where(is_greedy, accept, random_accept)
    else:
        accept = torch.zeros(0, dtype=torch.bool, device=device)

    # --- one host transfer, then O(k) bookkeeping per request ---
    flat = torch.cat([accept.long(), tokens]).tolist()
    acc, toks = flat[:total_drafts], flat[total_drafts:]
    out_tokens: list[list[int]] = []
    out_accepted: list[int] = []
    for i, k in enumerate(ks):
        ds = draft_start[i]
        n = 0
        while n < k and acc[ds + n]:
            n += 1
        drafts = [int(t) for t in draft_token_ids[i][:n]]
        out_tokens.append(drafts + [toks[row_start[i] + n]])
        out_accepted.append(n)
    return RejectionOutput(out_tokens, out_accepted)
