"""Tiny random HF checkpoints on disk, for tests of every component that needs a model.

``write_tiny_hf_checkpoint(tmp_path, family, **overrides)`` saves a real transformers model
(``save_pretrained``: config.json + model.safetensors, or shards + index) of one of the supported
families with a few-kilobyte size, plus a character-level fast tokenizer with a ChatML-style chat
template, so the directory works with both tandem and ``AutoModelForCausalLM.from_pretrained``.

Invariants:
- Deterministic: the same (family, overrides, seed) gives bit-identical weights.
- Every parameter is random, norms included (around 1, or around 0 for Gemma whose norms are
  ``1 + w``), so a loader or model that confuses two tensors gives different numbers.
- Defaults use GQA (4 query heads, 2 kv heads), head_dim 16 and 2 layers; Gemma3 defaults to one
  sliding (window 8) and one full-attention layer. Llama/Mistral/Qwen default to untied embeddings,
  Gemma3 to tied; ``tie_word_embeddings=`` overrides either way.
- Token ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos), 3 <pad>, 4 <|im_start|>, 5 <|im_end|>, then one
  id per printable ASCII character plus "\\n" and "\\t"; the tokenizer adds no BOS. The default
  vocabulary (128) leaves unused ids at the top; ids ≥ 103 never come out of the tokenizer.
  Non-ASCII text becomes <unk> (or is dropped by qwen2's tokenizer class): keep test text ASCII.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]  # 95 printable + \t + \n + space
TOKENIZER_VOCAB = len(SPECIAL_TOKENS) + len(CHARS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False, "rope_theta": 10000.0},
    "mistral": {"tie_word_embeddings": False, "rope_theta": 10000.0, "sliding_window": None},
    "qwen2": {"tie_word_embeddings": False, "rope_theta": 10000.0},
    "qwen3": {"tie_word_embeddings": False, "rope_theta": 10000.0},
    "gemma3": {
        "tie_word_embeddings": True,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


def _config_class(family: str) -> Any:
    import transformers as T

    return {
        "llama": T.LlamaConfig,
        "mistral": T.MistralConfig,
        "qwen2": T.Qwen2Config,
        "qwen3": T.Qwen3Config,
        "gemma3": T.Gemma3TextConfig,
    }[family]


def tiny_config(family: str, **overrides: Any) -> Any:
    """The transformers config object of a tiny ``family`` model (overrides win)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    kwargs = {**_COMMON, **_DEFAULTS[family], **overrides}
    if family == "gemma3" and "layer_types" not in overrides and "num_hidden_layers" in overrides:
        n = kwargs["num_hidden_layers"]
        kwargs["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]
    return _config_class(family)(**kwargs)


def _randomize(model: torch.nn.Module, family: str, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    norm_center = 0.0 if family == "gemma3" else 1.0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.1 * noise)
            else:
                p.copy_(std * noise)


def tiny_tokenizer() -> Any:
    """A character-level fast tokenizer with the ids documented above and a ChatML template.

    It is a byte-level BPE without merges (GPT-2 byte alphabet: " " is "Ġ", "\\n" is "Ċ"), so that
    transformers classes which rebuild the pipeline around the vocabulary (``Qwen2Tokenizer`` for
    model_type qwen2) tokenize exactly like the saved ``tokenizer.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = _gpt2_byte_chars()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in CHARS:
        vocab[byte_char[ord(c)]] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte → printable-unicode map (as used by ByteLevel pre-tokenizers)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def write_tiny_hf_checkpoint(
    tmp_path: Path,
    family: str,
    *,
    seed: int = 0,
    std: float = 0.05,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    name: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random ``family`` model under ``tmp_path/<name>`` and return that directory.

    ``overrides`` are config fields (e.g. ``tie_word_embeddings=True``, ``num_key_value_heads=4``,
    ``vocab_size=256``). ``dtype`` is the on-disk dtype; ``max_shard_size`` (e.g. "40KB") writes a
    sharded checkpoint with ``model.safetensors.index.json``.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    if with_tokenizer and config.vocab_size < TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size must be ≥ {TOKENIZER_VOCAB} for the tiny tokenizer")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, family, seed, std)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = model.to(dtype)
    out = Path(tmp_path) / (name or f"tiny-{family}")
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(str(out))
    return out


# ---- GGUF ------------------------------------------------------------------------------------------

_HF_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_BLOCK_LLAMA = {**_HF_TO_GGUF_BLOCK, "post_attention_layernorm": "ffn_norm"}
_HF_TO_GGUF_BLOCK_GEMMA3 = {
    **_HF_TO_GGUF_BLOCK,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def hf_to_gguf_name(name: str, gguf_arch: str) -> str:
    """The llama.cpp tensor name of an HF parameter (inverse of tandem.loader.gguf.gguf_to_hf_name)."""
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if name in glob:
        return glob[name]
    parts = name.split(".")  # model.layers.{i}.<module...>.{weight|bias}
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    table = _HF_TO_GGUF_BLOCK_GEMMA3 if gguf_arch == "gemma3" else _HF_TO_GGUF_BLOCK_LLAMA
    return f"blk.{layer}.{table[module]}.{kind}"


def llama_cpp_permute(w: Any, n_head: int) -> Any:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py ``LlamaModel.permute``), numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_quant_bytes(rows: int, cols: int, qtype: Any, seed: int = 0) -> Any:
    """Random raw blocks of ``qtype`` for a [rows, cols] tensor (for types gguf cannot quantize).

    For the K-quants the f16 super-block scales are set to 0.01 so the values decode finite.
    """
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES

    f16_offsets = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
    block, size = GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(seed).integers(0, 256, (rows * (cols // block), size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for off in f16_offsets.get(qtype, ()):
        data[:, off:off + 2] = scale
    return data.reshape(rows, cols // block * size)


def write_tiny_gguf(hf_dir: Path, out: Path, *, qtype: Any = None, raw: dict[str, Any] | None = None,
                    sliding_window_pattern: int | None = None) -> Path:
    """Convert a tiny HF checkpoint to GGUF the way llama.cpp's converter does.

    Applies llama.cpp's conventions: q/k row permutation for Llama/Mistral, ``1 + w`` for Gemma3 norm
    weights, reversed dims. Matrices are stored as ``qtype`` (default F32; F16, BF16 and the legacy
    quants Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 are quantized with gguf); vectors stay F32. ``raw`` maps GGUF
    tensor names to ``(uint8 blocks, qtype)`` written verbatim instead (e.g. random K-quant blocks
    from :func:`random_quant_bytes`).
    """
    import json

    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    qtype = Q.F32 if qtype is None else qtype
    raw = raw or {}
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = _GGUF_ARCH[cfg["model_type"]]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{cfg['model_type']}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        w.add_rope_freq_base(rope.get("full_attention", {}).get("rope_theta", 1e6))
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg["sliding_window"])
        if sliding_window_pattern is not None:
            w.add_sliding_window_pattern(sliding_window_pattern)
    else:
        w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        w.add_vocab_size(cfg["vocab_size"])
        if arch == "llama":
            w.add_rope_dimension_count(head_dim)
        else:
            w.add_key_length(head_dim)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])

    for name, t in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gname = hf_to_gguf_name(name, arch)
        if gname in raw:
            blocks, rtype = raw[gname]
            w.add_tensor(gname, blocks, raw_dtype=rtype)
            continue
        a = t.float().numpy()
        if arch == "llama" and ".attn_q." in gname:
            a = llama_cpp_permute(a, heads)
        elif arch == "llama" and ".attn_k." in gname:
            a = llama_cpp_permute(a, kv_heads)
        if arch == "gemma3" and gname.endswith("norm.weight"):
            a = a + 1.0
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gname, a)
        elif qtype == Q.F16:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
