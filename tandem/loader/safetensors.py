"""Read the weights of a Hugging Face directory of ``*.safetensors`` files.

``SafetensorsWeights(dir)`` finds the shards (``model.safetensors.index.json`` if present, else every
``*.safetensors`` in the directory), reads their headers eagerly — so a truncated or garbage file
fails at open time with a :class:`ModelLoadError` naming it — and streams tensors one at a time on
``iter_weights()``.

Invariants:
- Names are HF text-model parameter names (``model.layers.0.self_attn.q_proj.weight``, …): the
  multimodal Gemma3 prefixes (``model.language_model.``, ``language_model.model.``,
  ``language_model.lm_head``) are rewritten; vision-tower / projector tensors and rotary
  ``inv_freq`` buffers are dropped. Any other name passes through unchanged.
- Tensors keep the file's dtype (bf16/f16/f32); the caller casts.
- A name appearing in two shards is an error, not a silent overwrite.
- Quantized checkpoints (``scheme`` from config.json's ``quantization_config``: GPTQ, AWQ,
  compressed-tensors): the parts of one linear (``<m>.qweight``/``qzeros``/``scales``/``g_idx``,
  ``<m>.weight_packed``/``weight_scale``/…) are gathered across shards and yielded, after the float
  tensors, as one ``(<m>.weight, QuantizedWeight)`` (``models/quant/hf_formats.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.errors import ModelLoadError
from tandem.models.quant.hf_formats import DECODERS, PARTS, HFQuantScheme
from tandem.models.quant.weights import QuantizedWeight

INDEX_FILE = "model.safetensors.index.json"

# Tensors of a multimodal checkpoint that the text model does not use.
_DROP_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
# (old prefix, new prefix) applied in order; first match wins.
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", "model."),
)


def hf_text_name(name: str) -> str | None:
    """Map a checkpoint tensor name to the HF text-model name; None means "not a text weight"."""
    if name.startswith(_DROP_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def find_safetensors_files(directory: Path) -> list[Path]:
    """The shard files of ``directory``, in a stable order. Raises ModelLoadError if there are none."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [directory / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if len(files) > 1:
        # Mistral-style repos ship consolidated.safetensors (other naming) next to the HF shards.
        files = [f for f in files if f.name != "consolidated.safetensors"]
    if not files:
        others = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in directory.glob(pattern))
        hint = (f" (found {', '.join(others)}: PyTorch pickles are not supported, convert to safetensors)"
                if others else "")
        raise ModelLoadError(f"no *.safetensors weight files in {directory}{hint}")
    return files


class SafetensorsWeights:
    """The tensors of one HF checkpoint directory, headers read eagerly, data streamed lazily."""

    def __init__(self, directory: str | Path, scheme: HFQuantScheme | None = None) -> None:
        self.directory = Path(directory)
        self.scheme = scheme
        self.files = find_safetensors_files(self.directory)
        # raw name -> file; built from the headers, which also validates every file up front.
        self._where: dict[str, Path] = {}
        for f in self.files:
            for raw in self._keys(f):
                if raw in self._where:
                    raise ModelLoadError(
                        f"tensor {raw!r} appears in both {self._where[raw].name} and {f.name}"
                    )
                self._where[raw] = f

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as fh:
                return list(fh.keys())
        except Exception as e:  # SafetensorError, OSError: corrupt, truncated or unreadable
            raise ModelLoadError(f"cannot read safetensors file {path}: {e}") from e

    def _quant_part(self, name: str) -> tuple[str, str] | None:
        """(module, part) if ``name`` is one part of a quantized linear of this checkpoint's scheme."""
        if self.scheme is None:
            return None
        module, _, part = name.rpartition(".")
        return (module, part) if part in PARTS[self.scheme.method] else None

    def names(self) -> list[str]:
        """HF names this checkpoint will yield (after prefix rewriting and dropping)."""
        out: list[str] = []
        for raw in self._where:
            n = hf_text_name(raw)
            if n is None:
                continue
            q = self._quant_part(n)
            if q is None:
                out.append(n)
            elif self.scheme is not None and q[1] == PARTS[self.scheme.method][0]:
                out.append(q[0] + ".weight")
        return out

    def iter_weights(self, skip_lm_head: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield ``(hf_name, tensor)`` file by file; ``skip_lm_head`` drops a tied copy of lm_head."""
        held: dict[str, dict[str, torch.Tensor]] = {}
        for path in self.files:
            try:
                with safe_open(str(path), framework="pt") as fh:
                    for raw in fh.keys():  # noqa: SIM118 - safe_open handles have no __iter__
                        name = hf_text_name(raw)
                        if name is None or (skip_lm_head and name == "lm_head.weight"):
                            continue
                        q = self._quant_part(name)
                        if q is not None:
                            held.setdefault(q[0], {})[q[1]] = fh.get_tensor(raw)
                            continue
                        yield name, fh.get_tensor(raw)
            except ModelLoadError:
                raise
            except Exception as e:  # data region unreadable although the header was fine
                raise ModelLoadError(f"cannot read tensors from {path}: {e}") from e
        for module, parts in held.items():
            yield module + ".weight", self._decode(module, parts)

    def _decode(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        scheme = self.scheme
        if scheme is None:  # pragma: no cover - only called for parts of a scheme
            raise ModelLoadError(f"{module}: quantized parts without a quantization_config")
        method = scheme.method
        lead = PARTS[method][0]
        needed = PARTS[method][:3] if method != "compressed-tensors" else (lead, "weight_scale", "weight_shape")
        missing = [p for p in needed if p not in parts]
        if missing:
            raise ModelLoadError(f"{method} checkpoint {self.directory}: {module} lacks {', '.join(missing)}")
        try:
            return DECODERS[method](parts, scheme)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ModelLoadError(f"{method} checkpoint {self.directory}: cannot unpack {module}: {e}") from e
