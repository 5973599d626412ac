"""The batched TTT unroll equals drafting as inference does it, row by row: for head position ``t``
the head's KV holds the step-0 entries of positions ``0..t`` (target feature ``s`` + token
``s+1``), then each chain step ``j`` feeds token ``x[t+1+j]`` at position ``t+j`` with the previous
step's feedback and appends its own K/V (``spec_decode/eagle.py``)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_hf_checkpoint

from tandem.engine.model_loader import build_model
from tandem.loader.checkpoint import open_checkpoint
from tandem.train.batches import Batch
from tandem.train.config import TrainConfig
from tandem.train.head import build_head, head_config, trainable_parameters
from tandem.train.target import FrozenTarget
from tandem.train.ttt import TOP_WIDTHS, head_steps, loss_positions, shift, unroll
from tandem.train.vocab import full_vocab
from tandem.worker.attention import split_qkv


def _chain_reference(head, features, ids, steps):
    """outs[j][b, t]: head output of chain step j drafted from head position t (a Python loop)."""
    attn = head.self_attn
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    b, n = ids.shape
    outs = torch.zeros(steps, b, n, head.cfg.hidden_size, dtype=torch.float64)

    def project(tok, hidden, pos):
        qkv, residual = head.qkv(head.embed(torch.tensor([tok])), hidden[None])
        q, k, v = split_qkv(attn, qkv, torch.tensor([pos]))
        return q[0], k[0], v[0], residual

    def attend(q, keys, vals):
        o = torch.zeros(h, d, dtype=q.dtype)
        for hi in range(h):
            kk = torch.stack([k[hi // (h // kvh)] for k in keys])
            vv = torch.stack([v[hi // (h // kvh)] for v in vals])
            o[hi] = torch.softmax(kk @ q[hi] * attn.scale, 0) @ vv
        return o.reshape(1, h * d)

    for bi in range(b):
        fused = head.fuse(features.view(b, n, -1)[bi]) if head.cfg.kind == "eagle3" else features.view(b, n, -1)[bi]
        cache = [project(int(ids[bi, s + 1]) if s + 1 < n else 0, fused[s], s) for s in range(n)]
        for t in range(n):
            keys = [c[1] for c in cache[:t + 1]]
            vals = [c[2] for c in cache[:t + 1]]
            q, _, _, residual = cache[t]
            out = head.finish(attend(q, keys, vals), residual)[0]
            outs[0, bi, t] = out
            for j in range(1, steps):
                tok = int(ids[bi, t + 1 + j]) if t + 1 + j < n else 0
                q, k, v, residual = project(tok, head.feedback(out[None])[0], t + j)
                keys, vals = keys + [k], vals + [v]
                out = head.finish(attend(q, keys, vals), residual)[0]
                outs[j, bi, t] = out
    return outs


def _tiny_head(tmp_path, method):
    """A tiny float64 target, a head on its full vocabulary with large random weights, the frozen target."""
    target_dir = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2, num_hidden_layers=4)
    ck = open_checkpoint(str(target_dir))
    model = build_model(ck.arch, ck.weights(), torch.float64, torch.device("cpu"), 64)
    cfg = TrainConfig(target=str(target_dir), out=str(tmp_path), method=method, norm_output=method == "eagle3",
                      norm_before_fc=method == "eagle3")
    vocab = full_vocab(ck.arch.vocab_size)
    ecfg = head_config(ck.arch, cfg, vocab)
    head = build_head(ecfg, model, vocab, 64, torch.device("cpu"), 0).double()
    head.bind_target(model.model.embed_tokens, model.model.embed_scale, model.lm_head_weight)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger weights than the 0.02 init, so every path moves the outputs
        for p in trainable_parameters(head).values():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return head, FrozenTarget(model, ecfg.feature_layers(ck.arch.num_layers)), g


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_batched_unroll_equals_the_inference_chain(tmp_path, method):
    head, target, g = _tiny_head(tmp_path, method)
    ids = torch.randint(6, 100, (2, 7), generator=g)
    tout = target.run(Batch(ids, torch.tensor([7, 7]), torch.tensor([2, 2])))
    steps = 3
    with torch.no_grad():
        got = torch.stack([o.view(2, 7, -1) for o in head_steps(head, tout.features, ids, steps)])
        want = _chain_reference(head, tout.features, ids, steps)
    # float64 throughout except RMSNorm, which computes in float32 (differences ~1e-7 of |x| ~ 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_validation_counts_the_targets_token_among_the_heads_top_candidates(tmp_path):
    """``unroll(grad=False)`` counts, per step, the rows whose target argmax is the head's argmax and
    those where it is among the head's top 2 / top 4 (what a draft tree could accept): equal to the
    same counts made directly from the head's logits over the counted rows."""
    head, target, g = _tiny_head(tmp_path, "eagle")
    ids = torch.randint(6, 100, (3, 9), generator=g)
    batch = Batch(ids, torch.tensor([9, 9, 8]), torch.tensor([2, 3, 2]))
    tout = target.run(batch)
    steps = 3
    with torch.no_grad():
        res = unroll(head, target, tout, batch, None, None, steps, 0.8, grad=False)
        outs = list(head_steps(head, tout.features, ids, steps))
    counts = []
    for j, out in enumerate(outs):
        counted = shift(loss_positions(batch), 1 + j).reshape(-1)
        t_arg = shift(tout.argmax.view(ids.shape), 1 + j).reshape(-1)[counted]
        ranked = head.draft_to_target[head.logits(out[counted]).topk(max(TOP_WIDTHS), dim=-1).indices]
        hit = ranked == t_arg[:, None]
        assert int(res.correct[j]) == int(hit[:, 0].sum())
        assert res.correct_top[j].tolist() == [int(hit[:, :w].any(-1).sum()) for w in TOP_WIDTHS]
        counts.append([int(res.correct[j]), *res.correct_top[j].tolist(), int(res.counted[j])])
    # the random head agrees sometimes, and a wider top finds more: the counts are not all trivial
    assert all(c[0] <= c[1] <= c[2] <= c[3] for c in counts) and any(c[2] > c[0] for c in counts), counts
