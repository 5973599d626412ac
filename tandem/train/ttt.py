"""The training-time-test unroll: ``steps`` head steps over a batch, losses and greedy agreement.

Alignment (as inference, ``spec_decode/eagle.py``): head row ``t`` at step ``j`` reads the token
``x[t+1+j]`` (teacher forcing), sits at RoPE position ``t + j`` and predicts ``x[t+2+j]``, whose
target distribution is the target's next-token distribution at position ``t+1+j``. Step 0's hidden
input is ``fuse(features)`` (EAGLE-3) or the target's final hidden state (EAGLE-1); step ``j``'s is
the feedback of step ``j-1`` (never reset). Attention: ``attention.ttt_attention``.

Rows that count at step ``j`` are those whose predicted token is a generated (assistant) token
(``prompt_len - 1 <= t+1+j <= len - 2``). Training also drops rows whose target argmax is outside
the draft vocabulary. Loss at step ``j``: soft cross-entropy of the head's log-softmax against the
target's softmax over the draft columns (renormalised; EAGLE-1: the full vocabulary), averaged over
the counted rows, weighted ``decay ** j``. Only counted rows reach the lm_head, in chunks under
activation checkpointing (the ``[rows, vocab]`` logits are recomputed in backward, never stored).
Agreement (validation): the head's argmax, mapped to target ids, equals the target's argmax; also
counted for the head's top ``TOP_WIDTHS`` candidates (the target's argmax among them: what a draft
tree that branches that wide at this step could accept, teacher-forced).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from tandem.models.eagle import EagleHead
from tandem.train.attention import ttt_attention
from tandem.train.batches import Batch
from tandem.train.target import FrozenTarget, TargetOutput
from tandem.worker.attention import split_qkv

# Elements of one [rows, vocab] logits chunk in the loss.
LOSS_CHUNK_ELEMENTS = 1 << 26
# Widths at which validation also counts the target's argmax among the head's top candidates.
TOP_WIDTHS = (2, 4)


@dataclass
class UnrollResult:
    loss: torch.Tensor  # scalar: Σ_j decay^j · loss_j (0 when nothing counted)
    step_losses: list[torch.Tensor]  # detached, per step
    correct: list[torch.Tensor]  # per step: rows where head argmax == target argmax (eval rows)
    counted: list[torch.Tensor]  # per step: eval rows
    # per step: [len(TOP_WIDTHS)] rows whose target argmax is among the head's top-w (eval rows)
    correct_top: list[torch.Tensor] = field(default_factory=list)


def shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """``out[:, t] = x[:, t + s]`` (zeros past the end) for a [B, L, ...] tensor."""
    if s == 0:
        return x
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - s] = x[:, s:]
    return out


def loss_positions(batch: Batch) -> torch.Tensor:
    """[B, L] bool: the target's prediction at position ``p`` is a generated token."""
    p = torch.arange(batch.shape[1], device=batch.ids.device)[None, :]
    return (p >= batch.prompt_lens[:, None] - 1) & (p <= batch.lengths[:, None] - 2)


def _chunk_loss(head: EagleHead, target: FrozenTarget, columns: torch.Tensor | None, out: torch.Tensor,
                tgt_hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logq = torch.log_softmax(head.logits(out), dim=-1)
    with torch.no_grad():
        p = torch.softmax(target.logits(tgt_hidden, columns), dim=-1)
    ce = -(p * logq).sum(-1)
    return (ce * weight).sum(), logq.detach().topk(max(TOP_WIDTHS), dim=-1).indices


def head_steps(head: EagleHead, features: torch.Tensor, ids: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    """The head's pre-norm output [B·L, H] at each unroll step over the [B, L] grid ``ids``."""
    b, n = ids.shape
    rows = b * n
    attn = head.self_attn
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    positions = torch.arange(n, device=ids.device).repeat(b)
    hidden = head.fuse(features) if head.cfg.kind == "eagle3" else features
    k0 = v0 = None
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for j in range(steps):
        tok = shift(ids, 1 + j).reshape(rows)
        qkv, residual = head.qkv(head.embed(tok), hidden)
        q, k, v = split_qkv(attn, qkv, positions + j)
        q, k, v = q.view(b, n, h, d), k.view(b, n, kvh, d), v.view(b, n, kvh, d)
        if k0 is None:
            k0, v0 = k, v
        else:
            ks.append(k)
            vs.append(v)
        o = ttt_attention(q, k0, v0, ks, vs, attn.scale).reshape(rows, h * d)
        out = head.finish(o, residual)
        yield out
        hidden = head.feedback(out)


def unroll(head: EagleHead, target: FrozenTarget, tout: TargetOutput, batch: Batch, t2d: torch.Tensor | None,
           columns: torch.Tensor | None, steps: int, decay: float, grad: bool) -> UnrollResult:
    """``t2d``/``columns``: the draft vocabulary's mask and kept ids (None for EAGLE-1)."""
    b, n = batch.shape
    rows = b * n
    eval_rows = loss_positions(batch)
    in_vocab = t2d[tout.argmax].view(b, n) if t2d is not None else torch.ones_like(eval_rows)
    tgt_argmax = tout.argmax.view(b, n)
    tgt_hidden = tout.hidden.view(b, n, -1)
    vocab = columns.numel() if columns is not None else target.arch.vocab_size
    chunk = max(64, LOSS_CHUNK_ELEMENTS // vocab)
    total = torch.zeros((), device=batch.ids.device)
    result = UnrollResult(total, [], [], [])
    for j, out in enumerate(head_steps(head, tout.features, batch.ids, steps)):
        counted = shift(eval_rows, 1 + j).reshape(rows)
        idx = counted.nonzero().squeeze(1)
        weight = shift(in_vocab & eval_rows, 1 + j).reshape(rows)[idx].float()
        t_hid = shift(tgt_hidden, 1 + j).reshape(rows, -1)[idx]
        t_arg = shift(tgt_argmax, 1 + j).reshape(rows)[idx]
        out_rows = out[idx]
        loss_sum = torch.zeros((), device=out.device)
        correct = torch.zeros((), dtype=torch.long, device=out.device)
        top = torch.zeros(len(TOP_WIDTHS), dtype=torch.long, device=out.device)
        for s in range(0, idx.numel(), chunk):
            args = (out_rows[s:s + chunk], t_hid[s:s + chunk], weight[s:s + chunk])
            if grad:
                ls, am = checkpoint(_chunk_loss, head, target, columns, *args, use_reentrant=False)
            else:
                ls, am = _chunk_loss(head, target, columns, *args)
            loss_sum = loss_sum + ls
            hit = head.draft_to_target[am] == t_arg[s:s + chunk, None]  # [rows, max width], ranked
            correct = correct + hit[:, 0].sum()
            if not grad:  # validation only
                top = top + torch.stack([hit[:, :w].any(-1).sum() for w in TOP_WIDTHS])
        step_loss = loss_sum / weight.sum().clamp(min=1.0)
        total = total + decay ** j * step_loss
        result.step_losses.append(step_loss.detach())
        result.correct.append(correct)
        result.correct_top.append(top)
        result.counted.append(torch.tensor(idx.numel(), device=out.device))
    result.loss = total
    return result
