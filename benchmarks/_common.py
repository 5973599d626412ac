"""Helpers shared by the CPU benchmark scripts (not part of the tandem package).

- ``load_hf_from_gguf``: HF transformers' own float32 model + tokenizer from the same GGUF file
  tandem loads (``load_gguf_checkpoint``, the code behind ``from_pretrained(dir, gguf_file=...)``,
  called directly because ``from_pretrained`` insists on ``accelerate`` for GGUF files).
- ``copy_bandwidth``: bytes read + written per second by a large tensor copy (the memory-bandwidth
  floor of batch-1 decoding, measured in the same process and run as the engines).
- ``machine_info``: what to print next to every table (load average, threads, versions).
- ``tiny_model_dir`` / ``decode_ms_per_step``: a tiny random Llama (the engine's own host work
  dominates its steps) and the decode-phase ms per ``LLMEngine.step`` of a batch of prompts.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def load_hf_from_gguf(path: str | Path) -> tuple[Any, Any]:
    """transformers' float32 model (eval) and tokenizer for a GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"HF GGUF load incomplete: missing {missing}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    return model.eval(), tok


def copy_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5, device: str = "cpu") -> dict[str, float]:
    """Large float32 tensor copy: (bytes read + bytes written) / time, in GB/s (1e9).

    512 MiB per tensor is far beyond any cache of the machine (CPU) or of the GPU's L2 (``device``
    "cuda": timed between synchronisations), so this is DRAM / HBM bandwidth under whatever else is
    running. Returns median and max over ``repeats`` copies (one untimed first).
    """
    n = num_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    rates = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        dt = time.perf_counter() - t0
        rates.append(2 * num_bytes / dt / 1e9)
    del src, dst
    return {"median_GBps": statistics.median(rates), "max_GBps": max(rates), "samples": rates}


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all unique parameters (tied embeddings once: they are read once, as the LM head)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_context_token(arch: Any, dtype_bytes: int = 4) -> int:
    """K and V bytes one context token occupies over all layers (what a decode step reads per token)."""
    return arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * dtype_bytes


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def machine_info() -> dict[str, Any]:
    import transformers

    mem = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "mem_total": mem,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": loadavg(),
    }


def fmt_load(la: tuple[float, float, float]) -> str:
    return f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}"


def smollm2_decode_and_verify(ctx: int, k: int) -> tuple[Any, list[Any], list[Any], list[int]]:
    """SmolLM2-135M-Instruct on the CPU (float32) with a ``ctx``-token random context prefilled.

    Returns (llm, one-token decode chunks, (k+1)-token verify chunks, the verify's rows): the two
    steps the CPU probes time, over the same KV blocks (each forward rewrites the same slots)."""
    import math

    from tandem import LLM
    from tandem.worker.batch import SeqChunk

    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", max_model_len=2048,
              kv_cache_memory_bytes=512 << 20)
    blocks = list(range(math.ceil((ctx + k + 1) / llm.engine.block_size)))
    ids = torch.randint(100, 20000, (ctx + k + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.engine.runner.forward_logits([SeqChunk(ids[:ctx], 0, blocks)], [ctx - 1])
    return (llm, [SeqChunk(ids[ctx:ctx + 1], ctx, blocks)], [SeqChunk(ids[ctx:ctx + k + 1], ctx, blocks)],
            list(range(k + 1)))


def tiny_model_dir(num_layers: int = 2) -> Path:
    """A tiny random Llama checkpoint (``num_layers`` layers, hidden 64, vocabulary 512) in a temporary
    directory."""
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import write_tiny_hf_checkpoint

    return write_tiny_hf_checkpoint(Path(tempfile.mkdtemp()), "llama", hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=512)


def decode_ms_per_step(engine: Any, prompts: list[list[int]], params: Any, tag: str,
                       clock: Callable[[], float] = time.perf_counter) -> tuple[float, int]:
    """Add ``prompts`` to ``engine``, step until every request has its first token, then time the
    remaining steps: (ms per step, steps). ``clock``: wall time by default; ``time.process_time``
    counts only this process's CPU time (steadier on a shared machine when the work is host work)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, params, prompt_token_ids=p)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    t0, n = clock(), 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    return (clock() - t0) / max(1, n) * 1e3, n


def warm_state(llm: Any) -> tuple[int, float, int]:
    """(CUDA graphs captured, seconds spent capturing, Triton kernel variants compiled) so far in
    ``llm``'s runners and this process: a difference across a timed run is work done mid-serving."""
    from tandem.worker.compile_state import compiled_variants

    graphs, seconds = 0, 0.0
    eng = llm.engine
    for r in (eng.runner, getattr(eng.proposer, "runner", None)):
        g = getattr(r, "graphs", None)
        if g is not None:
            graphs += len(g.graphs)
            seconds += g.capture_seconds
    return graphs, seconds, sum(len(v) for v in compiled_variants().values())
