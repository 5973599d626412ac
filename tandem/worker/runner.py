"""The model-runner protocol and the factory that picks an implementation once, from the config.

A runner owns one model, its KV tensors and a device, and runs one forward over a step's
``SeqChunk``s. Two implementations: the torch runner (any device; the CPU path and the reference)
and the CUDA runner (pinned inputs, Triton attention, fused layers, CUDA graphs). The engine, the
draft-model proposer and benchmarks see only this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from tandem.config.runner import RunnerConfig
from tandem.worker.batch import ChainedFrom, FedTokens, SeqChunk
from tandem.worker.step_output import StepOutput

if TYPE_CHECKING:
    from tandem.kv.feature_cache import FeatureCache
    from tandem.models.decoder import CausalLM, KVCache


class ModelRunner(Protocol):
    model: CausalLM
    kv_caches: list[KVCache]
    block_size: int
    device: torch.device
    # The most query rows per request a decode / verify step may have and stay on the runner's fast
    # path — a replayed CUDA graph; a packed CPU model's one-step verify — (None: no such limit). A
    # longer verify runs eagerly on CUDA (an order of magnitude slower on a small model) and as
    # several steps on the CPU (docs/performance.md §36): the speculator drafts at most this minus one.
    fast_query_limit: int | None

    def forward_logits(self, chunks: Sequence[SeqChunk], rows: Sequence[int],
                       token_ids: torch.Tensor | None = None, argmax_only: bool = False,
                       fed: FedTokens | None = None, chain: ChainedFrom | None = None) -> torch.Tensor:
        """Float32 logits [len(rows), V] for flat query rows ``rows`` of the chunks.

        ``token_ids`` ([len(chunks)] int64 on the device), for chunks of one token each: run these
        tokens instead of the chunks' own placeholders (tokens sampled on the device, never read on
        the host). ``fed``: the same for any query rows (drafts an EAGLE head left on the device).
        ``chain``: the chunks were packed before the verify they follow was read (worker/chain.py):
        each one's first token and positions come from that verify's outcome on the device. ``argmax_only``: the caller reads only each row's argmax, so the rows may come from
        a faster head whose other entries are not logits (``CausalLM.compute_logits``). The result may
        be a view valid until this runner's next forward.
        """
        ...

    def forward_ids(self, chunks: Sequence[SeqChunk], rows: Sequence[int], token_ids: torch.Tensor | None = None,
                    fed: FedTokens | None = None, chain: ChainedFrom | None = None) -> torch.Tensor:
        """The greedy token [len(rows)] int64 of each row (``greedy_ids`` of ``forward_logits``, same
        arguments, ``argmax_only``), on the device. The CUDA runner's graphs compute it inside the
        replay: no launch of its own."""
        ...

    def forward(self, chunks: Sequence[SeqChunk], rows: Sequence[int], token_ids: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = (), argmax_only: bool = False) -> StepOutput:
        """``forward_logits`` plus, for every query row, the hidden states entering each layer of
        ``aux_layers`` (id ``num_layers``: the final post-norm hidden state) — what EAGLE heads read."""
        ...

    def warm_up(self, batch_sizes: Sequence[int], query_lens: Sequence[int]) -> None:
        """Compile kernels and capture graphs for these step shapes now, not mid-serving (no-op on
        the torch runner)."""
        ...


def make_runner(model: CausalLM, kv_caches: list[KVCache], block_size: int, device: torch.device,
                cfg: RunnerConfig, *, max_model_len: int | None = None, lookahead: int = 0,
                feature_layers: tuple[int, ...] = (), feature_cache: FeatureCache | None = None,
                batch_invariant: bool = False, max_verify_rows: int = 1) -> ModelRunner:
    """The CUDA runner on CUDA devices unless ``cfg.backend == "torch"``; the torch runner otherwise.

    ``max_model_len`` + ``lookahead`` (draft slots past it) bound a request's KV blocks: the CUDA
    runner sizes its graphs' block tables from them (None: the model's rope table length).
    ``feature_layers``: what an EAGLE head reads; the CUDA runner computes them in every step (its
    graphs included), the torch runner when it has a ``feature_cache`` or ``forward`` asks. With a
    ``feature_cache`` (kv/feature_cache.py) every forward writes them to their slots there. ``batch_invariant``
    (``ModelConfig.batch_invariant``, checked by the builder): the CUDA runner's batch-invariant mode.
    ``max_verify_rows``: a verify step's query rows at most (k + 1): the torch runner splits a batch-1
    verify longer than its exact lone step into lone steps (``TorchRunner._long_verify``)."""
    if device.type == "cuda" and cfg.backend != "torch":
        from tandem.worker.gpu_runner import GpuModelRunner  # imports Triton: CUDA only

        return GpuModelRunner(model, kv_caches, block_size, device, cfg, max_model_len=max_model_len,
                              lookahead=lookahead, feature_layers=feature_layers, feature_cache=feature_cache,
                              batch_invariant=batch_invariant)
    from tandem.worker.model_runner import TorchRunner

    return TorchRunner(model, kv_caches, block_size, device, batch_invariant=batch_invariant,
                       script=cfg.cpu_script, feature_layers=feature_layers, feature_cache=feature_cache,
                       max_verify_rows=max_verify_rows)
