"""TorchRunner: one model, its KV cache and the device; runs a forward over SeqChunks with torch ops.

Returns float32 logits only for the rows the caller asks for (sampled positions), so a long prefill
chunk never materialises a [T, vocab] tensor unless prompt logprobs are requested.
Used for the target and, with its own instance, for a draft model.

The CPU path, and the reference on any device (``RunnerConfig.backend = "torch"``); on CUDA the
factory in ``runner.py`` picks ``GpuModelRunner`` (device-side inputs, Triton attention, fused
layers, CUDA graphs) instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.models.decoder import CausalLM, KVCache
from tandem.worker.batch import SeqChunk, build_inputs


class TorchRunner:
    def __init__(self, model: CausalLM, kv_caches: list[KVCache], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def forward_logits(self, chunks: Sequence[SeqChunk], rows: Sequence[int],
                       token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the chunks; return logits [len(rows), V] for flat query rows ``rows``.

        ``token_ids`` ([len(chunks)] int64 on the model's device), for chunks of one token each:
        the tokens to run instead of the chunks' own (placeholders), so a caller can feed tokens it
        sampled on the device without reading them on the host (the draft loop does).
        """
        if token_ids is not None:
            if any(len(c.token_ids) != 1 for c in chunks) or token_ids.shape != (len(chunks),):
                raise ValueError("token_ids needs one token per single-token chunk")
        if token_ids is not None:
            chunks = [SeqChunk([t], c.start, c.block_ids) for c, t in zip(chunks, token_ids.tolist())]
        inputs = build_inputs(chunks, self.block_size, self.device)
        hidden, _ = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, idx))

    def warm_up(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> None:
        """Nothing to compile or capture on the torch path."""
