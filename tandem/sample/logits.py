"""Logits processing and the logits → probabilities transform, batched over sampling rows.

``process_logits`` edits raw logits per request (bias, bans, penalties); ``probs_from_logits``
turns them into the distribution a token is drawn from (temperature, top-k, top-p, min-p). Both work
on the whole ``[num_rows, vocab]`` block with tensor ops; the only python work is a pass over the
rows to collect parameters and token ids, and rows with default parameters cost nothing.

The result of ``probs_from_logits`` is *the* target distribution p: the plain sampler draws from it
and the rejection sampler verifies drafts against it, which is what makes speculation lossless for
every sampling parameter (the drafts never bypass a filter or penalty).

Order inside ``process_logits`` (fixed, vLLM-compatible):
    logit_bias (add) → min_tokens (−inf on EOS + stop_token_ids while too short) →
    repetition_penalty (prompt ∪ output; logit > 0 → /p, else ·p) →
    frequency_penalty (−= f·count in output) → presence_penalty (−= p·[count > 0] in output)
Order inside ``probs_from_logits``:
    greedy rows → one-hot argmax; others: softmax(logits / T) → top-k (ties at the k-th value kept)
    → top-p (on the top-k renormalised distribution) → min-p (relative to the max) → renormalise.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from tandem.errors import SamplingParamsError
from tandem.sample.rows import ExtendedTokens, SamplingRow
from tandem.sample.upload import upload
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


def _as_long(seq: Sequence[int], cache: dict[int, torch.Tensor]) -> torch.Tensor:
    """1-D int64 CPU tensor of a token sequence, converted once per object within a call."""
    hit = cache.get(id(seq))
    if hit is not None:
        return hit
    if type(seq) is not list and type(seq) is not tuple and isinstance(seq, torch.Tensor):
        t = seq.reshape(-1).to("cpu", torch.long)
    else:
        # array('q') is ~2x faster than torch.as_tensor on a python list of ints.
        t = torch.frombuffer(array("q", seq), dtype=torch.long) if len(seq) else _EMPTY
    cache[id(seq)] = t
    return t


_EMPTY = torch.empty(0, dtype=torch.long)


def _scatter_counts(
    counts: torch.Tensor,
    seqs: Sequence[Sequence[int]],
    owners: Sequence[int],
    cache: dict[int, torch.Tensor],
) -> None:
    """counts[owners[i], t] += 1 for every token t of seqs[i] (ids outside [0, V) dropped)."""
    parts = [_as_long(seq, cache) for seq in seqs]
    if not parts:
        return
    tok = torch.cat(parts)
    own = torch.repeat_interleave(
        torch.tensor(list(owners), dtype=torch.long),
        torch.tensor([t.numel() for t in parts], dtype=torch.long),
    )
    valid = (tok >= 0) & (tok < counts.shape[1])
    if not bool(valid.all()):
        tok, own = tok[valid], own[valid]
    device = counts.device
    own, tok = own.to(device, non_blocking=True), tok.to(device, non_blocking=True)
    one = torch.ones((), dtype=counts.dtype, device=device)
    counts.index_put_((own, tok), one, accumulate=True)


def _token_counts(
    seqs: Sequence[Sequence[int]], vocab: int, device: torch.device, cache: dict[int, torch.Tensor]
) -> torch.Tensor:
    """Per-row token counts [len(seqs), vocab] float32.

    Rows of one request share objects (the prompt; the output under ``ExtendedTokens``), so each
    distinct object is counted once and its row gathered; only the draft suffixes are per row. This
    keeps the index volume at O(tokens per request), not O(tokens × (k + 1)).
    """
    slot_of: dict[int, int] = {}
    shared: list[Sequence[int]] = []
    slots: list[int] = []
    extras: list[Sequence[int]] = []
    extra_rows: list[int] = []
    for r, seq in enumerate(seqs):
        base: Sequence[int] = seq
        if type(seq) is ExtendedTokens:
            base = seq.base
            if len(seq.extra):
                extras.append(seq.extra)
                extra_rows.append(r)
        slot = slot_of.get(id(base))
        if slot is None:
            slot = slot_of[id(base)] = len(shared)
            shared.append(base)
        slots.append(slot)
    unique = torch.zeros((len(shared), vocab), dtype=torch.float32, device=device)
    _scatter_counts(unique, shared, range(len(shared)), cache)
    if slots == list(range(len(shared))):
        counts = unique
    else:
        counts = unique.index_select(0, upload(slots, torch.long, device))
    _scatter_counts(counts, extras, extra_rows, cache)
    return counts  # [len(seqs), vocab]


def processes_logits(params: SamplingParams, num_outputs: int) -> bool:
    """Whether ``process_logits`` edits a row with these params after ``num_outputs`` generated tokens.

    ``process_logits`` skips every row for which this is False, so a caller may rely on it to use raw
    logits (asynchronous decode takes the argmax on the device without the host)."""
    return bool(params.logit_bias or (params.min_tokens and num_outputs < params.min_tokens)
                or params.structured_outputs is not None  # grammar mask: applied on the host (executor)
                or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Apply logit_bias, min_tokens, repetition/frequency/presence penalties.

    logits: [num_rows, vocab] (raw model logits). Returns the input object itself when no row needs
    processing (callers must not edit it in place), otherwise a new float32 tensor.
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
        if not processes_logits(p, len(row.output_token_ids)):
            continue
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
    out = logits.to(torch.float32, copy=True)  # [num_rows, vocab]
    cache: dict[int, torch.Tensor] = {}

    if bias_r:
        idx = (
            upload(bias_r, torch.long, device),
            upload(bias_t, torch.long, device),
        )
        out.index_put_(idx, upload(bias_v, out.dtype, device), accumulate=True)

    if ban_r:
        idx = (
            upload(ban_r, torch.long, device),
            upload(ban_t, torch.long, device),
        )
        out.index_put_(idx, torch.full((), float("-inf"), dtype=out.dtype, device=device))

    if rep_rows:
        # Tokens seen in prompt ∪ output, one row per penalised row: [n, vocab] bool.
        prompt = _token_counts([rows[i].prompt_token_ids for i in rep_rows], vocab, device, cache)
        output = _token_counts([rows[i].output_token_ids for i in rep_rows], vocab, device, cache)
        seen = (prompt > 0) | (output > 0)
        penalty = upload([rows[i].params.repetition_penalty for i in rep_rows], out.dtype, device)[:, None]
        ridx = upload(rep_rows, torch.long, device)
        sub = out.index_select(0, ridx)  # [n, vocab]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        out.index_copy_(0, ridx, torch.where(seen, penalised, sub))

    if pen_rows:
        counts = _token_counts([rows[i].output_token_ids for i in pen_rows], vocab, device, cache)
        freq = upload([rows[i].params.frequency_penalty for i in pen_rows], out.dtype, device)[:, None]
        pres = upload([rows[i].params.presence_penalty for i in pen_rows], out.dtype, device)[:, None]
        pidx = upload(pen_rows, torch.long, device)
        delta = freq * counts + pres * (counts > 0).to(out.dtype)
        out.index_copy_(0, pidx, out.index_select(0, pidx) - delta)

    return out


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax returns the first maximal index: ties go to the lowest token id.
    probs = torch.zeros_like(logits, dtype=torch.float32)
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _top_k_top_p_sorted(
    probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Zero tokens outside each row's top-k, then outside its nucleus computed on the top-k
    renormalised distribution (vLLM's order).

    probs: [n, vocab]; top_k: [n] (vocab = off); top_p: [n] (1 = off).
    """
    # Stable sort: among equal probabilities the lower token id ranks first.
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [n, vocab]
    if top_k is not None:
        # Threshold at the k-th largest value: ties at the boundary are all kept (HF/vLLM).
        kth = sorted_p.gather(1, (top_k - 1)[:, None])  # [n, 1]
        keep = sorted_p >= kth
        sorted_p = sorted_p.masked_fill(~keep, 0.0)
    else:
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_p is not None:
        # (without top-k the total is summed in vocabulary order: the same as ``_top_p_from_candidates``)
        total = sorted_p.sum(dim=-1, keepdim=True) if top_k is not None else probs.sum(dim=-1, keepdim=True)
        renorm = sorted_p / total
        # Mass strictly before each token; keep while it is < top_p → the smallest prefix whose
        # mass reaches top_p, never empty. Rows with top_p = 1 keep everything exactly.
        before = torch.cumsum(renorm, dim=-1) - renorm
        before[:, 0] = 0.0
        keep = keep & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    mask = torch.zeros_like(keep).scatter_(1, order, keep)
    return probs.masked_fill(~mask, 0.0)


NUCLEUS_CANDIDATES = 512  # tokens a CPU top-p filter looks at before it falls back to a full sort


def _top_p_from_candidates(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """CPU top-p (no top-k) from each row's ``NUCLEUS_CANDIDATES`` likeliest tokens, when every
    row's nucleus lies among them: a selection instead of a full sort of the vocabulary (a stable
    sort of 49k entries took ~3.9 ms on the 2-core CPU, docs/performance.md §33).

    The same keep set as ``_top_k_top_p_sorted``: the candidates in the full sort's order
    (probability descending, lower id first among equals), the same total (vocabulary order) and
    the same cumulative sums (CPU ``cumsum`` accumulates sequentially). Returns None — the caller
    sorts — when some row's nucleus reaches past the candidates, a group of equal probabilities
    straddles the cut, or the mass before the last candidate is within 1e-6 of top_p (where the
    rounding of later positions could matter).
    """
    n, vocab = probs.shape
    c = min(NUCLEUS_CANDIDATES, vocab - 1)
    if c < 2:
        return None
    vals, ids = probs.topk(c + 1, dim=-1)  # [n, c + 1], descending; equal values in any order
    by_id = ids.argsort(dim=-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    vals, perm = vals.sort(dim=-1, descending=True, stable=True)  # equal values: lower id first
    ids = ids.gather(1, perm)
    renorm = vals[:, :c] / probs.sum(dim=-1, keepdim=True)
    before = torch.cumsum(renorm, dim=-1) - renorm
    before[:, 0] = 0.0
    fits = (vals[:, c - 1] > vals[:, c]) & (before[:, c - 1] >= top_p + 1e-6)
    if not bool(fits.all()):
        return None
    mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids[:, :c], before < top_p[:, None])
    return probs.masked_fill(~mask, 0.0)


def _top_k_only(probs: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """top-k without a full sort: threshold at each row's k-th largest value (ties kept)."""
    values = probs.topk(k_max, dim=-1).values  # [n, k_max], descending
    kth = values.gather(1, (top_k - 1)[:, None])  # [n, 1]
    return probs.masked_fill(probs < kth, 0.0)


def _apply_top_k_top_p(probs: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Filter only the rows that ask for it; full sort only when some row uses top-p (on CPU, only
    when a nucleus does not fit among ``NUCLEUS_CANDIDATES`` tokens)."""
    vocab = probs.shape[1]
    device = probs.device
    need = [i for i, (k, p) in enumerate(zip(ks, ps)) if k < vocab or p < 1.0]
    if not need:
        return probs
    everything = len(need) == len(ks)
    idx = upload(need, torch.long, device)
    sub = probs if everything else probs.index_select(0, idx)  # [len(need), vocab]
    sub_k = [ks[i] for i in need]
    sub_p = [ps[i] for i in need]
    top_k = upload(sub_k, torch.long, device)
    if all(p >= 1.0 for p in sub_p):
        filtered = _top_k_only(sub, top_k, max(sub_k))
    else:
        use_k = any(k < vocab for k in sub_k)
        top_p = upload(sub_p, torch.float32, device)
        quick = _top_p_from_candidates(sub, top_p) if not use_k and device.type == "cpu" else None
        filtered = quick if quick is not None else _top_k_top_p_sorted(sub, top_k if use_k else None, top_p)
    return filtered if everything else probs.index_copy(0, idx, filtered)


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

    scaled = logits.float()
    if any(t != 1.0 for t in temps):  # (x / 1 is x: the OpenAI default costs no launch)
        scaled = scaled / upload(temps, torch.float32, device)[:, None]
    probs = torch.softmax(scaled, dim=-1)  # [n, vocab]

    filtered = False
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        probs = _apply_top_k_top_p(probs, ks, ps)
        filtered = True
    if any(m > 0.0 for m in min_ps):
        m = upload(min_ps, torch.float32, device)
        threshold = m[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        filtered = True
    if filtered:
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if any(greedy):
        g = upload(greedy, torch.bool, device)[:, None]
        probs = torch.where(g, _one_hot_argmax(logits), probs)
    return probs
