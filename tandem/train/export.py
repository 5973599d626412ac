"""Write a trained head in the layout ``loader/eagle.py`` reads.

- EAGLE-3 → the **speculators** layout: ``config.json`` with ``speculators_model_type: "eagle3"``,
  the layer's Llama config under ``transformer_layer_config``, ``draft_vocab_size``,
  ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (inputs of those layers) and the norm
  flags; ``model.safetensors`` in bf16 with ``fc``, ``layers.0.*`` (q/k/v and gate/up unpacked),
  ``norm``, ``lm_head``, ``d2t`` (int64) and ``t2d`` (bool); no ``embed_tokens``.
- EAGLE-1 → a one-layer ``LlamaForCausalLM`` config and ``fc`` (with bias) + ``layers.0.*`` without
  ``input_layernorm`` (the original EAGLE repository's layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.models.eagle import EagleHead
from tandem.train.head import head_state
from tandem.train.vocab import DraftVocab

_UNPACK = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_tensors(head: EagleHead, vocab: DraftVocab, dtype: torch.dtype = torch.bfloat16
                       ) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors of ``head`` (floats in ``dtype``)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in head_state(head).items():
        t = t.detach().to("cpu", dtype)
        module, _, param = name.rpartition(".")
        if module in _UNPACK:
            packed = head.get_submodule(module)
            for shard in _UNPACK[module]:
                start, size = packed.offsets[shard]
                sub = module.rsplit(".", 1)[0]
                out[f"layers.0.{sub}.{shard}.{param}"] = t[start:start + size].contiguous()
        elif module in ("fc", "norm", "lm_head", "input_norm"):
            out[name] = t.contiguous()
        else:
            out[f"layers.0.{name}"] = t.contiguous()
    if head.cfg.kind == "eagle3":
        out["d2t"] = vocab.d2t.to("cpu", torch.int64)
        out["t2d"] = vocab.t2d.to("cpu")
    return out


def head_config_json(head: EagleHead, layer: dict[str, Any], target_name: str, target_archs: list[str],
                     num_speculative_tokens: int) -> dict[str, Any]:
    cfg = head.cfg
    if cfg.kind == "eagle":
        return {**layer, "bias": cfg.fc_bias}
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.2.0",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
        "norm_output": cfg.norm_output, "fc_norm": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "verifier": {"name_or_path": target_name, "architectures": target_archs},
        },
    }


def save_head(out: Path, head: EagleHead, vocab: DraftVocab, layer: dict[str, Any], target_name: str,
              target_archs: list[str], num_speculative_tokens: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = head_config_json(head, layer, target_name, target_archs, num_speculative_tokens)
    tmp = out / "model.safetensors.tmp"
    save_file(checkpoint_tensors(head, vocab), str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
