"""ModelArch: one small frozen description of a decoder-only checkpoint.

Every loader (HF directory, GGUF file, dummy) normalises into this, so the model code reads one set
of names. ``from_hf`` takes a Hugging Face ``config.json`` dict; the GGUF loader first builds such a
dict from the file's metadata, so both paths share this one normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.errors import ConfigError, UnsupportedArchitectureError

# HF "architectures" entry → our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}


@dataclass(frozen=True)
class ModelArch:
    family: str  # llama | mistral | qwen2 | qwen3 | gemma3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Gemma3)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    hidden_act: str = "silu"
    # Gemma3 specifics
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @property
    def is_gemma(self) -> bool:
        return self.family == "gemma3"

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @staticmethod
    def from_hf(config: dict[str, Any]) -> ModelArch:
        cfg = dict(config)
        if "text_config" in cfg and isinstance(cfg["text_config"], dict):
            # Multimodal Gemma3 wrappers keep the language model under text_config.
            text = dict(cfg["text_config"])
            text.setdefault("architectures", cfg.get("architectures"))
            cfg = text
        archs = cfg.get("architectures") or []
        if not archs:
            raise ConfigError("architectures", "config.json has no 'architectures' entry",
                              SUPPORTED_ARCHITECTURES)
        name = archs[0]
        if name not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(name, SUPPORTED_ARCHITECTURES)
        family = SUPPORTED_ARCHITECTURES[name]

        def req(key: str) -> Any:
            if key not in cfg:
                raise ConfigError(key, f"missing from config.json of a {name}")
            return cfg[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_params = cfg.get("rope_parameters") or {}
        local_params: dict[str, Any] = {}
        if "full_attention" in rope_params:
            # transformers 5 nests per-layer-type rope settings (Gemma3): global vs sliding layers.
            local_params = dict(rope_params.get("sliding_attention") or {})
            rope_params = dict(rope_params["full_attention"] or {})
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta"))
        rope_scaling = cfg.get("rope_scaling")
        is_gemma = family == "gemma3"
        layer_types: tuple[str, ...] = ()
        local_theta = None
        if is_gemma:
            n = int(req("num_hidden_layers"))
            if cfg.get("layer_types"):
                layer_types = tuple(cfg["layer_types"])
            else:
                pattern = int(cfg.get("sliding_window_pattern", 6))
                layer_types = tuple(
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(n)
                )
            local_theta = float(cfg.get("rope_local_base_freq", local_params.get("rope_theta", 10000.0)))
            if rope_theta is None:
                rope_theta = 1_000_000.0
        if rope_scaling is None and isinstance(rope_params, dict) and rope_params.get("rope_type") not in (None, "default"):
            rope_scaling = dict(rope_params)
        return ModelArch(
            family=family,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family in ("qwen3", "gemma3"),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            sliding_window=(int(cfg["sliding_window"]) if is_gemma and cfg.get("sliding_window") else None),
            layer_types=layer_types,
            rope_local_theta=local_theta,
            query_pre_attn_scalar=(float(cfg["query_pre_attn_scalar"]) if is_gemma and cfg.get("query_pre_attn_scalar") else None),
            final_logit_softcapping=(float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )
