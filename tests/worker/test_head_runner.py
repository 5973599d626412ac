"""The torch EAGLE head runner (worker/head_runner.py): a step without hidden inputs (a proposal's
first step) reads the target's features from the feature cache by its own slot mapping — head
position p in the slot of target position p — and fuses them, as if they had been passed in; steps
chained on a verify still on the device draft what steps after its read draft."""

from __future__ import annotations

import pytest
import torch

from eagle_heads import compare_chained_head_steps, head_over_features
from tandem.models.skinny_linear import SkinnyLinear, skinny_linear, use_skinny_linears
from tandem.worker.batch import SeqChunk
from tandem.worker.head_runner import HeadRunner


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_a_step_without_hidden_reads_the_features_of_its_positions(tmp_path, layout):
    dev, bs = torch.device("cpu"), 4
    head, kv, features, _ = head_over_features(tmp_path, layout, dev, num_blocks=32, block_size=bs,
                                               aux=(1, 2, 3) if layout == "eagle3" else None)
    from_cache, fed = HeadRunner(head, kv(), bs, dev, features), HeadRunner(head, kv(), bs, dev)
    blocks = [[7, 2, 9, 4], [0, 5, 11, 3]]  # blocks out of order: positions cross them
    toks = [[(5 * i + 3 * j) % 90 + 3 for j in range(16)] for i in range(2)]
    for starts, lens in (([0, 0], [9, 6]), ([9, 6], [3, 1])):
        chunks = [SeqChunk(toks[i][s + 1:s + 1 + n], s, blocks[i]) for i, (s, n) in enumerate(zip(starts, lens))]
        rows = list(torch.cumsum(torch.tensor(lens), 0) - 1)
        read = torch.cat([features.rows[torch.from_numpy(features.slots(c.block_ids, c.start, c.start + n))]
                          for c, n in zip(chunks, lens)])
        a = from_cache.forward(chunks, rows, None)
        with torch.inference_mode():  # as the runner computes it (with autograd on, linears take torch's path)
            fused = head.step0_hidden(read)
        b = fed.forward(chunks, rows, fused)
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.feedback, b.feedback)
    with pytest.raises(ValueError, match="features"):
        fed.forward(chunks, rows, None)


@pytest.mark.parametrize("skinny", [False, True])
def test_a_chained_proposal_drafts_what_a_proposal_after_the_read_drafts(tmp_path, skinny):
    """Head steps chained on a verify still on the device (its row argmaxes fed to the catch-up,
    the output row and the chain steps moved back by the rejected count) equal the steps run on
    the verify's outcome: each request accepting 0..k drafts, heads caught up or behind. With the
    head's linears on cpu_skinny (as the CPU engine builds it) too: a row's bits do not depend on
    its step's row count."""
    dev, bs = torch.device("cpu"), 4
    head, kv, features, arch = head_over_features(tmp_path, "eagle3", dev, num_blocks=160, block_size=bs)
    if skinny and not use_skinny_linears(head):
        pytest.skip("cpu_skinny cannot be built here")
    perm = torch.randperm(160, generator=torch.Generator().manual_seed(1)).tolist()
    blocks = [perm[16 * i:16 * i + 16] for i in range(8)]  # (out of order: positions cross them)
    steps = compare_chained_head_steps(HeadRunner(head, kv(), bs, dev, features),
                                       HeadRunner(head, kv(), bs, dev, features), blocks, arch.vocab_size)
    assert steps == 3


def test_skinny_linears_replace_a_heads_float_linears_and_keep_its_results(tmp_path):
    """``use_skinny_linears`` (the CPU engine's EAGLE head): every float linear replaced over the same
    parameters; 1-8 rows on cpu_skinny (each row bitwise its 1-row product), more rows and autograd on
    ``layers.linear``; the head's steps close to the float linears' results."""
    from tandem.models import cpu_skinny, layers

    if not cpu_skinny.available():
        pytest.skip("cpu_skinny cannot be built here")
    dev, bs = torch.device("cpu"), 4
    head, kv, features, _ = head_over_features(tmp_path, "eagle3", dev, num_blocks=32, block_size=bs)
    chunks = [SeqChunk([5, 9, 11, 3], 4, [0, 1, 2])]
    hidden = torch.randn(4, head.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    before = HeadRunner(head, kv(), bs, dev, features).forward(chunks, [3], hidden)
    params = {n: p.data_ptr() for n, p in head.named_parameters()}
    n = use_skinny_linears(head)
    assert n == sum(isinstance(m, SkinnyLinear) for m in head.modules()) >= 5
    assert {n: p.data_ptr() for n, p in head.named_parameters()} == params  # no copies
    after = HeadRunner(head, kv(), bs, dev, features).forward(chunks, [3], hidden)
    torch.testing.assert_close(after.logits, before.logits, rtol=1e-4, atol=1e-4)
    w = head.mlp.gate_up_proj.weight.detach()
    x = torch.randn(9, w.shape[1])
    for m in range(1, 9):
        y = skinny_linear(x[:m], w)
        assert torch.equal(y[-1:], skinny_linear(x[m - 1:m], w))
    seen = []
    real = cpu_skinny.mm
    try:
        cpu_skinny.mm = lambda a, b: seen.append(a.shape[0]) or real(a, b)
        torch.testing.assert_close(skinny_linear(x, w), layers.linear(x, w))  # 9 rows: layers.linear
        wg = torch.nn.Parameter(w.clone())
        skinny_linear(x[:2], wg).sum().backward()  # autograd: layers.linear, which has a backward
        assert wg.grad is not None and seen == []
        skinny_linear(x[:3], w)
        assert seen == [3]
    finally:
        cpu_skinny.mm = real


def test_a_skinny_linear_over_bf16_values_reads_a_bf16_copy_with_the_same_bits():
    """A float32 weight holding bf16 values (a head saved in bf16): 1-8-row steps on its bf16 copy,
    bitwise the float32 weight's result; a weight with other values keeps no copy."""
    from tandem.models import cpu_skinny

    if not cpu_skinny.available():
        pytest.skip("cpu_skinny cannot be built here")
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(300, 37, generator=g).bfloat16().float(), requires_grad=False)
    lin = SkinnyLinear(w, None)
    assert lin.narrow is not None and lin.narrow.dtype is torch.bfloat16
    assert SkinnyLinear(torch.nn.Parameter(torch.randn(300, 37, generator=g)), None).narrow is None
    seen = []
    real = cpu_skinny.mm
    try:
        cpu_skinny.mm = lambda a, b: seen.append(b.dtype) or real(a, b)
        x = torch.randn(9, 37, generator=g)
        for m in range(1, 10):
            assert torch.equal(lin(x[:m]), skinny_linear(x[:m], w.detach()))
    finally:
        cpu_skinny.mm = real
    assert seen == [torch.bfloat16, torch.float32] * 8  # (9 rows: layers.linear, neither)


def test_on_the_cpu_a_heads_step_takes_the_c_attention(tmp_path, monkeypatch):
    """A CPU head step's one request goes through cpu_attention (each row as a decode computes it):
    its logits match torch's attention's."""
    from tandem.worker import attention as attention_mod
    from tandem.worker import cpu_attention

    if not cpu_attention.available():
        pytest.skip("the C attention cannot be built here")
    dev, bs = torch.device("cpu"), 4
    head, kv, features, _ = head_over_features(tmp_path, "eagle3", dev, num_blocks=32, block_size=bs)
    cache = kv()
    c_runner, torch_runner = HeadRunner(head, cache, bs, dev, features), HeadRunner(head, cache, bs, dev, features)
    torch_runner.attention.cpu_kernel = False
    calls = []
    real = cpu_attention.attend
    monkeypatch.setattr(attention_mod.cpu_attention, "attend", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    prefix = [SeqChunk([(7 * j) % 90 + 3 for j in range(9)], 0, [0, 1, 2, 3])]
    c_runner.forward(prefix, [8], None)
    for rows in (1, 4):
        chunks = [SeqChunk([5, 9, 11, 3][:rows], 9, [0, 1, 2, 3])]
        hidden = torch.randn(rows, head.cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
        got = c_runner.forward(chunks, [rows - 1], hidden)
        want = torch_runner.forward(chunks, [rows - 1], hidden)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert calls[-2:] == [1, 4]
