"""Decoder-only transformer covering Llama, Mistral, Qwen2, Qwen3 and Gemma3 through ModelArch flags.

Differences are flags, not copies: qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma3), tied
embeddings, Gemma's (1 + w) norms, sandwich norms around attention and MLP, scaled embeddings,
sliding-window layers with their own rope base, and final logit soft-capping.

``forward(input_ids [T], positions [T], ctx)`` runs over a flat batch of query tokens (prefill
chunks, decodes and k+1-token verifies alike); ``compute_logits`` is applied only to the rows that
are sampled. This is the one forward of every device: the runner picks per step which layer kernels
(torch reference, skinny Triton matmuls, cuBLAS with fused norms) and which attention backend run it,
through ``ctx`` (``models/forward_context.py``). ``aux_layers`` returns the hidden states entering
chosen layers (residual stream included: what EAGLE-3 heads read) without a second copy of this code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import ConfigError, ModelLoadError
from tandem.loader.arch import ModelArch
from tandem.models.forward_context import ForwardContext, KVCache, ResidualStream
from tandem.models.layers import GatedMLP, Linear, PackedLinear, RMSNorm, Rotary, linear
from tandem.models.quant.attach import QuantizedLinears
from tandem.models.quant.screened_head import ScreenedHead
from tandem.models.quant.weights import QuantizedWeight

__all__ = ["Attention", "CausalLM", "DecoderLayer", "DecoderModel", "KVCache"]


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, rotary: Rotary, in_features: int | None = None) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        # in_features: an EAGLE-3 head's q/k/v read 2H (embedding and hidden state side by side)
        self.qkv_proj = PackedLinear(in_features or arch.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv},
                                     bias=arch.attention_bias)
        self.o_proj = Linear(q, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, offset=arch.is_gemma)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, offset=arch.is_gemma)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.scale = arch.attn_scale
        self.sliding_window = arch.sliding_window if arch.is_sliding(layer) else None
        self.q_size, self.kv_size = q, kv

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               kv_cache: KVCache) -> torch.Tensor:  # [T, H * D], before o_proj
        """Rope, KV write and attention over the packed projection ``qkv``, by the step's backend."""
        return ctx.attention.forward(self, qkv, positions, ctx.meta, kv_cache)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, rotary: Rotary) -> None:
        super().__init__()
        gemma = arch.is_gemma
        self.self_attn = Attention(arch, layer, rotary)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=gemma)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=gemma)
        self.sandwich = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=True)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=True)

    def forward(self, stream: ResidualStream, positions: torch.Tensor, ctx: ForwardContext,
                kv_cache: KVCache) -> ResidualStream:
        k = ctx.kernels
        attn, mlp = self.self_attn, self.mlp
        if self.sandwich:  # Gemma 3: norms around attention and MLP outputs too (torch kernels only)
            x = k.hidden(stream)
            h = attn.attend(k.linear(self.input_layernorm(x), attn.qkv_proj), positions, ctx, kv_cache)
            x = x + self.post_attention_layernorm(k.linear(h, attn.o_proj))
            h = mlp.act_mul(k.linear(self.pre_feedforward_layernorm(x), mlp.gate_up_proj))
            return ResidualStream(x + self.post_feedforward_layernorm(k.linear(h, mlp.down_proj)))
        # x = x + o_proj(attn(norm(x))); x = x + down(act(gate) * up)(norm(x)), with fusions per backend
        qkv = k.norm_linear(stream, self.input_layernorm, attn.qkv_proj)
        stream = k.linear_add(attn.attend(qkv, positions, ctx, kv_cache), attn.o_proj, stream)
        return k.linear_add(k.norm_gated_mlp_in(stream, self.post_attention_layernorm, mlp), mlp.down_proj, stream)


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        rotary = Rotary(arch.head_dim, arch.rope_theta, max_positions, arch.rope_scaling)
        local = rotary
        if arch.rope_local_theta is not None:
            local = Rotary(arch.head_dim, arch.rope_local_theta, max_positions, None)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, local if arch.is_sliding(i) else rotary) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, offset=arch.is_gemma)
        self.embed_scale = math.sqrt(arch.hidden_size) if arch.is_gemma else None


def _logits_float32(hidden: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """hidden @ w^T as float32. On CUDA with 16-bit weights the product is accumulated and stored in
    float32 (``mm(..., out_dtype)``) instead of being rounded to bf16/fp16 first: bf16 logits of a
    49k-token vocabulary tie often (0.125 apart at |logit| ~ 20), which made greedy picks depend on
    accumulation order. Same bytes read; falls back where the op is missing (older torch)."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and hidden.dim() == 2:
        try:
            return torch.mm(hidden, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return linear(hidden, w).float()


class CausalLM(nn.Module):
    """The full model. Parameter names follow HF except packed qkv_proj / gate_up_proj."""

    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch, max_positions)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx: ForwardContext,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # final-normed hidden [T, H], aux hidden states
        m = self.model
        x = m.embed_tokens(input_ids)
        if m.embed_scale is not None:
            x = x * torch.tensor(m.embed_scale, dtype=x.dtype)
        stream = ResidualStream(x)
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            if i in aux_layers:
                aux.append(ctx.kernels.hidden(stream))
            stream = layer.forward(stream, positions, ctx, ctx.kv_caches[i])  # no hooks: skip __call__
        return ctx.kernels.final_norm(stream, m.norm), aux

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, H] (the embedding when tied)
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    lm_head_lowp: torch.Tensor | None = None  # configure_lm_head's fp16 copy (CPU), not in the state dict
    screened_head: ScreenedHead | None = None  # screen_lm_head's argmax path (CPU), not in the state dict
    # onednn_linear.prepack_float_linears's multi-row path for a float32 head (CPU), not in the state dict
    lm_head_onednn: Callable[[torch.Tensor], torch.Tensor] | None = None

    def configure_lm_head(self, dtype: str = "auto") -> None:
        """``ModelConfig.lm_head_dtype``, once the weights are loaded: "float16" keeps an fp16 copy of
        the head weight (the tied embedding stays float for its row lookups) for ``compute_logits``
        (CPU only; docs/quantization.md); "auto" keeps the model-dtype head."""
        w = self.lm_head_weight
        if dtype not in ("auto", "float16"):
            raise ConfigError("lm_head_dtype", f"unknown value {dtype!r}", allowed=["auto", "float16"])
        if dtype == "float16":
            if w.device.type != "cpu":
                raise ConfigError("lm_head_dtype", f"{dtype!r} is a CPU option (the model is on {w.device.type})",
                                  allowed=["auto"])
            self.lm_head_lowp = w.detach().to(torch.float16).contiguous()

    def screen_lm_head(self) -> bool:
        """Give argmax-only rows a ``ScreenedHead`` (models/quant/screened_head.py) over the float32
        head weight, on the CPU: the same argmax, several times faster. Returns whether it applies."""
        if self.lm_head_lowp is None and not self.arch.final_logit_softcapping:
            self.screened_head = ScreenedHead.build(self.lm_head_weight.detach())
        return self.screened_head is not None

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """[N, H] → [N, V] float32 logits. ``argmax_only``: the caller reads nothing but each row's
        argmax (greedy rows with no logits processing or logprobs), which may then come from the
        screened head, whose other entries are not logits."""
        if argmax_only and self.screened_head is not None and self.lm_head_lowp is None:
            return self.screened_head.argmax_logits(hidden)
        if self.lm_head_lowp is not None:
            # F.linear in fp16 is row-invariant on CPU (a verify row's logits are a decode's, bitwise)
            logits = F.linear(hidden.to(torch.float16), self.lm_head_lowp).float()
        elif self.lm_head_onednn is not None and hidden.dtype is torch.float32:
            logits = self.lm_head_onednn(hidden)
        else:
            logits = _logits_float32(hidden, self.lm_head_weight)
        cap = self.arch.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- weight loading -------------------------------------------------------------------------
    _PACKED = {
        "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
                     pack_quantized: bool = True) -> None:
        """Copy HF-named tensors into the parameters; raise if any parameter stays unloaded.

        A :class:`QuantizedWeight` becomes a packed kernel module (``models/quant/attach.py``) when
        ``pack_quantized`` (the CPU), else it is dequantized into the float parameter."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        packed_loaded: dict[str, set[str]] = {}
        quant = QuantizedLinears(self._PACKED, pack_quantized)
        shard_sets = {n: set(m.shards) for n, m in self.named_modules() if isinstance(m, PackedLinear)}
        for name, tensor in weights:
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # tied checkpoints may still ship a copy
            if "rotary_emb" in name:
                continue
            if isinstance(tensor, QuantizedWeight):
                if quant.add(self, name, tensor):
                    continue  # held for a packed kernel module
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] in self._PACKED:
                shard, pname = parts[-2], parts[-1]
                mod_name = ".".join(parts[:-2] + [self._PACKED[shard]])
                try:
                    module = self.get_submodule(mod_name)
                except AttributeError:
                    raise ModelLoadError(f"unexpected weight {name!r} in checkpoint") from None
                module.load_shard(shard, pname, tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor)
                packed_loaded.setdefault(f"{mod_name}.{pname}", set()).add(shard)
                continue
            if name not in params:
                raise ModelLoadError(f"unexpected weight {name!r} in checkpoint")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(p.shape)}"
                )
            with torch.no_grad():
                if isinstance(tensor, QuantizedWeight):
                    tensor.dequantize(out=p.data)  # in row chunks, straight into the parameter
                else:
                    p.copy_(tensor)
            loaded.add(name)
        done, float_shards = quant.finish(self)  # packed modules swapped in; mixed ones made float
        loaded |= done
        for pname, shards in float_shards.items():
            packed_loaded.setdefault(pname, set()).update(shards)
        for pname, shards in packed_loaded.items():
            if shards == shard_sets[pname.rsplit(".", 1)[0]]:
                loaded.add(pname)
        missing = sorted(set(params) - loaded)
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
