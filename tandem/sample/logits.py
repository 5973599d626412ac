"""Logits processing and the logits → probabilities transform, batched over sampling rows.

``process_logits`` edits raw logits per request (bias, bans, penalties); ``probs_from_logits`` turns
them into the distribution a token is drawn from (temperature, top-k, top-p, min-p). Both work on the
whole ``[num_rows, vocab]`` block with tensor ops; the only python work is a pass over the rows to
collect parameters and token ids, and rows with default parameters cost nothing.

The result of ``probs_from_logits`` is *the* target distribution p: the plain sampler draws from it
and the rejection sampler verifies drafts against it, which is what makes speculation lossless for
every sampling parameter (the drafts never bypass a filter or penalty).

Order inside ``process_logits`` (fixed, vLLM-compatible):
    logit_bias (add) → min_tokens (−inf on EOS + stop_token_ids while too short) →
    repetition_penalty (prompt ∪ output; logit > 0 → /p, else ·p) →
    frequency_penalty (−= f·count in output) → presence_penalty (−= p·[count > 0] in output)
Order inside ``probs_from_logits``:
    greedy rows → one-hot argmax; others: softmax(logits / T) → top-k → top-p (on the top-k
    renormalised distribution) → min-p (relative to the max) → renormalise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.errors import SamplingParamsError
from tandem.sample.rows import SamplingRow
from tandem.sampling_params import SamplingParams


def validate_for_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Raise SamplingParamsError if params name token ids the model does not have.

    Called by the engine at add_request time; ``process_logits`` itself silently skips such ids.
    """
    if params.logit_bias:
        bad = sorted(t for t in params.logit_bias if t >= vocab_size)
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
            raise SamplingParamsError(
                "logit_bias",
                f"token ids {shown} are outside the vocabulary; valid ids are 0..{vocab_size - 1}",
            )


def _check_rows(tensor: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if tensor.dim() != 2 or tensor.shape[0] != len(rows):
        raise ValueError(
            f"expected a [num_rows={len(rows)}, vocab] tensor, got shape {tuple(tensor.shape)}"
        )


def _token_index(
    row_positions: Sequence[int],
    seqs: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into (owner, token) index tensors, dropping ids outside [0, V)."""
    parts: list[torch.Tensor] = []
    owners: list[torch.Tensor] = []
    for pos, seq in zip(row_positions, seqs):
        t = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        if t.numel():
            parts.append(t)
            owners.append(torch.full((t.numel(),), pos, dtype=torch.long))
    if not parts:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty
    tok = torch.cat(parts)
    own = torch.cat(owners)
    valid = (tok >= 0) & (tok < vocab_size)
    if not bool(valid.all()):
        tok, own = tok[valid], own[valid]
    return own.to(device, non_blocking=True), tok.to(device, non_blocking=True)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Apply logit_bias, min_tokens, repetition/frequency/presence penalties.

    logits: [num_rows, vocab] float32 (raw model logits). Returns the input object itself when no row
    needs processing (callers must not edit it in place), otherwise a new tensor.
    """
    _check_rows(logits, rows)
    vocab = logits.shape[1]
    device = logits.device

    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    ban_r: list[int] = []
    ban_t: list[int] = []
    rep_rows: list[int] = []
    pen_rows: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            for tok, val in p.logit_bias.items():
                if tok < vocab:  # out-of-vocab ids are rejected earlier by validate_for_vocab
                    bias_r.append(i)
                    bias_t.append(tok)
                    bias_v.append(val)
        if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
            # vLLM masks EOS during min_tokens even with ignore_eos (harmless: EOS would not stop).
            for tok in set(row.eos_token_ids) | set(p.stop_token_ids):
                if 0 <= tok < vocab:
                    ban_r.append(i)
                    ban_t.append(tok)
        if p.repetition_penalty != 1.0:
            rep_rows.append(i)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            pen_rows.append(i)

    if not (bias_r or ban_r or rep_rows or pen_rows):
        return logits
    out = logits.clone()  # [num_rows, vocab]

    if bias_r:
        idx = (
            torch.tensor(bias_r, dtype=torch.long, device=device),
            torch.tensor(bias_t, dtype=torch.long, device=device),
        )
        out.index_put_(idx, torch.tensor(bias_v, dtype=out.dtype, device=device), accumulate=True)

    if ban_r:
        idx = (
            torch.tensor(ban_r, dtype=torch.long, device=device),
            torch.tensor(ban_t, dtype=torch.long, device=device),
        )
        out.index_put_(idx, torch.tensor(float("-inf"), dtype=out.dtype, device=device))

    if rep_rows:
        n = len(rep_rows)
        # Tokens seen in prompt ∪ output, one bool row per penalised row.
        seqs = [rows[i].prompt_token_ids for i in rep_rows] + [
            rows[i].output_token_ids for i in rep_rows
        ]
        own, tok = _token_index(list(range(n)) * 2, seqs, vocab, device)
        seen = torch.zeros((n, vocab), dtype=torch.bool, device=device)  # [n, vocab]
        seen[own, tok] = True
        penalty = torch.tensor(
            [rows[i].params.repetition_penalty for i in rep_rows], dtype=out.dtype, device=device
        )[:, None]
        ridx = torch.tensor(rep_rows, dtype=torch.long, device=device)
        sub = out.index_select(0, ridx)  # [n, vocab]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        out.index_copy_(0, ridx, torch.where(seen, penalised, sub))

    if pen_rows:
        n = len(pen_rows)
        own, tok = _token_index(
            list(range(n)), [rows[i].output_token_ids for i in pen_rows], vocab, device
        )
        counts = torch.zeros((n, vocab), dtype=out.dtype, device=device)  # [n, vocab]
        counts.index_put_((own, tok), torch.ones_like(tok, dtype=out.dtype), accumulate=True)
        freq = torch.tensor(
            [rows[i].params.frequency_penalty for i in pen_rows], dtype=out.dtype, device=device
        )[:, None]
        pres = torch.tensor(
            [rows[i].params.presence_penalty for i in pen_rows], dtype=out.dtype, device=device
        )[:, None]
        pidx = torch.tensor(pen_rows, dtype=torch.long, device=device)
        delta = freq * counts + pres * (counts > 0).to(out.dtype)
        out.index_copy_(0, pidx, out.index_select(0, pidx) - delta)

    return out


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax returns the first maximal index: ties go to the lowest token id.
    probs = torch.zeros_like(logits, dtype=torch.float32)
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _apply_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Zero tokens outside each row's top-k, then outside its nucleus (on the top-k renormalised
    distribution, as vLLM does). probs: [n, vocab]; top_k: [n] int (vocab = off); top_p: [n]."""
    vocab = probs.shape[1]
    # Stable sort: among equal probabilities the lower token id ranks first.
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [n, vocab]
    ranks = torch.arange(vocab, device=probs.device)
    if top_k is not None:
        keep = ranks[None, :] < top_k[:, None]
        sorted_p = sorted_p.masked_fill(~keep, 0.0)
    else:
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_p is not None:
        renorm = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
        # Mass strictly before each token; keep while it is < top_p → the smallest prefix whose
        # mass reaches top_p, never empty. Rows with top_p = 1 keep everything exactly.
        before = torch.cumsum(renorm, dim=-1) - renorm
        before[:, 0] = 0.0
        keep = keep & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    mask = torch.zeros_like(keep).scatter_(1, order, keep)
    return probs.masked_fill(~mask, 0.0)


def probs_from_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each row samples from: [num_rows, vocab] float32, rows sum to 1.

    Greedy rows (temperature 0) are one-hot at the argmax (lowest id on ties).
    """
    _check_rows(logits, rows)
    n, vocab = logits.shape
    device = logits.device
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        return _one_hot_argmax(logits)

    temps: list[float] = []
    ks: list[int] = []
    ps: list[float] = []
    min_ps: list[float] = []
    for r, g in zip(rows, greedy):
        p = r.params
        temps.append(1.0 if g else p.temperature)
        ks.append(p.top_k if (not g and 0 < p.top_k < vocab) else vocab)
        ps.append(1.0 if g else p.top_p)
        min_ps.append(0.0 if g else p.min_p)

    t = torch.tensor(temps, dtype=torch.float32, device=device)
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)  # [n, vocab]

    use_k = any(k < vocab for k in ks)
    use_p = any(p < 1.0 for p in ps)
    if use_k or use_p:
        probs = _apply_top_k_top_p(
            probs,
            torch.tensor(ks, dtype=torch.long, device=device) if use_k else None,
            torch.tensor(ps, dtype=torch.float32, device=device) if use_p else None,
        )
    if any(m > 0.0 for m in min_ps):
        m = torch.tensor(min_ps, dtype=torch.float32, device=device)
        threshold = m[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if use_k or use_p or any(m > 0.0 for m in min_ps):
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if any(greedy):
        g = torch.tensor(greedy, dtype=torch.bool, device=device)[:, None]
        probs = torch.where(g, _one_hot_argmax(logits), probs)
    return probs
