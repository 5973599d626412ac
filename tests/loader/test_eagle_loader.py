"""EAGLE head loaders: each public layout maps tensor by tensor onto the head, aux layer ids follow
each tool's convention, and heads that do not fit the target fail with a message naming both."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle_heads import write_eagle_head
from tandem.errors import ModelLoadError
from tandem.loader.arch import ModelArch
from tandem.loader.eagle import load_eagle_head, read_eagle_config
from tandem.loader.heads import detect_head_kind
from tandem.models.eagle import default_aux_layers
from tiny_models import write_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("t"), "llama", num_hidden_layers=8)


def _arch(path):
    return ModelArch.from_hf(json.loads((path / "config.json").read_text()))


def _load(head_dir, target):
    return load_eagle_head(read_eagle_config(head_dir, _arch(target)), 64, torch.float32, torch.device("cpu"))


def test_default_aux_layers_are_vllms():
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(30) == (2, 15, 27)


@pytest.mark.parametrize("layout,prefix", [("eagle3", "midlayer."), ("speculators", "layers.0.")])
def test_eagle3_layouts_map_tensor_by_tensor(tmp_path, target, layout, prefix):
    head_dir, _ = write_eagle_head(tmp_path, layout, target, draft_vocab=40)
    w = load_file(str(head_dir / "model.safetensors"))
    head = _load(head_dir, target)
    cfg = head.cfg
    assert cfg.kind == "eagle3" and cfg.draft_vocab_size == 40 and cfg.aux_layer_ids == (2, 4, 5)
    qkv = head.self_attn.qkv_proj.weight
    assert qkv.shape[1] == 2 * 64  # q/k/v read cat(embedding, hidden)
    torch.testing.assert_close(qkv, torch.cat([w[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
    gu = head.mlp.gate_up_proj.weight
    torch.testing.assert_close(gu, torch.cat([w[prefix + "mlp.gate_proj.weight"], w[prefix + "mlp.up_proj.weight"]]))
    for ours, theirs in [("fc.weight", "fc.weight"), ("norm.weight", "norm.weight"), ("lm_head.weight", "lm_head.weight"),
                         ("hidden_norm.weight", prefix + "hidden_norm.weight"),
                         ("input_layernorm.weight", prefix + "input_layernorm.weight"),
                         ("post_attention_layernorm.weight", prefix + "post_attention_layernorm.weight"),
                         ("self_attn.o_proj.weight", prefix + "self_attn.o_proj.weight"),
                         ("mlp.down_proj.weight", prefix + "mlp.down_proj.weight")]:
        torch.testing.assert_close(dict(head.named_parameters())[ours], w[theirs])
    # d2t offsets: draft id i is target id i + d2t[i], the ids t2d marks
    assert torch.equal(head.draft_to_target, torch.arange(40) + w["d2t"])
    assert torch.equal(torch.nonzero(w["t2d"]).flatten(), head.draft_to_target)
    assert detect_head_kind(str(head_dir)) == "eagle3"


def test_eagle1_layout_with_fc_bias_and_pytorch_bin(tmp_path, target):
    head_dir, _ = write_eagle_head(tmp_path, "eagle", target)
    w = load_file(str(head_dir / "model.safetensors"))
    torch.save(w, head_dir / "pytorch_model.bin")  # the original EAGLE-1 heads ship a .bin
    (head_dir / "model.safetensors").unlink()
    head = _load(head_dir, target)
    assert head.cfg.kind == "eagle" and head.cfg.fc_bias and head.lm_head is None
    assert head.fc.weight.shape == (64, 128)
    torch.testing.assert_close(head.fc.bias, w["fc.bias"])
    assert not hasattr(head, "input_layernorm")  # EAGLE-1's layer 0 has none


def test_aux_ids_follow_each_tools_convention(tmp_path, target):
    # SpecForge / EAGLE repo: eagle_config ids are "output of layer i" -> input of layer i + 1
    sf, want = write_eagle_head(tmp_path, "eagle3", target, aux=(1, 3, 6), name="sf")
    assert json.loads((sf / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert read_eagle_config(sf, _arch(target)).aux_layer_ids == want == (1, 3, 6)
    # speculators: top-level ids are "input of layer i", used as they are
    sp, want = write_eagle_head(tmp_path, "speculators", target, aux=(1, 3, 6), name="sp")
    assert read_eagle_config(sp, _arch(target)).aux_layer_ids == (1, 3, 6)


def test_heads_that_do_not_fit_fail_clearly(tmp_path, target):
    head_dir, _ = write_eagle_head(tmp_path, "speculators", target, aux=(1, 3, 9), name="deep")
    with pytest.raises(ModelLoadError, match="aux layer ids"):
        read_eagle_config(head_dir, _arch(target))
    small = write_tiny_hf_checkpoint(tmp_path, "llama", name="small", vocab_size=120, num_hidden_layers=8)
    head_dir, _ = write_eagle_head(tmp_path, "speculators", target, name="v128")
    with pytest.raises(ModelLoadError, match="vocabulary of 128 tokens; the target has 120"):
        read_eagle_config(head_dir, _arch(small))
    cfg = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**cfg, "fc_norm": True}))
    with pytest.raises(ModelLoadError, match="fc_norm"):
        read_eagle_config(head_dir, _arch(target))
    with pytest.raises(ModelLoadError, match="no config.json"):
        read_eagle_config(tmp_path / "nowhere", _arch(target))


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_head_logits_equal_the_plain_product(tmp_path, target, rows):
    """``EagleHead.logits`` takes the CPU small-row matmul path (the split GEMV for one row): the same
    logits as ``F.linear`` over the normed rows, to float32 rounding."""
    head_dir, _ = write_eagle_head(tmp_path, "speculators", target, draft_vocab=40)
    head = _load(head_dir, target)
    out = torch.randn(rows, head.cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    want = torch.nn.functional.linear(head.norm(out), head.lm_head.weight)
    torch.testing.assert_close(head.logits(out), want, rtol=1e-5, atol=1e-5)
