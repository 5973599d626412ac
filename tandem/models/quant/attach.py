"""Swap a model's float linears for packed kernel modules, from a checkpoint or on the fly.

:class:`QuantizedLinears` is what ``CausalLM.load_weights`` hands every :class:`QuantizedWeight` to.
Shards of a packed projection (q/k/v → qkv_proj, gate/up → gate_up_proj) are held until all have
arrived, stacked (``concat_rows``) and packed into one kernel module that replaces the float module
(its bias, loaded as a float tensor, moves over). A weight is dequantized into the float module
instead when packing is off (CUDA unless quantization was named: ``engine/model_loader.py``), when the module is
the embedding or ``lm_head`` (kept float: the tied embedding needs row lookups, and the LM head's
error would move greedy picks, docs/quantization.md), when shards cannot share one matmul, or when
no kernel on the device holds the format (``kernels.make_quant_linear`` returns None). Each such fallback is
counted and logged once per load.

:func:`quantize_linears` is the on-the-fly ``int8`` / ``int4`` path for float checkpoints.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.loader.memory import return_free_memory
from tandem.models.quant.kernels import make_quant_linear
from tandem.models.quant.weights import QuantizedWeight, concat_rows, quantize_float

logger = logging.getLogger("tandem")

# On-the-fly weight-only methods: (bits, group (None: per channel), symmetric).
ON_THE_FLY: dict[str, tuple[int, int | None, bool]] = {
    "int8": (8, None, True),   # int8pack, one bf16 scale per output row
    "int4": (4, 32, False),    # int4pack, asymmetric groups of 32 (as GGUF Q4_1)
}
# On CUDA (W4, cuda_w4.py): int4 in asymmetric groups of 128, the GPTQ / AWQ default.
ON_THE_FLY_CUDA: dict[str, tuple[int, int | None, bool]] = {"int4": (4, 128, False)}
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


class QuantizedLinears:
    """Collects the QuantizedWeights of one ``load_weights`` call (see the module docstring)."""

    def __init__(self, packed_names: Mapping[str, str], pack: bool) -> None:
        self.packed_names = packed_names  # HF shard name -> packed module name (q_proj -> qkv_proj)
        self.pack = pack
        self.pending: dict[str, dict[str | None, QuantizedWeight]] = {}
        self.kernels: Counter[str] = Counter()
        self.dequantized: Counter[str] = Counter()
        self.loaded: set[str] = set()  # parameter names of the modules packed or dequantized
        self.float_shards: dict[str, set[str]] = {}

    def add(self, model: nn.Module, name: str, qw: QuantizedWeight) -> bool:
        """Hold ``qw`` for a kernel module (True), or leave it to the caller to dequantize (False)."""
        parts = name.split(".")
        in_layer = name.startswith("model.layers.") and parts[-1] == "weight"
        if not (self.pack and in_layer):
            self.dequantized[qw.source] += 1
            return False
        if parts[-2] in self.packed_names:
            module, shard = ".".join(parts[:-2] + [self.packed_names[parts[-2]]]), parts[-2]
        else:
            module, shard = ".".join(parts[:-1]), None
        shards = self.pending.setdefault(module, {})
        shards[shard] = qw
        # Pack as soon as a bias-less module is complete, so the unpacked codes of the whole model
        # are never held at once (a bias may still be on its way: those wait for finish()).
        target = self._module(model, module)
        if getattr(target, "bias", None) is None and set(shards) == set(getattr(target, "shards", {None: 0})):
            self._build(model, module, self.pending.pop(module))
        return True

    @staticmethod
    def _module(model: nn.Module, name: str) -> nn.Module:
        try:
            return model.get_submodule(name)
        except AttributeError:
            raise ModelLoadError(f"unexpected quantized weight {name}.weight in checkpoint") from None

    def finish(self, model: nn.Module) -> tuple[set[str], dict[str, set[str]]]:
        """Pack (or dequantize) every complete module. Returns the parameter names now loaded, and per
        packed-module weight the shards dequantized into it because its other shards came as float
        (e.g. a GGUF Q4_K_M file's Q6_K ``attn_v`` next to Q4_K ``attn_q`` / ``attn_k``)."""
        for name, shards in list(self.pending.items()):
            self._build(model, name, shards)
        self.pending.clear()
        self._log()
        return self.loaded, self.float_shards

    def _build(self, model: nn.Module, name: str, shards: dict[str | None, QuantizedWeight]) -> None:
        module = self._module(model, name)
        order = list(getattr(module, "shards", {None: 0}))
        if set(shards) != set(order):
            # The other shards are float tensors (or missing: load_weights reports those): one matmul
            # cannot mix the two, so this module runs in float.
            present = [s for s in order if s in shards]
            self._dequantize_into(module, present, [shards[s] for s in present])
            self.float_shards.setdefault(f"{name}.weight", set()).update(s for s in present if s is not None)
            return
        parts = [shards[s] for s in order]
        sizes = [module.offsets[s][1] for s in order] if order != [None] else [module.weight.shape[0]]
        for s, qw, rows in zip(order, parts, sizes, strict=True):
            if qw.shape != (rows, module.weight.shape[1]):
                label = f"{name}.{s}" if s else name
                raise ModelLoadError(f"quantized weight {label} has shape {qw.shape}, the model expects "
                                     f"{(rows, module.weight.shape[1])}")
        stacked = concat_rows(parts) if len(parts) > 1 else parts[0]
        new = make_quant_linear(stacked, module.bias, module.weight) if stacked is not None else None
        if new is not None:
            replace_module(model, name, new)
            self.kernels[f"{new.kernel} ({stacked.source})"] += 1
            # Packing leaves freed temporaries (int32 codes, planes) in glibc's heap; returning them as
            # we go keeps the load's peak RSS near its final size (SmolLM2: ~100 MB lower).
            return_free_memory()
        else:
            self._dequantize_into(module, order, parts)
        self.loaded.add(f"{name}.weight")

    def _dequantize_into(self, module: nn.Module, order: list[str | None], parts: list[QuantizedWeight]) -> None:
        for shard, qw in zip(order, parts, strict=True):
            self.dequantized[qw.source] += 1
            if shard is None:
                with torch.no_grad():
                    qw.dequantize(out=module.weight.data)
            else:
                module.load_shard(shard, "weight", qw.dequantize(module.weight.dtype))

    def _log(self) -> None:
        if self.kernels:
            logger.info("quantized linears packed: %s", ", ".join(f"{n}× {k}" for k, n in sorted(self.kernels.items())))
        if self.dequantized:
            why = "" if self.pack else " (packed only on the CPU, or on CUDA when quantization is named)"
            logger.info("quantized tensors dequantized to float%s: %s", why,
                        ", ".join(f"{n}× {k}" for k, n in sorted(self.dequantized.items())))


def quantize_linears(model: nn.Module, method: str) -> Counter[str]:
    """On-the-fly weight-only quantization of every decoder layer's linears (``int8`` / ``int4``)."""
    cuda = next(model.parameters()).device.type == "cuda"
    bits, group, symmetric = (ON_THE_FLY_CUDA if cuda else ON_THE_FLY)[method]
    done: Counter[str] = Counter()
    for i, _ in enumerate(model.model.layers):
        for rel in LAYER_LINEARS:
            name = f"model.layers.{i}.{rel}"
            module = model.get_submodule(name)
            w = module.weight
            g = group if group is not None and w.shape[1] % group == 0 else None
            new = make_quant_linear(quantize_float(w, bits, g, symmetric, method), module.bias, w)
            if new is None:
                done["kept float"] += 1
                continue
            replace_module(model, name, new)
            done[new.kernel] += 1
    logger.info("on-the-fly %s quantization: %s", method, ", ".join(f"{n}× {k}" for k, n in sorted(done.items())))
    return done
