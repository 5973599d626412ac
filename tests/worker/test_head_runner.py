"""The torch EAGLE head runner (worker/head_runner.py): a step without hidden inputs (a proposal's
first step) reads the target's features from the feature cache by its own slot mapping — head
position p in the slot of target position p — and fuses them, as if they had been passed in."""

from __future__ import annotations

import json

import pytest
import torch

from eagle_heads import compare_chained_head_steps, write_eagle_head
from tandem.kv.feature_cache import FeatureCache
from tandem.kv.kv_cache import allocate_kv_cache
from tandem.loader.arch import ModelArch
from tandem.loader.eagle import load_eagle_head, read_eagle_config
from tandem.worker.batch import SeqChunk
from tandem.worker.head_runner import HeadRunner
from tiny_models import write_tiny_hf_checkpoint


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_a_step_without_hidden_reads_the_features_of_its_positions(tmp_path, layout):
    tdir = write_tiny_hf_checkpoint(tmp_path, "llama", name="t", num_hidden_layers=4)
    aux = (1, 2, 3) if layout == "eagle3" else None
    hdir, _ = write_eagle_head(tmp_path, layout, tdir, **({"aux": aux} if aux else {}), std=0.1)
    arch = ModelArch.from_hf(json.loads((tdir / "config.json").read_text()))
    cfg = read_eagle_config(hdir, arch)
    dev, bs, h = torch.device("cpu"), 4, arch.hidden_size
    head = load_eagle_head(cfg, 256, torch.float32, dev)
    emb = torch.nn.Embedding(arch.vocab_size, h)
    head.bind_target(emb, None, emb.weight)
    width = len(cfg.feature_layers(arch.num_layers)) * h
    features = FeatureCache(width, 32, bs, torch.float32, dev)
    features.rows.copy_(torch.randn(features.rows.shape, generator=torch.Generator().manual_seed(0)))
    kv = lambda: allocate_kv_cache(cfg.layer, 32, bs, torch.float32, dev)[0]  # noqa: E731
    from_cache, fed = HeadRunner(head, kv(), bs, dev, features), HeadRunner(head, kv(), bs, dev)
    blocks = [[7, 2, 9, 4], [0, 5, 11, 3]]  # blocks out of order: positions cross them
    toks = [[(5 * i + 3 * j) % 90 + 3 for j in range(16)] for i in range(2)]
    for starts, lens in (([0, 0], [9, 6]), ([9, 6], [3, 1])):
        chunks = [SeqChunk(toks[i][s + 1:s + 1 + n], s, blocks[i]) for i, (s, n) in enumerate(zip(starts, lens))]
        rows = list(torch.cumsum(torch.tensor(lens), 0) - 1)
        read = torch.cat([features.rows[torch.from_numpy(features.slots(c.block_ids, c.start, c.start + n))]
                          for c, n in zip(chunks, lens)])
        a = from_cache.forward(chunks, rows, None)
        b = fed.forward(chunks, rows, head.step0_hidden(read))
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.feedback, b.feedback)
    with pytest.raises(ValueError, match="features"):
        fed.forward(chunks, rows, None)


def test_a_chained_proposal_drafts_what_a_proposal_after_the_read_drafts(tmp_path):
    """Head steps chained on a verify still on the device (its row argmaxes fed to the catch-up,
    the output row and the chain steps moved back by the rejected count) equal the steps run on
    the verify's outcome: each request accepting 0..k drafts, heads caught up or behind."""
    tdir = write_tiny_hf_checkpoint(tmp_path, "llama", name="t", num_hidden_layers=4)
    hdir, _ = write_eagle_head(tmp_path, "eagle3", tdir, aux=(1, 2, 3), std=0.1)
    arch = ModelArch.from_hf(json.loads((tdir / "config.json").read_text()))
    cfg = read_eagle_config(hdir, arch)
    dev, bs, h = torch.device("cpu"), 4, arch.hidden_size
    head = load_eagle_head(cfg, 256, torch.float32, dev)
    emb = torch.nn.Embedding(arch.vocab_size, h)
    head.bind_target(emb, None, emb.weight)
    features = FeatureCache(3 * h, 160, bs, torch.float32, dev)
    features.rows.copy_(torch.randn(features.rows.shape, generator=torch.Generator().manual_seed(0)))
    kv = lambda: allocate_kv_cache(cfg.layer, 160, bs, torch.float32, dev)[0]  # noqa: E731
    perm = torch.randperm(160, generator=torch.Generator().manual_seed(1)).tolist()
    blocks = [perm[16 * i:16 * i + 16] for i in range(8)]  # (out of order: positions cross them)
    steps = compare_chained_head_steps(HeadRunner(head, kv(), bs, dev, features),
                                       HeadRunner(head, kv(), bs, dev, features), blocks, arch.vocab_size)
    assert steps == 3
