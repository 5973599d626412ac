"""ModelRunner: one model, its KV cache and the device; runs a forward over SeqChunks.

Returns float32 logits only for the rows the caller asks for (sampled positions), so a long prefill
chunk never materialises a [T, vocab] tensor unless prompt logprobs are requested.
Used for the target and, with its own instance, for a draft model.

On CUDA the work goes to ``GpuModelRunner`` (``gpu_runner.py``: device-side inputs, Triton
attention, fused layers, CUDA graphs); ``TANDEM_GPU_RUNNER=0`` keeps the plain path below (torch
attention), which is also the CPU path, unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tandem.models.decoder import CausalLM, KVCache
from tandem.worker.batch import SeqChunk, build_inputs

if TYPE_CHECKING:
    from tandem.worker.gpu_runner import GpuModelRunner


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[KVCache], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.gpu: GpuModelRunner | None = None
        if device.type == "cuda" and os.environ.get("TANDEM_GPU_RUNNER", "1") != "0":
            from tandem.worker.gpu_runner import GpuModelRunner

            self.gpu = GpuModelRunner(model, kv_caches, block_size, device)

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
        if self.gpu is not None:
            return self.gpu.forward_logits(chunks, rows, token_ids)
        if token_ids is not None:
            chunks = [SeqChunk([t], c.start, c.block_ids) for c, t in zip(chunks, token_ids.tolist())]
        inputs = build_inputs(chunks, self.block_size, self.device)
        hidden, _ = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, idx))
