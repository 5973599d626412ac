"""Open EAGLE / EAGLE-3 heads in their published layouts (``../shared/research/eagle.md`` §1).

Three layouts, told apart by the config and the tensor names:

- **speculators** (``speculators_model_type`` in config.json): the decoder layer's config is nested
  in ``transformer_layer_config``; ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual``, ``norm_before_fc`` and ``norm_output`` at the top level; aux layer ids
  (``eagle_aux_hidden_state_layer_ids``) mean "input of layer i" (vLLM's convention); tensors
  ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (``input_norm`` with
  ``norm_before_fc``).
- **EAGLE-3** as the EAGLE repository and SpecForge write it (``LlamaForCausalLMEagle3``, tensors
  ``midlayer.*``): ``draft_vocab_size`` at the top level; explicit aux ids under
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` mean "output of layer i" (SGLang's
  convention) and get +1 here.
- **EAGLE-1/2** (a one-layer ``LlamaForCausalLM`` config; tensors ``fc`` over 2H with an optional
  bias, ``layers.0.*`` without ``input_layernorm``; no norm, no lm_head).

Embeddings shipped in a head (``embed_tokens.weight``) are dropped: the head reads the target's.
Weights come from ``*.safetensors`` (or ``pytorch_model.bin``, as the original EAGLE-1 heads ship).
Every mismatch with the target (hidden size, vocabulary, aux layers) is a ``ModelLoadError`` naming
both sides.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tandem.errors import ModelLoadError
from tandem.loader.arch import ModelArch
from tandem.loader.heads import resolve_head
from tandem.models.eagle import EagleConfig, EagleHead, default_aux_layers

# tensors a head may carry that tandem derives or takes from the target
_DROPPED = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")


def _kind(cfg: dict[str, Any], names: list[str]) -> str | None:
    spec_type = cfg.get("speculators_model_type")
    if spec_type is not None:
        if spec_type not in ("eagle", "eagle3"):
            raise ModelLoadError(f"speculators_model_type {spec_type!r} is not an EAGLE head (eagle, eagle3)")
        return str(spec_type)
    archs = [str(a) for a in cfg.get("architectures") or []]
    if any("Eagle3" in a for a in archs) or any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle3" if "draft_vocab_size" in cfg or "d2t" in names else "eagle"
    return None


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files and (path / "pytorch_model.bin").is_file():
        files = [path / "pytorch_model.bin"]
    return files


def _tensor_names(path: Path) -> list[str]:
    names: list[str] = []
    for f in _weight_files(path):
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                names.extend(sf.keys())
        else:
            names.extend(torch.load(f, map_location="cpu", weights_only=True).keys())
    return names


def _tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in _weight_files(path):
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        else:
            yield from torch.load(f, map_location="cpu", weights_only=True).items()


def _rename(name: str) -> str | None:
    """Checkpoint tensor name → EagleHead parameter name (None: dropped)."""
    if name in _DROPPED or name.endswith("rotary_emb.inv_freq"):
        return None
    for prefix in ("midlayer.", "layers.0.", "model.layers.0."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith("fusion_fc."):
        return "fc." + name[len("fusion_fc."):]
    if name.startswith("model."):
        return name[len("model."):]
    return name


def read_eagle_config(path: str | Path, target: ModelArch, *, dummy: bool = False,
                      method: str | None = None) -> EagleConfig:
    """The head's config (``path``: a directory or a shipped alias), checked against the target.
    ``dummy``: random weights will be used (a ``load_format="dummy"`` target), so the directory
    needs only its config.json and ``method`` says the kind where the config does not."""
    p = resolve_head(str(path))
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{p}: no config.json (an EAGLE head directory holds config.json and its weights)")
    cfg = json.loads(cfg_path.read_text())
    if not _weight_files(p) and not dummy:
        raise ModelLoadError(f"{p}: no *.safetensors or pytorch_model.bin weights")
    names = _tensor_names(p)
    kind = _kind(cfg, names) or (method if dummy else None)
    if kind is None:
        raise ModelLoadError(f"{p} is not an EAGLE head (no fc / midlayer / layers.0 tensors)")
    speculators = "speculators_model_type" in cfg
    layer_cfg = dict(cfg["transformer_layer_config"]) if speculators else dict(cfg)
    if speculators and cfg.get("fc_norm"):
        raise ModelLoadError(f"{p}: speculators flag fc_norm=true (per-aux norms) is not supported")
    archs = layer_cfg.get("architectures") or ["LlamaForCausalLM"]
    layer_cfg["architectures"] = ["LlamaForCausalLM" if ("Eagle" in archs[0] or "Llama" in archs[0]) else archs[0]]
    layer_cfg.setdefault("num_hidden_layers", 1)
    layer_cfg.setdefault("vocab_size", target.vocab_size)
    arch = ModelArch.from_hf(layer_cfg)
    if arch.is_gemma:
        raise ModelLoadError(f"{p}: EAGLE heads with a Gemma decoder layer are not supported (use a Llama layer)")
    if arch.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"EAGLE head {p} is for a vocabulary of {arch.vocab_size} tokens; the target has {target.vocab_size}"
        )
    target_hidden = int(cfg.get("target_hidden_size") or arch.hidden_size)
    if target_hidden != target.hidden_size:
        raise ModelLoadError(
            f"EAGLE head {p} reads target hidden states of size {target_hidden}; the target's hidden size "
            f"is {target.hidden_size}"
        )
    if kind == "eagle" and arch.hidden_size != target.hidden_size:
        raise ModelLoadError(
            f"EAGLE-1 head {p} has hidden size {arch.hidden_size}; it must equal the target's {target.hidden_size}"
        )
    draft_vocab = int(cfg.get("draft_vocab_size") or arch.vocab_size)
    aux: tuple[int, ...] = ()
    if kind == "eagle3":
        aux = _aux_layers(cfg, speculators, target.num_layers, p)
    return EagleConfig(
        kind=kind,
        layer=replace(arch, num_layers=1),
        target_hidden_size=target_hidden,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=aux,
        fc_bias="fc.bias" in names or "fusion_fc.bias" in names,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        norm_output=bool(cfg.get("norm_output", False)),
        has_lm_head="lm_head.weight" in names or (dummy and kind == "eagle3"),
        source=str(p),
    )


def _aux_layers(cfg: dict[str, Any], speculators: bool, num_layers: int, p: Path) -> tuple[int, ...]:
    ids: list[int] | None = None
    if speculators:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    else:
        eagle_cfg = cfg.get("eagle_config") or {}
        if eagle_cfg.get("use_aux_hidden_state") is False:
            raise ModelLoadError(f"{p}: EAGLE-3 heads without aux hidden states are not supported")
        raw = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        if raw is not None:
            ids = [int(i) + 1 for i in raw]  # SGLang/SpecForge: output of layer i == input of layer i+1
    out = tuple(int(i) for i in ids) if ids is not None else default_aux_layers(num_layers)
    if not out or any(i < 0 or i >= num_layers for i in out) or list(out) != sorted(set(out)):
        raise ModelLoadError(
            f"EAGLE-3 head {p}: aux layer ids {list(out)} do not fit a target of {num_layers} layers "
            f"(need increasing ids in 0..{num_layers - 1})"
        )
    return out


def load_eagle_head(cfg: EagleConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                    *, dummy: bool = False, seed: int = 0) -> EagleHead:
    """Build the head of ``cfg`` (from :func:`read_eagle_config`) and load its weights, or random
    ones (normal, std 0.02, seeded) with ``dummy``; dtype and device as the target's."""
    head = EagleHead(cfg, max_positions)
    if dummy:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    else:
        tensors = _tensors(resolve_head(cfg.source))
        head.load_weights((name, t) for n, t in tensors if (name := _rename(n)) is not None)
    return head.to(device=device, dtype=dtype)
