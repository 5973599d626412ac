"""The EAGLE feature cache (kv/feature_cache.py): rows land in their requests' KV slots, padding
tokens (slot -1) write only the spare row, and a step's gather by slot mapping follows block tables
across block boundaries (padding rows read the spare row)."""

from __future__ import annotations

import torch

from tandem.kv.feature_cache import FeatureCache


def test_writes_land_in_slots_and_gathers_follow_block_tables():
    fc = FeatureCache(width=3, num_blocks=6, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    blocks_a, blocks_b = [5, 2], [0, 3, 1]  # request a: positions 0..7, b: 0..11
    feats = {"a": torch.randn(8, 3), "b": torch.randn(12, 3)}
    # a step with a's prefill chunk, b's first 5 positions and two padding rows
    slots = torch.cat([torch.from_numpy(fc.slots(blocks_a, 0, 6)), torch.tensor([-1]),
                       torch.from_numpy(fc.slots(blocks_b, 0, 5)), torch.tensor([-1])])
    fc.write(slots, torch.cat([feats["a"][:6], torch.full((1, 3), 9.0), feats["b"][:5], torch.full((1, 3), 9.0)]))
    fc.write_positions(blocks_a, 6, feats["a"][6:])  # a host step with no slot tensor
    fc.write_positions(blocks_b, 5, feats["b"][5:])
    assert fc.slots(blocks_b, 3, 6).tolist() == [3, 12, 13]
    step = torch.cat([torch.from_numpy(fc.slots(blocks_b, 2, 11)), torch.tensor([-1]),
                      torch.from_numpy(fc.slots(blocks_a, 0, 8))])
    got = fc.gather(step)
    assert torch.equal(got, torch.cat([feats["b"][2:11], torch.full((1, 3), 9.0), feats["a"]]))
    assert torch.equal(fc.rows[fc.num_slots], torch.full((3,), 9.0))  # padding wrote only the spare row
    untouched = [s for s in range(fc.num_slots) if s // 4 == 4]  # block 4: nobody's
    assert not fc.rows[untouched].any()


def test_bytes_per_block():
    assert FeatureCache.bytes_per_block(1728, 16, torch.bfloat16) == 16 * 1728 * 2
