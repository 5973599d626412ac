"""Open a model — alias, HF directory, GGUF file or config for random weights — as one Checkpoint.

A :class:`Checkpoint` is what the rest of tandem sees of a model on disk: the normalised
:class:`ModelArch`, the HF-style ``config`` dict it came from, a ``weights()`` stream of
``(hf_name, tensor)`` pairs and ``load_tokenizer()``. Every format yields the same names:

    model.embed_tokens.weight                                 [vocab, hidden]
    model.layers.{i}.input_layernorm.weight                   [hidden]
    model.layers.{i}.self_attn.q_proj.weight                  [heads * head_dim, hidden]
    model.layers.{i}.self_attn.{k,v}_proj.weight              [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.o_proj.weight                  [hidden, heads * head_dim]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias              if attention_bias (Qwen2; Llama's flag adds o_proj.bias)
    model.layers.{i}.self_attn.{q,k}_norm.weight              [head_dim] (Qwen3, Gemma3)
    model.layers.{i}.post_attention_layernorm.weight          [hidden]
    model.layers.{i}.{pre,post}_feedforward_layernorm.weight  [hidden] (Gemma3)
    model.layers.{i}.mlp.{gate,up}_proj.weight                [intermediate, hidden]
    model.layers.{i}.mlp.down_proj.weight                     [hidden, intermediate]
    model.norm.weight                                         [hidden]
    lm_head.weight                                            [vocab, hidden] (absent when tied)

Conventions: Gemma norm weights are in HF form (the model computes ``x * (1 + w)``); GGUF tensors are
dequantized to float32 (``weights(packed=True)``: the quantized layer linears of GGUF, GPTQ, AWQ and
compressed-tensors checkpoints come as ``QuantizedWeight`` instead, see docs/quantization.md); safetensors tensors keep the file's dtype; dummy tensors are float32. Pass
``weights(dtype=..., device=...)`` to have them cast/moved one by one (dummy weights are then
generated directly there), or cast yourself.

Opening reads only metadata and headers, so every user error (missing path, bad format, corrupt
file, unknown architecture) surfaces from ``open_checkpoint`` as a typed error; tensor data is read
lazily by ``weights()``, one tensor at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from tandem.config.model import (
    CHECKPOINT_QUANTIZATIONS,
    LOAD_FORMATS,
    ON_THE_FLY_QUANTIZATIONS,
    QUANTIZATIONS,
    canonical_quantization,
    check_quantization,
)
from tandem.errors import ConfigError, ModelLoadError
from tandem.loader.arch import ModelArch
from tandem.loader.dummy import dummy_weights
from tandem.loader.registry import aliases_help, resolve_model
from tandem.loader.safetensors import SafetensorsWeights
from tandem.loader.tokenizer import load_tokenizer, single_gguf_in
from tandem.models.quant.hf_formats import HFQuantScheme
from tandem.models.quant.weights import QuantizedWeight

if TYPE_CHECKING:  # the gguf package is imported only when a GGUF file is opened
    from tandem.loader.gguf import GGUFCheckpoint

def expected_parameter_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every parameter a model of ``arch`` loads, in HF naming and module order, with its shape."""
    h, v, i, hd = arch.hidden_size, arch.vocab_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if arch.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
            if arch.family in ("llama", "mistral"):  # HF Llama's attention_bias covers o_proj too
                shapes[p + "self_attn.o_proj.bias"] = (h,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if arch.is_gemma:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


@dataclass(frozen=True)
class Checkpoint:
    """An opened model. ``weights()`` may be called more than once; each call streams afresh."""

    arch: ModelArch
    config: dict[str, Any] = field(hash=False)  # HF-style config.json dict
    source: str  # path of the directory or GGUF file (or config.json for dummy)
    kind: str  # "hf" | "gguf" | "dummy"
    tokenizer_path: str | None = None  # alias, HF dir or .gguf the tokenizer comes from
    seed: int = 0  # dummy weights only
    quantization: str | None = None  # detected: "gguf" | "gptq" | "awq" | "compressed-tensors" | None
    _reader: SafetensorsWeights | GGUFCheckpoint | None = field(
        default=None, repr=False, compare=False, hash=False
    )

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return expected_parameter_shapes(self.arch)

    def weights(
        self, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None, packed: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Stream ``(hf_name, tensor)``; with ``dtype``/``device`` each tensor is converted as it goes.

        ``packed``: quantized layer linears stay QuantizedWeight (else they are dequantized here)."""
        if self.kind == "dummy":
            yield from dummy_weights(
                self.parameter_shapes(), family=self.arch.family, seed=self.seed, device=device, dtype=dtype
            )
            return
        stream: Iterator[tuple[str, torch.Tensor | QuantizedWeight]]
        if self.kind == "gguf" and self._reader is not None and not isinstance(self._reader, SafetensorsWeights):
            stream = self._reader.iter_weights(packed=packed)
        elif isinstance(self._reader, SafetensorsWeights):
            stream = self._reader.iter_weights(skip_lm_head=self.arch.tie_word_embeddings)
        else:  # pragma: no cover - open_checkpoint always sets a reader for non-dummy kinds
            raise ModelLoadError(f"checkpoint {self.source} has no weight reader")
        for name, tensor in stream:
            if isinstance(tensor, QuantizedWeight):
                if packed:
                    yield name, tensor
                    continue
                tensor = tensor.dequantize()
            if dtype is not None or device is not None:
                tensor = tensor.to(device=device, dtype=dtype)
            yield name, tensor

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's fast HF tokenizer (see :func:`tandem.loader.tokenizer.load_tokenizer`)."""
        return load_tokenizer(self)


def open_checkpoint(
    model: str | os.PathLike[str],
    *,
    load_format: str = "auto",
    tokenizer: str | None = None,
    revision: str | None = None,
    seed: int = 0,
) -> Checkpoint:
    """Open ``model`` (alias, HF directory, .gguf file, directory with one .gguf, or config.json).

    ``load_format``: "auto" (by what is on disk), "safetensors", "gguf", or "dummy" (the model's
    config with seeded random weights; ``seed`` picks them). ``tokenizer`` overrides where the
    tokenizer comes from. ``revision`` exists for vLLM API compatibility: hubs are unreachable, so
    anything but None is rejected.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError("load_format", f"unknown load format {load_format!r}", allowed=LOAD_FORMATS)
    if revision is not None:
        raise ConfigError(
            "revision",
            f"cannot select revision {revision!r}: model hubs are unreachable, tandem loads local "
            "paths and built-in aliases only (leave revision unset)",
        )
    if not str(model).strip():
        raise ConfigError("model", f"must be a local path or a built-in alias ({aliases_help()})")
    path = Path(resolve_model(str(model)))
    if load_format == "dummy":
        return _open_dummy(path, tokenizer, seed)

    if path.is_file():
        if path.suffix == ".gguf" or load_format == "gguf":
            if load_format == "safetensors":
                raise ModelLoadError(f"load_format='safetensors' but {path} is a GGUF file")
            return _open_gguf(path, tokenizer)
        if path.name == "config.json":
            raise ModelLoadError(
                f"{path} is a config without weights: pass its directory, or use load_format='dummy' "
                "for random weights"
            )
        if path.suffix == ".safetensors":
            raise ModelLoadError(f"pass the directory that holds {path.name} and config.json, not the file")
        raise ModelLoadError(f"{path}: not a model (expected a directory with config.json, or a .gguf file)")

    has_config = (path / "config.json").is_file()
    if load_format == "gguf":
        gguf = single_gguf_in(path)
        if gguf is None:
            raise ModelLoadError(f"load_format='gguf' but {path} holds no .gguf file")
        return _open_gguf(gguf, tokenizer)
    if load_format == "safetensors" or (has_config and any(path.glob("*.safetensors"))):
        return _open_hf(path, tokenizer)
    gguf = single_gguf_in(path)
    if gguf is not None:
        return _open_gguf(gguf, tokenizer)
    if has_config:
        return _open_hf(path, tokenizer)  # reports the missing weight files precisely
    raise ModelLoadError(
        f"{path} holds neither config.json (HF checkpoint) nor a .gguf file; {aliases_help()}"
    )


def read_config(path: Path) -> dict[str, Any]:
    """Parse a config.json; ModelLoadError if missing, unreadable or not a JSON object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(config).__name__}")
    return config


def _open_hf(directory: Path, tokenizer: str | None) -> Checkpoint:
    config = read_config(directory / "config.json")
    arch = ModelArch.from_hf(config)
    qc = config.get("quantization_config")
    scheme = HFQuantScheme.from_config(qc) if qc is not None else None
    reader = SafetensorsWeights(directory, scheme)
    expected = expected_parameter_shapes(arch)
    present = set(reader.names())
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"checkpoint {directory} lacks weights its config.json implies: {', '.join(missing[:5])}{more}"
        )
    return Checkpoint(arch=arch, config=config, source=str(directory), kind="hf",
                      tokenizer_path=tokenizer or str(directory), _reader=reader,
                      quantization=scheme.method if scheme is not None else None)


def _gguf(path: Path) -> GGUFCheckpoint:
    from tandem.loader.gguf import GGUFCheckpoint

    return GGUFCheckpoint(path)


def _open_gguf(path: Path, tokenizer: str | None) -> Checkpoint:
    reader = _gguf(path)
    arch = ModelArch.from_hf(reader.config)
    return Checkpoint(arch=arch, config=reader.config, source=str(path), kind="gguf",
                      tokenizer_path=tokenizer or str(path), _reader=reader, quantization=reader.quantization())


def _open_dummy(path: Path, tokenizer: str | None, seed: int) -> Checkpoint:
    tok_default: str | None
    if path.is_file() and path.suffix == ".gguf":
        config, tok_default = _gguf(path).config, str(path)
    elif path.is_file():
        config, tok_default = read_config(path), str(path.parent)
    elif (path / "config.json").is_file():
        config, tok_default = read_config(path / "config.json"), str(path)
    elif (gguf := single_gguf_in(path)) is not None:
        config, tok_default = _gguf(gguf).config, str(gguf)
    else:
        raise ModelLoadError(f"load_format='dummy' needs a config.json (or a .gguf) at {path}")
    arch = ModelArch.from_hf(config)
    return Checkpoint(arch=arch, config=config, source=str(path), kind="dummy",
                      tokenizer_path=tokenizer or tok_default, seed=seed)


def resolve_quantization(requested: str | None, ckpt: Checkpoint, device: torch.device,
                         key: str = "quantization") -> str | None:
    """The quantization a model is loaded with: ``requested`` (ModelConfig / speculative_config
    ``quantization``) checked against what ``ckpt`` holds. Unset: the checkpoint's own format (None for
    float weights). A checkpoint format that is not the checkpoint's, int8/int4 on a quantized
    checkpoint, or int8 off the CPU, is one ConfigError naming ``key``. "none" loads everything as float."""
    check_quantization(key, requested)
    req = canonical_quantization(requested)
    found = ckpt.quantization
    if req is None:
        return found
    if req == "none":
        return None
    if req in CHECKPOINT_QUANTIZATIONS:
        if req != found:
            what = f"a {found} checkpoint" if found else "not quantized (float weights)"
            raise ConfigError(key, f"{requested!r} was asked for, but {ckpt.source} is {what}; leave {key} unset "
                                   f"to use the checkpoint's own format", allowed=QUANTIZATIONS)
        return req
    if req in ON_THE_FLY_QUANTIZATIONS:
        if found is not None:
            raise ConfigError(key, f"{req} quantizes float checkpoints at load, but {ckpt.source} is already "
                                   f"{found}-quantized; leave {key} unset", allowed=QUANTIZATIONS)
        if device.type != "cpu" and req != "int4":
            raise ConfigError(key, f"on-the-fly {req} runs on the CPU kernels only (device {device}); on CUDA use "
                                   "int4 or leave it unset", allowed=[*CHECKPOINT_QUANTIZATIONS, "int4", "none"])
        return req
    raise ConfigError(key, f"unknown quantization {requested!r}", allowed=QUANTIZATIONS)  # pragma: no cover
