"""Float32 CPU linears with a oneDNN-packed copy for multi-row steps (models/onednn_linear.py): the
same products as ``layers.linear`` (to float32 rounding), one-row steps unchanged bit for bit, only
all-float32 models converted, and an engine that speculates on a float32 CPU target uses them, for
its LM head too, with its verify's attention in one masked call (its rows are not a decode's bits)."""

from __future__ import annotations

import pytest
import torch

from tandem.models import cpu_skinny
from tandem.models.layers import Linear, linear
from tandem.models.onednn_linear import OneDnnHead, OneDnnLinear, available, prepack_float_linears

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The row counts of the products run on a oneDNN-packed copy."""
    seen: list[int] = []
    packed_op = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):  # type: ignore[no-untyped-def]
        seen.append(x.shape[0])
        return packed_op(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return seen


def test_products_equal_the_float_linear(calls):
    torch.manual_seed(0)
    lin = Linear(96, 80, bias=True)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    fast = OneDnnLinear(lin.weight, lin.bias)
    with torch.inference_mode():
        for rows in (1, 2, 4, 5, 17):
            x = torch.randn(rows, 96)
            got, want = fast(x), linear(x, lin.weight, lin.bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if rows <= (1 if cpu_skinny.available() else 2):  # the float path itself (2-8 rows:
                assert torch.equal(got, want)  # cpu_skinny where built)
        assert calls == ([17] if cpu_skinny.available() else [4, 5, 17])
        x3 = torch.randn(2, 3, 96)
        torch.testing.assert_close(fast(x3), linear(x3.reshape(6, 96), lin.weight, lin.bias).reshape(2, 3, 80))


def test_only_all_float32_models_are_converted(tmp_path):
    from engine_utils import make_llm
    from tiny_models import write_tiny_hf_checkpoint

    path = write_tiny_hf_checkpoint(tmp_path, "llama")
    spec = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    layer = spec.engine.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, OneDnnLinear) and isinstance(layer.self_attn.qkv_proj, OneDnnLinear)
    assert not isinstance(make_llm(path).engine.model.model.layers[0].mlp.gate_up_proj, OneDnnLinear)  # no drafts
    off = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                   runner_config={"cpu_onednn": False})
    assert not isinstance(off.engine.model.model.layers[0].mlp.gate_up_proj, OneDnnLinear)
    model = spec.engine.model
    assert prepack_float_linears(model) == 0  # already converted: nothing is a plain float linear now
    bf16 = make_llm(path, dtype="bfloat16", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert not isinstance(bf16.engine.model.model.layers[0].mlp.gate_up_proj, OneDnnLinear)


def test_the_head_of_a_speculating_float32_target_and_its_verify_attention(tmp_path, calls):
    from engine_utils import make_llm
    from tiny_models import write_tiny_hf_checkpoint

    path = write_tiny_hf_checkpoint(tmp_path, "llama")
    spec = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    model = spec.engine.model
    assert isinstance(model.lm_head_onednn, OneDnnHead)
    assert not spec.engine.runner.attention.exact_verify  # all-float: one masked attention call per verify
    calls.clear()  # (the engine's prefill ran on the packed copy)
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 2, 4):
            h = torch.randn(rows, model.arch.hidden_size)
            got, want = model.compute_logits(h), linear(h, model.lm_head_weight)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if rows <= (1 if cpu_skinny.available() else 2):
                assert torch.equal(got, want)
    assert calls == ([] if cpu_skinny.available() else [4])  # a 4-row head on the packed copy without the kernel
    plain = make_llm(path)
    assert plain.engine.model.lm_head_onednn is None
    packed = make_llm(path, quantization="int4", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert packed.engine.model.lm_head_onednn is None and packed.engine.runner.attention.exact_verify
