"""Read a GGUF file (llama.cpp format) as an HF-style config dict plus HF-named float32 tensors.

``GGUFCheckpoint(path)`` opens the file once with ``gguf.GGUFReader`` (a memory map; opening parses
all metadata, which for Gemma's 262k-token vocabulary takes ~20 s of pure Python), checks every
tensor's name and type up front, and builds ``config`` — a dict shaped like the model's HF
``config.json`` so that :meth:`ModelArch.from_hf` is the one normaliser for every format.
``iter_weights()`` then dequantizes one tensor at a time; ``iter_weights(packed=True)`` instead
yields the decoder layers' linear weights of the natively served block types (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K: ``models/quant/gguf_blocks.py``) as :class:`QuantizedWeight` read straight
from the blocks, never dequantized; everything else (embeddings, the output head, norms, Q6_K and
the other 16-wide K-quants) is still dequantized to float32.

llama.cpp conventions undone here, so tensors equal the HF checkpoint's:
- Shapes: GGUF lists dims fastest-first (``ne``); numpy/torch order is the reverse. A GGUF
  ``[in, out]`` matrix is torch ``[out, in]``.
- ``llama`` arch: the converter permutes the rows of q/k projections (weight and bias) from HF's
  half-split rotary layout to GGML's interleaved one; we apply the inverse permutation (the same one
  transformers' GGUF loader uses). Qwen2/Qwen3/Gemma3 are converted without that permutation.
- ``gemma3``: the converter stores RMSNorm scales as ``1 + w``; we subtract 1 back (HF keeps ``w``
  and computes ``x * (1 + w)``). This applies to every ``*norm.weight``, q/k norms included.

Invariants: every tensor in the file maps to an HF name or the open fails (no silently dropped
weights); ``lm_head.weight`` is absent exactly when the file has no ``output.weight`` (tied).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tandem.errors import ModelLoadError, UnsupportedArchitectureError
from tandem.loader.memory import return_free_memory
from tandem.models.quant.gguf_blocks import NATIVE_TYPES, parse_blocks
from tandem.models.quant.weights import QuantizedWeight

Q = GGMLQuantizationType
logger = logging.getLogger("tandem")

# GGUF general.architecture → HF "architectures" entry.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# Tensor types we dequantize (each is exercised in tests/test_loader.py).
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    Q.F32, Q.F16, Q.BF16,
    Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama-style blocks have one norm before the MLP; Gemma3 "sandwiches" attention and MLP.
_BLOCK_NAMES_LLAMA = {**_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}
_BLOCK_NAMES_GEMMA3 = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_VOCAB_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                 "tokenizer.ggml.token_type")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, architecture: str) -> str | None:
    """HF parameter name of GGUF tensor ``name`` (e.g. ``blk.3.attn_q.weight``), or None if unknown."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m is None:
        return None
    layer, key, kind = m.groups()
    table = _BLOCK_NAMES_GEMMA3 if architecture == "gemma3" else _BLOCK_NAMES_LLAMA
    if key not in table:
        return None
    return f"model.layers.{layer}.{table[key]}.{kind}"


def reverse_llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py).

    The converter maps HF rows, per head, from ``[2, d/2]`` (halves: real parts then imaginary) to
    ``[d/2, 2]`` (interleaved pairs). ``w``: ``[n_head * d, ...]`` (weight or bias); pass the kv-head
    count for k.
    """
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ModelLoadError(f"cannot un-permute a q/k tensor of {rows} rows into {n_head} heads")
    half = rows // n_head // 2
    # [n_head, d/2, 2, ...] → [n_head, 2, d/2, ...]
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _f32_clean(x: Any) -> float:
    """A float32 metadata value as its shortest decimal (9.99999975e-06 → 1e-05)."""
    return float(str(np.float32(x)))


class GGUFCheckpoint:
    """One opened GGUF file: ``config`` (HF-style dict) and a stream of HF-named float32 tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # bad magic, truncated header/data, unreadable file
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {e}") from e
        self.architecture = str(self._get("general.architecture", ""))
        if self.architecture not in GGUF_ARCHITECTURES:
            # The GGUF names (llama, qwen2, …) are what a user of GGUF files recognises.
            raise UnsupportedArchitectureError(self.architecture or "<missing>", GGUF_ARCHITECTURES)
        split_count = self._get("split.count", 1)
        if int(split_count) > 1:
            raise ModelLoadError(
                f"{self.path} is one of {split_count} split GGUF files; merge them first "
                "(llama-gguf-split --merge)"
            )
        self._hf_names: dict[str, str] = {}
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                raise ModelLoadError(
                    f"{self.path.name} uses llama3-style RoPE frequency factors (rope_freqs.weight), "
                    "which the GGUF loader does not support; load the HF safetensors checkpoint instead"
                )
            hf = gguf_to_hf_name(t.name, self.architecture)
            if hf is None:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {t.name!r} has no known HF name for a "
                    f"{self.architecture} model"
                )
            if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {t.name!r} has type {t.tensor_type.name}, which tandem "
                    f"cannot dequantize (supported: {', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))})"
                )
            self._hf_names[t.name] = hf
        self.config: dict[str, Any] = self._build_config()
        # The vocabulary arrays are parsed into ~200k small numpy objects (~100 MB for a 49k-token
        # vocabulary); the tokenizer is built from the file by transformers, so drop them now.
        for key in _VOCAB_FIELDS:
            self.reader.fields.pop(key, None)
        return_free_memory()

    # ---- metadata --------------------------------------------------------------------------------

    def _get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelLoadError(f"{self.path.name}: cannot read metadata {key!r}: {e}") from e

    def _arch_key(self, suffix: str, default: Any = None) -> Any:
        return self._get(f"{self.architecture}.{suffix}", default)

    def _require(self, suffix: str) -> Any:
        value = self._arch_key(suffix)
        if value is None:
            raise ModelLoadError(f"{self.path.name}: GGUF metadata {self.architecture}.{suffix} is missing")
        return value

    def _token_text(self, token_id: int) -> str | None:
        field = self.reader.fields.get("tokenizer.ggml.tokens")
        if field is None or not 0 <= token_id < len(field.data):
            return None
        return field.contents(token_id)

    def _tensor(self, name: str) -> Any:
        return next((t for t in self.reader.tensors if t.name == name), None)

    def _build_config(self) -> dict[str, Any]:
        arch = self.architecture
        hidden = int(self._require("embedding_length"))
        heads = int(self._require("attention.head_count"))
        kv_heads = int(self._arch_key("attention.head_count_kv", heads))
        num_layers = int(self._require("block_count"))
        head_dim = self._arch_key("attention.key_length")
        if head_dim is None and arch == "llama":
            head_dim = self._arch_key("rope.dimension_count")
        head_dim = int(head_dim) if head_dim is not None else hidden // heads

        embd = self._tensor("token_embd.weight")
        vocab = self._arch_key("vocab_size")
        if vocab is None and embd is not None:
            vocab = int(embd.shape[-1])  # ne = [hidden, vocab]
        if vocab is None:
            tokens = self.reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else None
        if vocab is None:
            raise ModelLoadError(f"{self.path.name}: cannot tell the vocabulary size")

        eos = self._get("tokenizer.ggml.eos_token_id")
        eos_ids: list[int] = [int(eos)] if eos is not None else []
        eot = self._get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        if arch == "gemma3":
            # Gemma's chat turns end with <end_of_turn>; HF's generation_config stops on it too.
            for tid in range(min(int(vocab), 512)):
                if self._token_text(tid) == "<end_of_turn>":
                    if tid not in eos_ids:
                        eos_ids.append(tid)
                    break

        cfg: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "model_type": "gemma3_text" if arch == "gemma3" else arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._require("feed_forward_length")),
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": _f32_clean(self._arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _f32_clean(self._arch_key("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_key("context_length", 4096)),
            "tie_word_embeddings": self._tensor("output.weight") is None,
            "bos_token_id": _opt_int(self._get("tokenizer.ggml.bos_token_id")),
            "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
            "pad_token_id": _opt_int(self._get("tokenizer.ggml.padding_token_id")),
        }
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            cfg["rope_scaling"] = rope_scaling
        if arch == "gemma3":
            cfg.update(self._gemma3_config(num_layers, hidden, heads, head_dim))
        else:
            cfg["hidden_act"] = "silu"
            cfg["attention_bias"] = self._tensor("blk.0.attn_q.bias") is not None
        return cfg

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_key("rope.scaling.type")
        if kind in (None, "none"):
            return None
        factor = float(self._arch_key("rope.scaling.factor", 1.0))
        scaling: dict[str, Any] = {"rope_type": str(kind), "factor": factor}
        orig = self._arch_key("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling

    def _gemma3_config(self, num_layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
        pattern = self._arch_key("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # newer converters: one bool per layer, True = sliding
            layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
            pattern_n = None
        else:
            pattern_n = int(pattern)
            layer_types = [
                "full_attention" if (i + 1) % pattern_n == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        # GGUF has no query_pre_attn_scalar. llama.cpp scales by 1/sqrt(head_dim), except for the
        # 27B model (62 layers), whose HF config has query_pre_attn_scalar = hidden / heads.
        qpas = hidden // heads if num_layers == 62 else head_dim
        out: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": int(self._arch_key("attention.sliding_window", 4096)),
            "layer_types": layer_types,
            "rope_local_base_freq": _f32_clean(self._arch_key("rope.freq_base_swa", 10000.0)),
            "query_pre_attn_scalar": qpas,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
        }
        if pattern_n is not None:
            out["sliding_window_pattern"] = pattern_n
        return out

    # ---- tensors ---------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """HF names of all tensors, in file order."""
        return list(self._hf_names.values())

    def quantization(self) -> str | None:
        """"gguf" if any tensor is quantized (not F32/F16/BF16), else None."""
        floats = {Q.F32, Q.F16, Q.BF16}
        return "gguf" if any(t.tensor_type not in floats for t in self.reader.tensors) else None

    def iter_weights(self, packed: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield ``(hf_name, float32 tensor)`` in file order, dequantizing one tensor at a time; with
        ``packed``, layer linears of a native block type come as QuantizedWeight (module docstring)."""
        heads = int(self.config["num_attention_heads"])
        kv_heads = int(self.config["num_key_value_heads"])
        unpacked: Counter[str] = Counter()
        for t in self.reader.tensors:
            hf = self._hf_names[t.name]
            linear = hf.startswith("model.layers.") and hf.endswith("_proj.weight")
            native = packed and linear and t.tensor_type.name in NATIVE_TYPES
            if packed and linear and not native and t.tensor_type not in (Q.F32, Q.F16, Q.BF16):
                unpacked[t.tensor_type.name] += 1
            w: torch.Tensor | QuantizedWeight
            if native:
                w = self._blocks(t)
            elif packed and t.tensor_type.name in NATIVE_TYPES and len(t.shape) == 2:
                w = self._blocks(t)  # the model dequantizes it straight into the parameter (embeddings)
            else:
                w = self._dequantize(t)
            if self.architecture == "llama":
                n = heads if ".attn_q." in t.name else kv_heads if ".attn_k." in t.name else 0
                if n and isinstance(w, QuantizedWeight):
                    w = w.map_rows(lambda a, n=n: reverse_llama_permute(a, n))
                elif n:
                    w = reverse_llama_permute(w, n)
            self._release(t)
            if self.architecture == "gemma3" and t.name.endswith("norm.weight"):
                w = w - 1.0
            yield hf, w
        if unpacked:
            logger.info("%s: layer linears without a packed kernel, dequantized to float: %s", self.path.name,
                        ", ".join(f"{n}× {k}" for k, n in sorted(unpacked.items())))

    def _release(self, t: Any) -> None:
        """Drop the file pages of a tensor already copied out from this process's RSS (the memory map
        stays valid: a later read faults them back in)."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        start = int(t.data_offset) // page * page
        end = int(t.data_offset) + int(t.n_bytes)
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _blocks(self, t: Any) -> QuantizedWeight:
        cols, rows = (int(d) for d in t.shape.tolist()[:2])  # ne order: [in, out]
        try:
            return parse_blocks(np.asarray(t.data).reshape(rows, -1), t.tensor_type.name, rows, cols)
        except Exception as e:
            raise ModelLoadError(f"{self.path.name}: cannot read the {t.tensor_type.name} blocks of {t.name!r}: {e}") from e

    def _dequantize(self, t: Any) -> torch.Tensor:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ne order → torch order
        try:
            arr = dequantize(t.data, t.tensor_type)
            arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        except Exception as e:
            raise ModelLoadError(
                f"{self.path.name}: cannot dequantize tensor {t.name!r} of type {t.tensor_type.name}: {e}"
            ) from e
        if not arr.flags.writeable:  # an F32 view into the read-only memory map: copy out
            arr = arr.copy()
        return torch.from_numpy(arr)


def _opt_int(x: Any) -> int | None:
    return int(x) if x is not None else None
