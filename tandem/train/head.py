"""The head being trained: its config from the target and the flags, and its initial weights.

The decoder layer is a Llama layer of the target's hidden size (the head shares the target's
embedding); heads, KV heads, head_dim and FFN width default to the target's and can be shrunk to
keep a head small (Gemma 3's 262k vocabulary). Initialisation (EAGLE-3): ``lm_head`` rows are the
target's lm_head (tied embedding) rows of the draft vocabulary, ``norm`` is the target's final norm
(``1 + w`` for Gemma's offset norms), every other matrix is normal(0, 0.02), norms 1, biases 0.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tandem.loader.arch import ModelArch
from tandem.models.decoder import CausalLM
from tandem.models.eagle import EagleConfig, EagleHead, default_aux_layers
from tandem.train.config import TrainConfig
from tandem.train.vocab import DraftVocab

INIT_STD = 0.02


def layer_config(target: ModelArch, cfg: TrainConfig) -> dict[str, Any]:
    """The head layer's HF (Llama) config, as saved in ``transformer_layer_config``."""
    heads = cfg.num_heads or target.num_heads
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": target.hidden_size,
        "intermediate_size": cfg.intermediate_size or target.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_kv_heads or (target.num_kv_heads if heads % target.num_kv_heads == 0 else heads),
        "head_dim": cfg.head_dim or target.head_dim,
        "hidden_act": "silu", "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }
    if target.rope_scaling:
        out["rope_scaling"] = dict(target.rope_scaling)
    return out


def head_config(target: ModelArch, cfg: TrainConfig, vocab: DraftVocab) -> EagleConfig:
    from tandem.errors import ConfigError

    layer = layer_config(target, cfg)
    if layer["num_attention_heads"] % layer["num_key_value_heads"]:
        raise ConfigError("num_kv_heads", f"{layer['num_key_value_heads']} does not divide num_heads "
                          f"{layer['num_attention_heads']}")
    arch = replace(ModelArch.from_hf(layer), num_layers=1)
    if cfg.method == "eagle":
        return EagleConfig(kind="eagle", layer=arch, target_hidden_size=target.hidden_size,
                           draft_vocab_size=target.vocab_size, fc_bias=True, has_lm_head=False, source="train-draft")
    aux = cfg.aux_layers
    if aux is None:  # vLLM's default; shallow targets (< 6 layers) repeat ids there: dedupe them
        aux = tuple(sorted({min(max(i, 0), target.num_layers - 1) for i in default_aux_layers(target.num_layers)}))
    if list(aux) != sorted(set(aux)) or aux[0] < 0 or aux[-1] >= target.num_layers:
        raise ConfigError("aux_layers", f"{list(aux)} must be increasing ids in 0..{target.num_layers - 1}")
    return EagleConfig(kind="eagle3", layer=arch, target_hidden_size=target.hidden_size,
                       draft_vocab_size=vocab.size, aux_layer_ids=tuple(aux),
                       norm_before_residual=cfg.norm_before_residual, norm_before_fc=cfg.norm_before_fc,
                       norm_output=cfg.norm_output,
                       source="train-draft")


def trainable_parameters(head: EagleHead) -> dict[str, torch.nn.Parameter]:
    """The head's own parameters (the bound target embedding registers as a submodule: excluded)."""
    return {n: p for n, p in head.named_parameters() if not n.startswith("_target")}


def head_state(head: EagleHead) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in trainable_parameters(head).items()}


def build_head(ecfg: EagleConfig, target: CausalLM, vocab: DraftVocab, max_positions: int,
               device: torch.device, seed: int) -> EagleHead:
    """A freshly initialised head in float32 on ``device``, bound to the target."""
    head = EagleHead(ecfg, max_positions)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
        if head.lm_head is not None:
            kept = vocab.kept.to(target.lm_head_weight.device)
            head.lm_head.weight.copy_(target.lm_head_weight.detach().index_select(0, kept).float().cpu())
        if ecfg.kind == "eagle3":
            w = target.model.norm.weight.detach().float().cpu()
            head.norm.weight.copy_(w + 1.0 if target.model.norm.offset else w)
    head = head.to(device=device, dtype=torch.float32)
    head.set_vocab_map(vocab.d2t.to(device))
    embed_scale = target.model.embed_scale
    head.bind_target(target.model.embed_tokens, embed_scale, target.lm_head_weight)
    return head


def load_init_head(cfg: TrainConfig, target: ModelArch) -> tuple[EagleConfig, EagleHead]:
    """``cfg.init_head``'s config (checked against the target and the method) and its weights, float32 on the CPU."""
    from tandem.errors import ConfigError
    from tandem.loader.eagle import load_eagle_head, read_eagle_config

    assert cfg.init_head is not None
    ecfg = read_eagle_config(cfg.init_head, target, method=cfg.method)
    if ecfg.kind != cfg.method:
        raise ConfigError("init_head", f"{cfg.init_head!r} is an {ecfg.kind!r} head, not {cfg.method!r}",
                          allowed=[ecfg.kind])
    return ecfg, load_eagle_head(ecfg, 64, torch.float32, torch.device("cpu"))


def copy_weights(head: EagleHead, source: EagleHead) -> None:
    """``source``'s trainable weights into ``head`` (same shapes: built from the same config)."""
    from tandem.errors import ModelLoadError

    theirs, mine = trainable_parameters(source), trainable_parameters(head)
    odd = sorted(n for n in set(theirs) | set(mine)
                 if n not in theirs or n not in mine or theirs[n].shape != mine[n].shape)
    if odd:
        raise ModelLoadError(f"init_head {source.cfg.source}: a head of its config has other weights "
                             f"({', '.join(odd[:4])}); train-draft cannot start from it")
    with torch.no_grad():
        for name, p in mine.items():
            p.copy_(theirs[name].to(p.device, p.dtype))


def count_parameters(head: EagleHead) -> int:
    return sum(p.numel() for p in trainable_parameters(head).values())
