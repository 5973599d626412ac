"""The frozen target during training: its features for the head and its next-token distributions.

One no-grad forward per batch over the padded grid (``attention.PaddedCausalAttention``, the torch
layer kernels) returns the final post-norm hidden state of every row and the features the head
reads (EAGLE-3: the residual-stream inputs of the aux layers, concatenated; EAGLE-1: the final
hidden state). Logits are never materialised for the whole batch: ``argmax`` runs over the full
vocabulary in row chunks (a 262k vocabulary times 8k rows would be 8 GB), and the soft targets
over the draft columns are computed per loss chunk (``ttt.py``) from the final hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.decoder import CausalLM
from tandem.models.forward_context import ForwardContext
from tandem.models.torch_kernels import TORCH_KERNELS
from tandem.train.attention import PaddedBatchMeta, PaddedCausalAttention
from tandem.train.batches import Batch

# Elements of one chunk of full-vocabulary logits in ``argmax``.
ARGMAX_CHUNK_ELEMENTS = 1 << 27


@dataclass(frozen=True)
class TargetOutput:
    hidden: torch.Tensor  # [B·L, H] final post-norm hidden
    features: torch.Tensor  # [B·L, F] what the head's step 0 reads
    argmax: torch.Tensor  # [B·L] the target's greedy next token at every row


class FrozenTarget:
    def __init__(self, model: CausalLM, feature_layers: tuple[int, ...]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.arch = model.arch
        self.feature_layers = feature_layers  # (num_layers,) means the final hidden (EAGLE-1)
        self._attention = PaddedCausalAttention()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head_weight

    def logits(self, hidden: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of ``hidden`` rows over ``columns`` of the vocabulary (all when None),
        soft-capped as the target's own."""
        w = self.lm_head_weight if columns is None else self.lm_head_weight.index_select(0, columns)
        out = torch.nn.functional.linear(hidden.to(w.dtype), w).float()
        cap = self.arch.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    @torch.no_grad()
    def run(self, batch: Batch) -> TargetOutput:
        b, n = batch.shape
        ids = batch.ids.reshape(-1)
        positions = torch.arange(n, device=ids.device).repeat(b)
        ctx = ForwardContext(meta=PaddedBatchMeta(b, n), kv_caches=[None] * self.arch.num_layers,  # type: ignore[list-item]
                             kernels=TORCH_KERNELS, attention=self._attention)
        final = self.feature_layers == (self.arch.num_layers,)
        hidden, aux = self.model(ids, positions, ctx, () if final else self.feature_layers)
        features = hidden if final else torch.cat(aux, dim=-1)
        return TargetOutput(hidden, features, self.argmax(hidden))

    @torch.no_grad()
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = max(1, ARGMAX_CHUNK_ELEMENTS // self.arch.vocab_size)
        w = self.lm_head_weight
        return torch.cat([torch.nn.functional.linear(hidden[s:s + rows].to(w.dtype), w).argmax(-1)
                          for s in range(0, hidden.shape[0], rows)])
