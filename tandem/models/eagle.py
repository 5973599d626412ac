"""EAGLE-1 and EAGLE-3 draft heads: one decoder layer attached to the target's hidden states.

Both read the target's token embeddings; they differ in what hidden state they take and where the
logits come from (layouts: ``../shared/research/eagle.md`` §1, loaders in ``loader/eagle.py``):

- **EAGLE-1/2** (``kind="eagle"``): ``g = fc(cat(embed(x_{t+1}), f_t))`` (optional bias), where
  ``f_t`` is the target's final *post-norm* hidden state, then one Llama layer *without*
  ``input_layernorm``; the target's ``lm_head`` is applied to the layer's output directly. Later
  steps feed that output back as ``f``.
- **EAGLE-3** (``kind="eagle3"``): step 0 fuses three target aux hidden states (the inputs of layers
  ``aux_layer_ids``) with ``fc`` (3·H_t → H); the layer's q/k/v read 2H =
  ``cat(input_layernorm(embed), hidden_norm(g))``, the residual is ``g`` (or ``hidden_norm(g)`` with
  ``norm_before_residual``); its own ``norm`` and ``lm_head`` over a reduced draft vocabulary whose
  ids map to the target's through ``d2t`` (``target = draft + d2t[draft]``). Later steps feed back
  the layer's pre-norm output (post-norm with ``norm_output``) without ``fc``.

Inference runs the layer through the same ``ForwardContext`` as the target (layer kernels, the
attention backend, the head's own one-layer paged KV cache). Training (``train/``) calls the pieces
(``embed``, ``fuse``, ``qkv``, ``finish``, ``logits``) around its own attention.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.loader.arch import ModelArch
from tandem.models.decoder import Attention
from tandem.models.forward_context import ForwardContext, LayerKernels, ResidualStream
from tandem.models.layers import GatedMLP, Linear, RMSNorm, Rotary, linear

EAGLE_KINDS: tuple[str, ...] = ("eagle", "eagle3")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layers: the inputs of layers 2, N//2 and N-3."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class EagleConfig:
    kind: str  # "eagle" | "eagle3"
    layer: ModelArch  # the head's decoder layer (num_layers = 1; vocab_size = the target's)
    target_hidden_size: int
    draft_vocab_size: int  # == layer.vocab_size when the head predicts the full vocabulary
    aux_layer_ids: tuple[int, ...] = ()  # eagle3: inputs of these target layers, low → high
    fc_bias: bool = False
    norm_before_residual: bool = False  # eagle3 (speculators): residual = hidden_norm(g)
    norm_before_fc: bool = False  # eagle3.1: one RMSNorm over the 3·H_t concat (``input_norm``)
    norm_output: bool = False  # eagle3.1: feed the post-norm hidden back
    has_lm_head: bool = True  # eagle3 heads carry their own; eagle uses the target's
    # provenance, kept for error messages and `tandem models`
    source: str = field(default="", compare=False)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def fc_in_features(self) -> int:
        if self.kind == "eagle":
            return 2 * self.hidden_size
        return len(self.aux_layer_ids) * self.target_hidden_size

    def feature_layers(self, target_layers: int) -> tuple[int, ...]:
        """Target layers whose input hidden states the head reads (``target_layers``: the final
        post-norm hidden state, EAGLE-1's feature)."""
        return self.aux_layer_ids if self.kind == "eagle3" else (target_layers,)

    @property
    def target_feature_size(self) -> int:
        """Width of the target features the head reads per token (what the runner must return)."""
        if self.kind == "eagle":
            return self.target_hidden_size
        return self.fc_in_features


class EagleHead(nn.Module):
    """The head's parameters and its forward. Parameter names are the EAGLE-3 checkpoint's
    (``midlayer.*`` ↔ ``layers.0.*`` is mapped by the loader); q/k/v and gate/up are packed."""

    def __init__(self, cfg: EagleConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        arch = cfg.layer
        h = arch.hidden_size
        self.fc = Linear(cfg.fc_in_features, h, bias=cfg.fc_bias)
        rotary = Rotary(arch.head_dim, arch.rope_theta, max_positions, arch.rope_scaling)
        qkv_in = 2 * h if cfg.kind == "eagle3" else h
        self.self_attn = Attention(arch, 0, rotary, in_features=qkv_in)
        self.mlp = GatedMLP(h, arch.intermediate_size, arch.hidden_act)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps)
        if cfg.kind == "eagle3":
            self.input_layernorm = RMSNorm(h, arch.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, arch.rms_norm_eps)
            self.norm = RMSNorm(h, arch.rms_norm_eps)
            self.input_norm = RMSNorm(cfg.fc_in_features, arch.rms_norm_eps) if cfg.norm_before_fc else None
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False) if cfg.has_lm_head else None
        # draft id → target id (identity when the head predicts the full vocabulary)
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=False)
        # the target's embedding (and, for heads without their own, lm_head): bound, not owned
        self._target_embed: nn.Embedding | None = None
        self._target_embed_scale: float | None = None
        self._target_lm_head: torch.Tensor | None = None

    # ---- binding to the target -----------------------------------------------------------------
    def bind_target(self, embed: nn.Embedding, embed_scale: float | None, lm_head_weight: torch.Tensor) -> None:
        """Share the target's embedding (and its lm_head when the head has none); checks shapes."""
        if embed.weight.shape[1] != self.cfg.hidden_size:
            raise ModelLoadError(
                f"EAGLE head hidden size {self.cfg.hidden_size} does not match the target's embedding "
                f"width {embed.weight.shape[1]}"
            )
        if embed.weight.shape[0] != self.cfg.layer.vocab_size:
            raise ModelLoadError(
                f"EAGLE head vocabulary {self.cfg.layer.vocab_size} does not match the target's "
                f"{embed.weight.shape[0]}"
            )
        # object.__setattr__: shared, not registered as this module's parameters (state_dict, .to())
        object.__setattr__(self, "_target_embed", embed)
        self._target_embed_scale = embed_scale
        object.__setattr__(self, "_target_lm_head", lm_head_weight)

    def set_vocab_map(self, d2t: torch.Tensor) -> None:
        """EAGLE-3 offsets: target id = draft id + d2t[draft id]."""
        if d2t.shape != (self.cfg.draft_vocab_size,):
            raise ModelLoadError(f"d2t has shape {tuple(d2t.shape)}, expected ({self.cfg.draft_vocab_size},)")
        ids = torch.arange(self.cfg.draft_vocab_size, device=d2t.device) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.layer.vocab_size:
            raise ModelLoadError("d2t maps draft ids outside the target vocabulary")
        self.draft_to_target.copy_(ids.to(self.draft_to_target.device))

    # ---- pieces (inference and training share them) -------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._target_embed is None:
            raise RuntimeError("EAGLE head is not bound to a target (bind_target)")
        x = self._target_embed(token_ids)
        if self._target_embed_scale is not None:
            x = x * torch.tensor(self._target_embed_scale, dtype=x.dtype)
        return x

    def fuse(self, features: torch.Tensor, kernels: LayerKernels | None = None) -> torch.Tensor:
        """EAGLE-3 step 0: the concatenated aux hidden states [T, 3·H_t] → g [T, H]."""
        if kernels is None:
            if self.cfg.norm_before_fc:
                features = self.input_norm(features)
            return self.fc(features)
        if self.cfg.norm_before_fc:
            return kernels.norm_linear(ResidualStream(features), self.input_norm, self.fc)
        return kernels.linear(features, self.fc)

    def step0_hidden(self, features: torch.Tensor, kernels: LayerKernels | None = None) -> torch.Tensor:
        """Target features [T, F] → the hidden input of a proposal's first step (EAGLE-3: ``fuse``;
        EAGLE-1: the final hidden state as it is)."""
        features = features.to(self.fc.weight.dtype)
        return self.fuse(features, kernels) if self.cfg.kind == "eagle3" else features

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed q/k/v projection and the residual for token embeddings and hidden inputs."""
        k = ctx.kernels if ctx is not None else None
        attn = self.self_attn
        if self.cfg.kind == "eagle":
            x = self.fc(torch.cat((embeds, hidden), dim=-1))
            residual = x
        else:
            h = self._norm(self.hidden_norm, hidden, k)
            residual = h if self.cfg.norm_before_residual else hidden
            x = torch.cat((self._norm(self.input_layernorm, embeds, k), h), dim=-1)
        qkv = k.linear(x, attn.qkv_proj) if k is not None else attn.qkv_proj(x)
        return qkv, residual

    @staticmethod
    def _norm(norm: RMSNorm, x: torch.Tensor, kernels: LayerKernels | None) -> torch.Tensor:
        """``norm(x)``, through the step's kernels when there are some (one fused kernel on CUDA)."""
        return norm(x) if kernels is None else kernels.final_norm(ResidualStream(x), norm)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor, ctx: ForwardContext | None = None
               ) -> torch.Tensor:
        """o_proj + residual, then the MLP block: the layer's pre-norm output [T, H]."""
        if ctx is None:
            x = residual + self.self_attn.o_proj(attn_out)
            return x + self.mlp.down_proj(self.mlp.act_mul(self.mlp.gate_up_proj(self.post_attention_layernorm(x))))
        k = ctx.kernels
        # (fused kernels add into the stream in place: with EAGLE-3's residual = the hidden input,
        # that input is the caller's to give up — the CUDA head runner passes its own copies)
        stream = k.linear_add(attn_out, self.self_attn.o_proj, ResidualStream(residual))
        stream = k.linear_add(k.norm_gated_mlp_in(stream, self.post_attention_layernorm, self.mlp),
                              self.mlp.down_proj, stream)
        return k.hidden(stream)

    def feedback(self, out: torch.Tensor, kernels: LayerKernels | None = None) -> torch.Tensor:
        """What the next draft step receives as its hidden input."""
        if self.cfg.kind == "eagle3" and self.cfg.norm_output:
            return self._norm(self.norm, out, kernels)
        return out

    def logits(self, out: torch.Tensor, kernels: LayerKernels | None = None) -> torch.Tensor:
        """Float32 logits over the draft vocabulary [T, draft_vocab] (``kernels``: the step's layer
        kernels — on CUDA the norm and the LM head in one skinny matmul, logits rounded to the model
        dtype first: they only pick the draft)."""
        if kernels is not None and self.lm_head is not None:
            if self.cfg.kind == "eagle3":
                return kernels.norm_linear(ResidualStream(out), self.norm, self.lm_head).float()
            return kernels.linear(out, self.lm_head).float()
        if self.cfg.kind == "eagle3":
            out = self.norm(out)
        if self.lm_head is not None:  # its own (a SkinnyLinear on the CPU: models/skinny_linear.py)
            return self.lm_head(out).float()
        if self._target_lm_head is None:
            raise RuntimeError("EAGLE head has no lm_head and is not bound to a target")
        return linear(out, self._target_lm_head).float()  # on CPU, few rows: the split GEMV (layers.linear)

    # ---- inference ------------------------------------------------------------------------------
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """One step over a flat batch: ``token_ids`` [T] (each row's *next* token), ``hidden`` [T, H]
        (the fused target features at step 0, the previous feedback later). Returns the pre-norm
        output [T, H]; ``logits``/``feedback`` finish the rows that are needed."""
        qkv, residual = self.qkv(self.embed(token_ids), hidden, ctx)
        attn_out = self.self_attn.attend(qkv, positions, ctx, ctx.kv_caches[0])
        return self.finish(attn_out, residual, ctx)

    # ---- weights ----------------------------------------------------------------------------------
    _PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as this module's parameters (after the loader's renaming; q/k/v and
        gate/up by their HF names) and the ``d2t`` map; raise on unknown, misshapen or missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        packed: dict[str, set[str]] = {}
        for name, tensor in weights:
            if name == "d2t":
                self.set_vocab_map(tensor)
                continue
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] in self._PACKED:
                mod_name = ".".join(parts[:-2] + [self._PACKED[parts[-2]]])
                try:
                    module = self.get_submodule(mod_name)
                    module.load_shard(parts[-2], parts[-1], tensor)
                except (AttributeError, KeyError, ValueError) as e:
                    raise ModelLoadError(f"EAGLE head weight {name!r}: {e}") from None
                packed.setdefault(f"{mod_name}.{parts[-1]}", set()).add(parts[-2])
                continue
            if name not in params:
                raise ModelLoadError(f"unexpected weight {name!r} in the EAGLE head checkpoint")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"EAGLE head weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}"
                    f" (does the head fit this target? {self.cfg.source})"
                )
            with torch.no_grad():
                p.copy_(tensor)
            loaded.add(name)
        for pname, shards in packed.items():
            if shards == set(self.get_submodule(pname.rsplit(".", 1)[0]).shards):
                loaded.add(pname)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"EAGLE head checkpoint is missing weights: {', '.join(missing[:5])}")
