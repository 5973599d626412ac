"""Engine construction: everything an LLMEngine needs, built once from its EngineConfig.

Order: open the target checkpoint (architecture, tokenizer) → resolve device, dtype and
``max_model_len`` → build the target model → open and validate the draft model if any → size the KV
cache (target + draft share one block table, so one block costs both) → allocate the KV tensors and
the runners (``make_runner``: the CUDA runner on CUDA, the torch runner elsewhere) → the proposer and
the speculator → compile kernels and capture the small decode / verify graphs (``warm_up``) → the
scheduler. Every configuration mistake found here raises a ConfigError naming the key.

Invariants: the KV cache holds at least one request of ``max_model_len`` tokens plus the draft's
``k`` lookahead slots; the scheduler reserves those slots only when a draft model writes KV.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tandem.config import (
    EngineConfig,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from tandem.config.runner import with_debug_overrides
from tandem.config.speculative import EAGLE_METHODS, validate_against_target
from tandem.engine.detokenizer import NO_TEXT, fast_decoder
from tandem.engine.model_loader import build_model
from tandem.engine.stats import EngineStats
from tandem.errors import ConfigError
from tandem.kv.block_pool import BlockPool
from tandem.kv.feature_cache import FeatureCache
from tandem.kv.kv_cache import allocate_kv_cache, bytes_per_block, kv_budget_bytes
from tandem.loader.arch import ModelArch
from tandem.loader.checkpoint import open_checkpoint, resolve_quantization
from tandem.loader.eagle import load_eagle_head, read_eagle_config
from tandem.loader.memory import return_free_memory
from tandem.models import cpu_skinny
from tandem.models.decoder import CausalLM
from tandem.models.onednn_linear import prepack_float_linears
from tandem.models.skinny_linear import use_skinny_linears
from tandem.scheduler import Scheduler
from tandem.spec_decode.proposers import EngineProposer, build_proposer
from tandem.spec_decode.speculator import AnySpeculator, build_speculator
from tandem.worker.cuda_graphs import warm_up_plan
from tandem.worker.head_runner import make_head_runner
from tandem.worker.runner import ModelRunner, make_runner

logger = logging.getLogger("tandem")


@dataclass(frozen=True)
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    arch: ModelArch
    tokenizer: Any  # None with skip_tokenizer_init
    decoder: Any  # what detokenizers decode with (detokenizer.fast_decoder)
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator  # sampling of requests without a seed
    model: CausalLM
    runner: ModelRunner
    num_blocks: int
    pool: BlockPool
    scheduler: Scheduler
    stats: EngineStats
    proposer: EngineProposer | None
    speculator: AnySpeculator
    async_scheduling: bool
    draft_limit: int | None  # drafts per request per step at most, whatever k says (``draft_limit``)


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def build_engine(config: EngineConfig) -> EngineParts:
    model_cfg, cache, sched_cfg, spec = config.model, config.cache, config.scheduler, config.speculative
    runner_cfg = with_debug_overrides(config.runner)
    device = resolve_device(model_cfg.device)
    ckpt = open_checkpoint(model_cfg.model, load_format=model_cfg.load_format, tokenizer=model_cfg.tokenizer,
                           revision=model_cfg.revision)
    arch = ckpt.arch
    dtype = resolve_dtype(model_cfg.dtype, device, arch.torch_dtype)
    max_model_len = resolve_max_model_len(model_cfg.max_model_len, arch.max_position_embeddings)
    torch.manual_seed(model_cfg.seed)
    generator = torch.Generator(device=device)
    generator.manual_seed(model_cfg.seed)
    quant = resolve_quantization(model_cfg.quantization, ckpt, device)
    # Before the weights: loading the tokenizer passes through ~50 MB that it gives back, returned here
    # before the weights arrive (peak RSS, docs/performance.md §21).
    tokenizer = None if model_cfg.skip_tokenizer_init else ckpt.load_tokenizer()  # None: token-id prompts only
    if device.type == "cpu":
        return_free_memory()
    model = build_model(arch, ckpt.weights(packed=quant is not None), dtype, device, max_model_len, quant,
                        named=model_cfg.quantization is not None, lm_head_dtype=model_cfg.lm_head_dtype)
    # a float32 target that verifies drafts: its multi-row steps on oneDNN (models/onednn_linear.py)
    onednn = (device.type == "cpu" and spec is not None and runner_cfg.cpu_onednn
              and not model_cfg.batch_invariant)
    if onednn:
        prepack_float_linears(model)
    if device.type == "cpu" and dtype is torch.float32:
        cpu_skinny.available()  # its 2-8-row kernel built (first run: ~1.5 s) or loaded now, not mid-serving
    # The checkpoint's reader (a GGUF's parsed metadata: ~55 MB for SmolLM2's) is not needed past here;
    # dropped before anything else is built, it no longer adds to the peak RSS (§28).
    del ckpt
    if device.type == "cpu":
        return_free_memory()
    eos = set(arch.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))

    k = spec.num_speculative_tokens if spec is not None else 0
    draft_arch = draft_weights = draft_quant = None
    if spec is not None and spec.method == "draft_model":
        # The draft follows the target's load format when that is "dummy" (benchmarks at real
        # shapes without weights), as in vLLM; otherwise it is detected from its own files.
        dckpt = open_checkpoint(spec.model, revision=spec.revision,
                                load_format="dummy" if model_cfg.load_format == "dummy" else "auto")
        draft_arch = dckpt.arch
        validate_against_target(
            spec, target_vocab_size=arch.vocab_size, draft_vocab_size=draft_arch.vocab_size,
            target_max_model_len=max_model_len, draft_max_model_len=draft_arch.max_position_embeddings,
        )
        draft_quant = resolve_quantization(spec.quantization, dckpt, device, key="speculative_config.quantization")
        draft_weights = dckpt.weights(packed=draft_quant is not None)
    head_cfg = None
    if spec is not None and spec.method in EAGLE_METHODS:
        head_cfg = read_eagle_config(spec.model, arch, dummy=model_cfg.load_format == "dummy", method=spec.method)
        if head_cfg.kind != spec.method:
            raise ConfigError("method", f"{spec.model!r} is an {head_cfg.kind!r} head, not {spec.method!r}",
                              allowed=[head_cfg.kind])
    features = head_cfg.feature_layers(arch.num_layers) if head_cfg is not None else ()

    # ---- KV cache sizing: target (+ draft) share one block table --------------------------------
    block_size = cache.block_size
    bpb = bytes_per_block(arch, block_size, dtype)
    if draft_arch is not None:
        bpb += bytes_per_block(draft_arch, block_size, dtype)
    feature_width = len(features) * arch.hidden_size  # EAGLE: the target's features per position
    if head_cfg is not None:
        bpb += bytes_per_block(head_cfg.layer, block_size, dtype)
        bpb += FeatureCache.bytes_per_block(feature_width, block_size, dtype)
    lookahead = k if draft_arch is not None or head_cfg is not None else 0
    need = -(-(max_model_len + lookahead) // block_size)
    budget, source = kv_budget_bytes(device, cache.gpu_memory_utilization, cache.kv_cache_memory_bytes,
                                     cpu_demand=need * bpb * sched_cfg.max_num_seqs)
    num_blocks = budget // bpb
    if num_blocks < need:
        raise ConfigError(
            "kv_cache_memory_bytes" if cache.kv_cache_memory_bytes is not None else "gpu_memory_utilization",
            f"KV cache of {_fmt_bytes(budget)} ({source}) holds {num_blocks} blocks of "
            f"{block_size} tokens, but one request of max_model_len={max_model_len} needs "
            f"{need} blocks ({_fmt_bytes(need * bpb)}; {_fmt_bytes(need * bpb - budget)} missing). "
            "Give more memory or lower max_model_len.",
        )
    logger.info("KV cache sized by %s: %d blocks × %d tokens = %d tokens (%.1f MiB)",
                source, num_blocks, block_size, num_blocks * block_size, num_blocks * bpb / 2**20)
    pool = BlockPool(num_blocks, enable_caching=cache.enable_prefix_caching)
    feature_cache = FeatureCache(feature_width, num_blocks, block_size, dtype, device) if features else None
    runner = make_runner(model, allocate_kv_cache(arch, num_blocks, block_size, dtype, device), block_size,
                         device, runner_cfg, max_model_len=max_model_len, lookahead=lookahead,
                         feature_layers=features, feature_cache=feature_cache,
                         batch_invariant=model_cfg.batch_invariant, max_verify_rows=k + 1)
    runners = [runner]
    draft_runner = None
    if draft_arch is not None and spec is not None:
        draft_model = build_model(draft_arch, draft_weights, dtype, device, spec.max_model_len or max_model_len,
                                  draft_quant, named=spec.quantization is not None)
        if onednn:
            prepack_float_linears(draft_model)
        draft_runner = make_runner(draft_model, allocate_kv_cache(draft_arch, num_blocks, block_size, dtype, device),
                                   block_size, device, spec.draft_runner_config(runner_cfg),
                                   max_model_len=max_model_len, lookahead=lookahead)  # the target's block tables
        runners.append(draft_runner)

    head_runner = None
    if head_cfg is not None:
        head = load_eagle_head(head_cfg, max_model_len + k + 1, dtype, device,
                               dummy=model_cfg.load_format == "dummy", seed=model_cfg.seed)
        head.bind_target(model.model.embed_tokens, model.model.embed_scale, model.lm_head_weight)
        if device.type == "cpu":
            use_skinny_linears(head)  # float32: its steps of 1-8 rows on cpu_skinny (models/skinny_linear.py)
        head_runner = make_head_runner(head, allocate_kv_cache(head_cfg.layer, num_blocks, block_size, dtype, device)[0],
                                       block_size, device, spec.draft_runner_config(runner_cfg),
                                       max_model_len=max_model_len, lookahead=lookahead, features=feature_cache)
        runners.append(head_runner)

    stats = EngineStats()
    proposer = build_proposer(spec, draft_runner, generator, head_runner)
    use_async = sched_cfg.async_scheduling
    use_async = device.type == "cuda" if use_async is None else bool(use_async)
    limit = draft_limit(runner)
    if spec is not None and limit is not None and limit < k:
        logger.info("speculation: at most %d drafts per request per step (num_speculative_tokens=%d): a longer "
                    "verify (over %d query rows) would leave the runner's fast path", limit, k, limit + 1)
        k = limit
    speculator = build_speculator(spec, proposer, stats.spec, device, asynchronous=use_async, draft_limit=limit)
    # On CUDA, compile the step kernels' variants and capture the decode / verify graphs of every
    # batch bucket now rather than on first use (a capture costs ~0.1 s, a compile up to ~1 s): no
    # request of a fresh engine waits for either.
    for sizes, qs in warm_up_plan(sched_cfg.max_num_seqs, runner_cfg.max_graph_batch, k + 1):
        for r in runners:
            r.warm_up(sizes, qs)
    if (runner_cfg.screened_head and device.type == "cpu" and quant is not None
            and not model_cfg.batch_invariant and model.screen_lm_head()):
        # Last, at the settled RSS: the screened head's build temporaries do not raise the load's peak.
        # Only with packed layers (the quantized CPU default); `quantization="none"` stays the plain
        # float path whose tokens are compared with HF's.
        return_free_memory()
    scheduler = Scheduler(pool, block_size, sched_cfg.token_budget(k), sched_cfg.max_num_seqs, max_model_len,
                          lookahead=lookahead, enable_prefix_caching=cache.enable_prefix_caching,
                          admission_group=sched_cfg.resolved_admission_group(device.type == "cuda" and runner_cfg.cuda_graphs))
    return EngineParts(
        device=device, dtype=dtype, arch=arch, tokenizer=tokenizer,
        decoder=NO_TEXT if tokenizer is None else fast_decoder(tokenizer),
        max_model_len=max_model_len, eos_token_ids=tuple(sorted(eos)), generator=generator, model=model,
        runner=runner, num_blocks=num_blocks, pool=pool, scheduler=scheduler, stats=stats, proposer=proposer,
        speculator=speculator,
        async_scheduling=use_async, draft_limit=limit,
    )


def draft_limit(runner: ModelRunner) -> int | None:
    """Drafts per request per step at most on this target runner: one less than the query rows its
    fast path takes (``fast_query_limit``; None: no limit). A verify past them runs eagerly on CUDA —
    on the H200, SmolLM2 verifies of 8+ drafts took ~12 ms against ~1 ms replayed — and as several
    steps on a packed CPU model (docs/performance.md §36), so suffix decoding's 24 (vLLM's default k)
    would turn its longest, best matches into its slowest steps."""
    rows = runner.fast_query_limit
    return None if rows is None else max(1, rows - 1)
