"""``TrainConfig``: every knob of ``tandem train-draft``, validated once (bad values are a
``ConfigError`` naming the flag's key)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from tandem.errors import ConfigError

METHODS = ("eagle3", "eagle")


@dataclass(frozen=True)
class TrainConfig:
    target: str
    out: str
    method: str = "eagle3"
    # data
    data: str | None = None  # JSONL of prompts; None: ShareGPT first user turns
    num_prompts: int = 8000
    val_prompts: int = 64
    max_tokens: int = 256
    temperature: float = 0.0
    max_prompt_tokens: int = 512
    data_cache: str | None = None  # generated-data file; None: OUT/cache/data.pt
    gen_procs: int = 1  # processes that answer the prompts, each with its own engine on the device
    # head shape
    init_head: str | None = None  # a head (directory or alias) to start from: its shape, vocabulary and weights
    draft_vocab_size: int = 4096
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    aux_layers: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states (Gemma's are ~10x Llama's)
    norm_output: bool = False
    # training
    ttt_steps: int = 5
    step_decay: float = 0.8
    batch_tokens: int | None = None  # None: 8192 on CUDA, 1024 on CPU
    lr: float = 3e-4
    warmup: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    epochs: int = 2
    max_steps: int | None = None
    val_every: int = 200
    time_budget_s: float | None = None  # whole command: generation + training + final eval
    eval_reserve_s: float = 60.0  # kept for the final evaluation when a time budget is set
    eval_k: tuple[int, ...] = (3, 5)
    eval_prompts: int | None = None  # None: all held-out prompts
    device: str = "auto"
    seed: int = 0
    resume: bool = False
    checkpoint_every: int = 500

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("method", f"unknown method {self.method!r}", METHODS)
        positive = {"num_prompts": self.num_prompts, "max_tokens": self.max_tokens,
                    "max_prompt_tokens": self.max_prompt_tokens, "draft_vocab_size": self.draft_vocab_size,
                    "ttt_steps": self.ttt_steps, "epochs": self.epochs, "val_every": self.val_every,
                    "checkpoint_every": self.checkpoint_every, "gen_procs": self.gen_procs}
        for key in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size", "batch_tokens", "eval_prompts"):
            if getattr(self, key) is not None:
                positive[key] = getattr(self, key)
        for key, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"must be an integer >= 1, got {value!r}")
        if self.val_prompts < 1:
            raise ConfigError("val_prompts", f"must be >= 1 (held-out prompts), got {self.val_prompts!r}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ConfigError("max_steps", f"must be >= 0, got {self.max_steps!r}")
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr!r}")
        if not 0 <= self.warmup < 1:
            raise ConfigError("warmup", f"must be a fraction in [0, 1), got {self.warmup!r}")
        if not self.grad_clip > 0:
            raise ConfigError("grad_clip", f"must be > 0, got {self.grad_clip!r}")
        if not 0 < self.step_decay <= 1:
            raise ConfigError("step_decay", f"must be in (0, 1], got {self.step_decay!r}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ConfigError("time_budget_s", f"must be > 0, got {self.time_budget_s!r}")
        if any(k < 1 for k in self.eval_k):
            raise ConfigError("eval_k", f"speculative token counts must be >= 1, got {list(self.eval_k)}")
        if self.aux_layers is not None and self.method == "eagle":
            raise ConfigError("aux_layers", "only EAGLE-3 heads read aux layers (method eagle3)")
        if self.init_head is not None:
            shaped = [k for k in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size", "aux_layers")
                      if getattr(self, k) is not None]
            shaped += [k for k in ("norm_before_residual", "norm_before_fc", "norm_output") if getattr(self, k)]
            if shaped:
                raise ConfigError(shaped[0], f"the head's shape comes from init_head {self.init_head!r}; "
                                  f"drop {', '.join(shaped)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError("device", f"unknown device {self.device!r}", ("auto", "cpu", "cuda"))

    def with_shape_of(self, head: Any) -> TrainConfig:
        """This config with the head-shape fields of ``head`` (an ``EagleConfig``): what ``init_head``
        fixes (the draft vocabulary comes from its ``d2t``)."""
        layer = head.layer
        return replace(self, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
                       intermediate_size=layer.intermediate_size,
                       aux_layers=tuple(head.aux_layer_ids) if head.kind == "eagle3" else None,
                       norm_before_residual=head.norm_before_residual, norm_before_fc=head.norm_before_fc,
                       norm_output=head.norm_output, init_head=None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def generation_key(self) -> dict[str, Any]:
        """What the generated data depends on (a cached data file is reused only when this matches)."""
        return {"target": self.target, "data": self.data, "num_prompts": self.num_prompts,
                "val_prompts": self.val_prompts, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "max_prompt_tokens": self.max_prompt_tokens, "seed": self.seed}
