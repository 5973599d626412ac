"""``quantization`` (ModelConfig, LLM kwarg, --quantization/-q, speculative_config) and bad
``quantization_config`` entries: one ConfigError naming the field, never a crash."""

from __future__ import annotations

import json

import pytest
import torch

from engine_utils import make_llm
from quant_checkpoints import write_quantized
from tiny_models import write_tiny_hf_checkpoint
from tandem.config import ModelConfig
from tandem.config.model import QUANTIZATIONS
from tandem.config.speculative import SpeculativeConfig
from tandem.errors import ConfigError
from tandem.kv.kv_cache import allocate_kv_cache, kv_budget_bytes
from tandem.loader.arch import ModelArch
from tandem.loader.checkpoint import open_checkpoint, resolve_quantization


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant-cfg")
    qdir, rdir, _ = write_quantized(tmp, "gptq", name="g")
    return qdir, rdir


@pytest.mark.parametrize("value", ["fp8", "bitsandbytes", "GPTQ", 4])
def test_unknown_quantization_names_the_field(value):
    with pytest.raises(ConfigError) as err:
        ModelConfig("m", quantization=value)
    assert err.value.key == "quantization"
    if isinstance(value, str):
        assert err.value.allowed == list(QUANTIZATIONS)


def test_speculative_quantization_is_checked():
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2, quantization="fp8")
    assert err.value.key == "quantization"
    assert SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2,
                             quantization="int4").quantization == "int4"


@pytest.mark.parametrize("asked,text", [
    ("awq", "'awq' was asked for, but"),
    ("gguf", "'gguf' was asked for, but"),
    ("int4", "int4 quantizes float checkpoints at load, but"),
])
def test_mismatch_with_the_checkpoint_is_one_error(dirs, asked, text):
    with pytest.raises(ConfigError) as err:
        make_llm(dirs[0], quantization=asked)
    assert err.value.key == "quantization" and text in str(err.value) and "gptq" in str(err.value)


def test_checkpoint_format_on_a_float_checkpoint(dirs):
    with pytest.raises(ConfigError) as err:
        make_llm(dirs[1], quantization="gptq")
    assert err.value.key == "quantization" and "not quantized" in str(err.value)


def test_draft_quantization_mismatch_names_the_spec_key(dirs):
    with pytest.raises(ConfigError) as err:
        make_llm(dirs[0], speculative_config={"method": "draft_model", "model": str(dirs[1]),
                                              "num_speculative_tokens": 2, "quantization": "awq"})
    assert err.value.key == "speculative_config.quantization"


def test_resolution_rules(dirs):
    cpu, q, f = torch.device("cpu"), open_checkpoint(str(dirs[0])), open_checkpoint(str(dirs[1]))
    assert q.quantization == "gptq" and f.quantization is None
    assert resolve_quantization(None, q, cpu) == "gptq"
    assert resolve_quantization("gptq_marlin", q, cpu) == "gptq"  # vLLM's spelling
    assert resolve_quantization("none", q, cpu) is None
    assert resolve_quantization(None, f, cpu) is None
    assert resolve_quantization("int8", f, cpu) == "int8"
    assert resolve_quantization("int4", f, torch.device("cuda")) == "int4"  # W4 on CUDA
    with pytest.raises(ConfigError, match="CPU kernels only"):
        resolve_quantization("int8", f, torch.device("cuda"))


@pytest.mark.parametrize("patch,key", [
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method"),
    ({"bits": 3}, "quantization_config.bits"),
    ({"group_size": 0}, "quantization_config.group_size"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
    ({"quant_method": "awq", "version": "gemv"}, "quantization_config.version"),
    ({"quant_method": "awq", "zero_point": False}, "quantization_config.zero_point"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "quantization_config.format"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8}}}}, "quantization_config.config_groups.g.input_activations"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}}},
     "quantization_config.config_groups.g.weights.symmetric"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 128}}}},
     "quantization_config.config_groups.g.weights.type"),
])
def test_bad_quantization_config_names_the_field(dirs, tmp_path, patch, key):
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(dirs[0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **patch}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        make_llm(d)
    assert err.value.key == key


def test_cli_flag_and_short_flag():
    from tandem.engine.args import add_engine_args, engine_kwargs

    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--quantization", "int4"]))["quantization"] == "int4"
    assert engine_kwargs(p.parse_args(["-q", "awq"]))["quantization"] == "awq"


def test_cpu_kv_cache_follows_the_configuration(tmp_path):
    arch = ModelArch.from_hf(json.loads((write_tiny_hf_checkpoint(tmp_path, "llama") / "config.json").read_text()))
    cpu = torch.device("cpu")
    budget, source = kv_budget_bytes(cpu, 0.9, None, cpu_demand=3 << 20)
    assert budget == 3 << 20 and "max_num_seqs" in source
    big, _ = kv_budget_bytes(cpu, 0.9, None, cpu_demand=1 << 50)
    assert big <= 4 << 30  # capped
    assert kv_budget_bytes(cpu, 0.9, 12345, cpu_demand=3 << 20)[0] == 12345  # explicit wins
    k, v = allocate_kv_cache(arch, 64, 4, torch.float32, cpu)[0]
    assert k.shape == (256, arch.num_kv_heads, arch.head_dim) and not k.any() and not v.any()
    k[3] = 1.5  # writable, independent of v
    assert float(k.sum()) == 1.5 * arch.num_kv_heads * arch.head_dim and not v.any()
