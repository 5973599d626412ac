"""The CPU lone-decode step as one TorchScript function: batch-1 decode of a packed int4 model.

A batch-1 decode step on the 2-core CPU spends more time in Python and per-op dispatch (~2,300
torch-level calls, docs/performance.md §16–§19) than in its kernels. :func:`decode_layers` runs the
whole decoder stack for one token in the TorchScript interpreter: **the same ATen ops, in the same
order, on the same operands** as the eager path (``models/decoder.py`` with ``models/torch_kernels.py``,
``quant/int4pack.py`` and ``worker/attention.py``'s lone-decode branch), so its output is bitwise the
eager one (``tests/worker/test_lone_decode.py``); only the Python between the ops is gone. TorchScript's
CPU fuser is off by default (``torch._C._jit_can_fuse_on_cpu()``): nothing is fused or reordered;
:class:`LoneDecoder` refuses to run if someone turned it on.

:class:`LoneDecoder` takes a model only when every layer is the plain Llama shape on the packed int4
kernel (``Q4Linear``, or int4pack with one plane; no act-order, no bias, no q/k norm, no sandwich norms
or sliding window,
silu, float32 activations and KV cache); ``TorchRunner`` uses it for a step of one request with 1–8
new tokens whose logits are all wanted (a decode or a verify; EAGLE's aux hidden states included) and
falls back to the eager forward for everything else (prefill, batches, batch-invariant mode).
"""

import logging
import warnings
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from tandem.models.decoder import CausalLM, KVCache
from tandem.models.quant import cpu_q4  # noqa: F401 - registers torch.ops.tandem.q4_mm before scripting
from tandem.models.quant.int4pack import Int4PackLinear
from tandem.models.quant.q4_linear import Q4Linear
from tandem.worker import cpu_attention  # noqa: F401 - registers torch.ops.tandem.lone_attention before scripting

logger = logging.getLogger("tandem")


@torch.jit.ignore
def _set_threads(n: int) -> int:  # torch.set_num_threads is not a TorchScript builtin
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    return prev


def _attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, scale: float) -> torch.Tensor:
    """attention.py::_grouped_attention for one query row [1, h, d] over k, v [ctx, kvh, d]."""
    h, d = q.shape[1], q.shape[2]
    scores = torch.bmm(q.reshape(kv_heads, h // kv_heads, d), k.permute(1, 2, 0)).mul_(scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.bmm(probs, v.transpose(0, 1)).view(1, h, d)


def _norm_mm(x: torch.Tensor, norm: torch.Tensor, eps: float, packed: torch.Tensor, group: int,
             scale_zeros: torch.Tensor, q4: bool) -> torch.Tensor:
    """packed(rms_norm(x)): ``Q4Linear.forward_norm`` (the norm in the kernel, float32 out) or
    ``Int4PackLinear(RMSNorm(x))`` (bf16 out)."""
    if q4:
        return torch.ops.tandem.q4_mm(x, packed, group, norm, eps)
    h = torch.rms_norm(x, [x.shape[1]], norm, eps).to(torch.bfloat16)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(h, packed, group, scale_zeros)


def _mm_add(x: torch.Tensor, h: torch.Tensor, packed: torch.Tensor, group: int, scale_zeros: torch.Tensor,
            q4: bool) -> torch.Tensor:
    """x + packed(h) (bf16 h): the add inside ``Q4Linear``'s kernel, or the residual add taking
    int4pack's bf16 output by type promotion (torch_kernels.py)."""
    if q4:
        return torch.ops.tandem.q4_mm(h, packed, group, None, 0.0, x)
    return x + torch.ops.aten._weight_int4pack_mm_for_cpu(h, packed, group, scale_zeros)


def decode_layers(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slot_start: int,
                  slots: Optional[torch.Tensor], ctx_slots: Optional[torch.Tensor], ctx_start: int, ctx_stop: int,
                  norms: list[torch.Tensor], packed: list[torch.Tensor], scale_zeros: list[torch.Tensor],
                  groups: list[int], k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                  eps: float, heads: int, kv_heads: int, head_dim: int, inter: int, scale: float,
                  one_thread_attention: bool, aux_layers: list[int], q4: bool,
                  c_attn: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All layers for the ``t`` new tokens of one request (a decode, t = 1, or a verify / short chunk,
    t ≤ 8): x [t, H] float32 (the embeddings) → the stream before the final norm.

    Per layer ``i``: ``norms[2i]`` / ``norms[2i + 1]`` (input / post-attention), and four packed
    linears at ``4i + 0..3`` (qkv, o, gate_up, down): all ``Q4Linear`` (``q4``) or all
    ``Int4PackLinear``. The new tokens' K/V go to cache rows
    ``slot_start ..`` (consecutive: a copy into a view, the bytes ``index_copy_`` writes) or, when
    ``slots`` is given, to those rows. The context (new tokens included) is the cache
    rows ``ctx_start:ctx_stop`` (consecutive slots) or, when ``ctx_slots`` is given, those rows
    gathered. Row r of a t-row step attends over the context a decode at its position sees, as the
    eager lone-verify path does (``attention.py::_Plan``). Also returns the stream entering each
    layer of ``aux_layers`` (ascending), as ``CausalLM.forward`` does (the EAGLE features)."""
    t = x.shape[0]
    q_size = heads * head_dim
    qk_size = (heads + kv_heads) * head_dim
    n = ctx_stop - ctx_start
    aux: list[torch.Tensor] = []
    for i in range(len(k_caches)):
        if i in aux_layers:
            aux.append(x)
        j = 4 * i
        k_cache, v_cache = k_caches[i], v_caches[i]
        # qkv = packed(rms_norm(x)), cast back to the activation dtype (Int4PackLinear/Q4Linear.forward)
        qkv = _norm_mm(x, norms[2 * i], eps, packed[j], groups[j], scale_zeros[j], q4).to(x.dtype)
        if c_attn:  # cpu_attention.py: rope, KV write (torch's bits) and every row's attention in C
            o = torch.ops.tandem.rope_attention(qkv, cos, sin_signed, k_cache, v_cache, heads, slot_start, slots,
                                                ctx_start, ctx_slots, n, scale)
        else:
            # rope on q and k as one tensor (attention.py::_rope_qk, Rotary.rotate)
            qk = qkv[:, :qk_size].reshape(t, heads + kv_heads, head_dim)
            qk = qk * cos + torch.roll(qk, head_dim // 2, dims=-1) * sin_signed
            v = qkv[:, qk_size:].reshape(t, kv_heads, head_dim)
            q, k = qk[:, :heads], qk[:, heads:]
            if slots is None:
                k_cache[slot_start:slot_start + t].copy_(k)
                v_cache[slot_start:slot_start + t].copy_(v)
            else:
                k_cache.index_copy_(0, slots, k)
                v_cache.index_copy_(0, slots, v)
            threads = _set_threads(1) if one_thread_attention else 1
            if ctx_slots is None:
                kc, vc = k_cache[ctx_start:ctx_stop], v_cache[ctx_start:ctx_stop]
            else:
                kc, vc = k_cache.index_select(0, ctx_slots), v_cache.index_select(0, ctx_slots)
            if t == 1:
                o = _attend_row(q, kc, vc, kv_heads, scale)
            else:
                o = torch.empty_like(q)
                for r in range(t):
                    c = n - t + 1 + r
                    o[r:r + 1] = _attend_row(q[r:r + 1], kc[:c], vc[:c], kv_heads, scale)
            if one_thread_attention:
                _set_threads(threads)
        o = o.reshape(t, q_size).to(torch.bfloat16)
        x = _mm_add(x, o, packed[j + 1], groups[j + 1], scale_zeros[j + 1], q4)
        gu = _norm_mm(x, norms[2 * i + 1], eps, packed[j + 2], groups[j + 2], scale_zeros[j + 2], q4)
        a = (F.silu(gu[:, :inter].float()) * gu[:, inter:]).to(torch.bfloat16)
        x = _mm_add(x, a, packed[j + 3], groups[j + 3], scale_zeros[j + 3], q4)
    return x, aux


_scripted = None


def _script():  # type: ignore[no-untyped-def]
    global _scripted
    if _scripted is None:
        with warnings.catch_warnings():  # "torch.jit.script is deprecated": still the cheapest interpreter
            warnings.simplefilter("ignore", DeprecationWarning)
            _scripted = torch.jit.script(decode_layers)
    return _scripted


def _plain_int4(m: object, q4: bool) -> bool:
    if q4:
        return isinstance(m, Q4Linear) and m.perm is None and m.bias is None
    return isinstance(m, Int4PackLinear) and m.planes == 1 and m.perm is None and m.bias is None


class LoneDecoder:
    """The scripted decode for one model, or ``LoneDecoder.build`` returns None when it does not fit."""

    MAX_ROWS = 8  # attention.py's _BATCHED_MAX_QUERY: longer queries take the eager SDPA path
    # Attention on one intra-op thread, as the eager lone query (§17: a 2-thread softmax stalled under
    # load). The switch (two set_num_threads per layer) costs 0.3–0.8 ms per step on a quiet machine,
    # but without it one A/B round under load fell to 7 tok/s while the switching tree kept 51
    # (docs/performance.md §19). The bits do not depend on it (tests/worker/test_lone_decode.py).
    ONE_THREAD_ATTENTION = True

    def __init__(self, model: CausalLM, kv_caches: Sequence[KVCache], block_size: int, fn,  # type: ignore[no-untyped-def]
                 c_attn: bool = False) -> None:
        m, arch = model.model, model.arch
        self.model = model
        self.block_size = block_size
        self.embed = m.embed_tokens.weight
        self.final_norm = m.norm
        layers = list(m.layers)
        self.norms = [t for layer in layers
                      for t in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        mods = [mod for layer in layers for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.packed = [mod.packed for mod in mods]
        self.q4 = isinstance(mods[0], Q4Linear)
        none = torch.empty(0)
        self.scale_zeros = [none if self.q4 else mod.scale_zeros for mod in mods]
        self.groups = [mod.group for mod in mods]
        self.k_caches = [kv[0] for kv in kv_caches]
        self.v_caches = [kv[1] for kv in kv_caches]
        attn = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = float(attn.scale)
        self.eps = float(arch.rms_norm_eps)
        self.inter = layers[0].mlp.intermediate
        self.cos, self.sin = attn.rotary.cos, attn.rotary.sin
        self.fn = fn
        self.c_attn = c_attn

    @staticmethod
    def build(model: CausalLM, kv_caches: Sequence[KVCache], block_size: int,
              cpu_attention: bool = False) -> "LoneDecoder | None":
        """A LoneDecoder if ``model`` (on the CPU) has the one layer shape it runs, else None."""
        m, arch = model.model, model.arch
        if m.embed_tokens.weight.device.type != "cpu" or m.embed_tokens.weight.dtype != torch.float32:
            return None
        if m.embed_scale is not None or not len(m.layers) or len(kv_caches) != len(m.layers):
            return None
        if any(k.dtype != torch.float32 or v.dtype != torch.float32 for k, v in kv_caches):
            return None
        rotary = m.layers[0].self_attn.rotary
        q4 = isinstance(m.layers[0].self_attn.qkv_proj, Q4Linear)
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (layer.sandwich or a.q_norm is not None or a.sliding_window is not None or a.rotary is not rotary
                    or mlp.act is not F.silu or any(n.offset or n.eps != arch.rms_norm_eps for n in norms)
                    or not all(_plain_int4(x, q4) for x in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj))
                    or (a.num_heads, a.num_kv_heads, a.head_dim) != (arch.num_heads, arch.num_kv_heads,
                                                                   arch.head_dim)):
                return None
        if m.norm.offset:
            return None
        try:
            fn = _script()
        except Exception as e:  # noqa: BLE001 - TorchScript missing or broken in this torch: eager steps
            logger.warning("CPU scripted decode unavailable (%s: %s); batch-1 steps run eager", type(e).__name__, e)
            return None
        # the runner's attention takes cpu_attention.py for such steps (``TorchAttention.cpu_kernel``,
        # under the same conditions as ``cpu_attention.fits``): so does this step
        c_attn = cpu_attention and arch.head_dim % 16 == 0 and arch.head_dim <= 128
        return LoneDecoder(model, kv_caches, block_size, fn, c_attn)

    def logits(self, tokens: Sequence[int], start: int, block_ids: Sequence[int],
               argmax_only: bool = False, aux_layers: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """float32 logits [t, V] of ``tokens`` (t ≤ MAX_ROWS) at positions ``start ..`` (their KV is
        written to their slots), and the hidden states of ``aux_layers`` as ``TorchRunner.forward``
        returns them (id ``num_layers``: the final post-norm state); ``argmax_only``: as
        ``CausalLM.compute_logits``."""
        if torch._C._jit_can_fuse_on_cpu():  # a fuser could reorder float ops: not the eager bits
            raise RuntimeError("LoneDecoder needs TorchScript's CPU fuser off")
        bs, t = self.block_size, len(tokens)
        n = start + t  # context length, the new tokens included
        nb = -(-n // bs)
        b0 = block_ids[0]
        slot_start = block_ids[start // bs] * bs + start % bs
        slots = None
        if t > 1:
            new = [block_ids[p // bs] * bs + p % bs for p in range(start, n)]
            if new != list(range(slot_start, slot_start + t)):  # not one run of slots
                slots = torch.tensor(new)
        ctx_slots = None
        if list(block_ids[:nb]) != list(range(b0, b0 + nb)):  # blocks not in order: gather (as eager)
            blocks = np.asarray(block_ids[:nb], dtype=np.int64)
            ctx_slots = torch.from_numpy((blocks[:, None] * bs + np.arange(bs)).reshape(-1)[:n])
        # one token: its embedding row as a view (never written: the layers add out of place)
        x = self.embed[tokens[0]:tokens[0] + 1] if t == 1 else F.embedding(torch.tensor(tokens), self.embed)
        if t == 1 and 0 in aux_layers:
            x = x.clone()  # handed out as layer 0's features: not a view of the embedding
        # Rotary.rotate's tables for these positions: cos, and sin with its first half negated
        cos, sin, half = self.cos[start:n], self.sin[start:n], self.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        threads = torch.get_num_threads()
        one_thread = self.ONE_THREAD_ATTENTION and threads != 1
        try:
            x, aux = self.fn(x, cos[:, None, :], sin_signed[:, None, :], slot_start, slots, ctx_slots, b0 * bs,
                             b0 * bs + n, self.norms, self.packed, self.scale_zeros, self.groups, self.k_caches,
                             self.v_caches, self.eps, self.heads, self.kv_heads, self.head_dim, self.inter, self.scale,
                             one_thread, sorted(a for a in aux_layers if a < len(self.k_caches)), self.q4,
                             self.c_attn)
        finally:
            torch.set_num_threads(threads)
        hidden = self.final_norm.forward(x)
        if len(self.k_caches) in aux_layers:
            aux.append(hidden)
        return self.model.compute_logits(hidden, argmax_only), aux
