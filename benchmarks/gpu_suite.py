"""GPU benchmark suite: dummy-weight models at public shapes, checked, then timed against the floor.

One command (on a CUDA machine):

    python benchmarks/gpu_suite.py [--sections ref,decode,variants,spec,smol,sweep,b64] [--out DIR]

What it does, per section:
- ``ref``: a prefill, decode and verify steps of the fast path (Triton attention, fused layers, CUDA
  graphs) against the torch runner (``RunnerConfig(backend="torch")``: torch paged attention, the
  ``CausalLM`` modules) on the same weights: relative error of the logits and argmax agreement.
- ``decode``: batch-1 greedy decode of the 8B and 1B shapes. Three numbers each: the graph replay
  alone (GPU time), the runner step with its host work and a sync (what the engine pays per
  forward), and the engine's decode-phase tokens/s (``LLMEngine.step`` loop). The floor is
  (weight bytes + KV bytes read per step) / 4.26 TB/s (the H200 copy bandwidth measured here).
- ``variants``: the 8B batch-1 runner step with graphs+fused, graphs+unfused, eager+fused, cuBLAS
  only, no split-KV, no programmatic dependent launch.
- ``timeline``: the 1B engine's steady decode under torch.profiler: device time per op kind and the
  idle time between ops per step (what the engine adds around the graph replay).
- ``pdl``: 8B and 1B batch-1 graph replay / runner step with programmatic dependent launch off and on
  (``pdl.py``).
- ``spec``: 8B target + 1B draft (``method=draft_model``), synthetic acceptance α ∈ {0.6, 0.8},
  k ∈ {3, 5}, batch 1: measured speedup over plain decode, c and v measured at runner level, the
  cost-model speedup S and η = measured / S (with the configured α and with the realised τ).
- ``smol``: SmolLM2-135M shape, batch 1.
- ``sweep``: 8B decode throughput at batch 1, 8, 32, 128 with and without speculation (α=0.6, k=3).
- ``b64``: 8B batch 64 with and without speculation (α=0.6, k=3).
- ``w4``: the 8B shape with int4 weights (``quantization="int4"``: the dummy bf16 linears quantized
  at load, asymmetric groups of 128, served by ``W4Linear``): the reference check, batch-1 decode
  against the int4 floor (packed weights + scales + the bf16 embedding / LM head + KV), and the
  ``spec`` section with the bf16 1B draft.

Dummy checkpoints are a config.json plus a word-level tokenizer covering the whole vocabulary.
The engine opens a draft model with ``open_checkpoint(path)`` and no ``load_format`` (the target's
``load_format="dummy"`` does not reach it), so for draft directories this script wraps that call to
pass ``load_format="dummy"`` (see ``_dummy_draft_workaround``). One engine per target shape is built
once; speculation settings are switched between runs by replacing ``engine.spec`` (the proposer is
the same draft model; the scheduler keeps k_max = 5 lookahead slots). Results: a table on stdout and
JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tandem.spec_decode.cost_model import cost_model_speedup  # noqa: E402

COPY_BW = 4.26e12  # bytes/s, H200 device-to-device copy (read + write), 2026-11-30; main() measures this card's
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv=8, tied=False,
                         rope=500000.0, scaling=LLAMA3_SCALING),
    "llama-3.2-1b": dict(vocab=128256, hidden=2048, inter=8192, layers=16, heads=32, kv=8, tied=True,
                         rope=500000.0, scaling={**LLAMA3_SCALING, "factor": 32.0}),
    "smollm2-135m": dict(vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv=3, tied=True,
                         rope=100000.0, scaling=None),
}
MAX_POS = 2048
DEVICE = "cuda"
TINY = {  # --cpu-smoke: the same code paths on CPU with toy shapes (checks the script, times nothing real)
    "llama-3.1-8b": dict(vocab=512, hidden=128, inter=256, layers=2, heads=4, kv=2, tied=False, rope=1e4, scaling=None),
    "llama-3.2-1b": dict(vocab=512, hidden=64, inter=128, layers=2, heads=2, kv=1, tied=True, rope=1e4, scaling=None),
    "smollm2-135m": dict(vocab=512, hidden=96, inter=128, layers=2, heads=3, kv=1, tied=True, rope=1e4, scaling=None),
}
RESULTS: dict[str, Any] = {}
LOG: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


# ---- dummy checkpoints --------------------------------------------------------------------------
def write_dummy_dir(root: Path, name: str) -> Path:
    s = SHAPES[name]
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": s["vocab"], "hidden_size": s["hidden"], "intermediate_size": s["inter"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv"],
        "head_dim": s["hidden"] // s["heads"], "max_position_embeddings": MAX_POS, "rms_norm_eps": 1e-5,
        "rope_theta": s["rope"], "tie_word_embeddings": s["tied"], "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }
    if s["scaling"]:
        cfg["rope_scaling"] = s["scaling"]
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    if not (d / "tokenizer.json").exists():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for i in range(3, s["vocab"]):
            vocab[f"t{i}"] = i
        core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>").save_pretrained(str(d))
    return d


def _dummy_draft_workaround(root: Path) -> None:
    """The engine opens the draft without load_format: force "dummy" for our directories."""
    import tandem.engine.builder as E

    orig = E.open_checkpoint
    if getattr(orig, "_gpu_suite", False):
        return

    def patched(model: Any, **kw: Any) -> Any:
        if str(model).startswith(str(root)) and kw.get("load_format", "auto") == "auto":
            kw["load_format"] = "dummy"
        return orig(model, **kw)

    patched._gpu_suite = True  # type: ignore[attr-defined]
    E.open_checkpoint = patched


def make_llm(path: Path, draft: Path | None = None, kv_gib: float = 8.0, max_num_seqs: int = 256,
             quantization: str | None = None) -> Any:
    from tandem import LLM

    spec = None
    if DEVICE == "cpu":
        kv_gib = 0.05
    if draft is not None:
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 5,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.6}
    return LLM(str(path), load_format="dummy", dtype="bfloat16" if DEVICE == "cuda" else "float32",
               device=DEVICE, max_model_len=MAX_POS,
               kv_cache_memory_bytes=int(kv_gib * 2**30), enable_prefix_caching=False,
               max_num_seqs=max_num_seqs, speculative_config=spec, quantization=quantization)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a step reads: parameters plus packed int4 buffers (codes, scales, offsets)."""
    packed = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.rsplit(".", 1)[-1] in ("qweight", "scale", "offset"))
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(arch: Any) -> int:
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2  # K and V, bf16


def floor_s(model: torch.nn.Module, arch: Any, total_ctx: int) -> float:
    return (weight_bytes(model) + kv_bytes_per_token(arch) * total_ctx) / COPY_BW


# ---- runner-level timing ------------------------------------------------------------------------
def _chunks(runner: Any, batch: int, q: int, ctx: int) -> tuple[list[Any], list[int]]:
    from tandem.worker.batch import SeqChunk

    bs = runner.block_size
    nb = -(-(ctx + 8) // bs)
    total_blocks = runner.kv_caches[0][0].shape[0] // bs
    chunks = [SeqChunk([5] * q, ctx - q, [(i * nb + j) % total_blocks for j in range(nb)]) for i in range(batch)]
    return chunks, list(range(batch * q))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fast(runner: Any) -> Any:
    """The runner itself (the CUDA runner on CUDA, the torch runner on CPU)."""
    return runner


@torch.inference_mode()
def time_runner(gpu: Any, batch: int, q: int, ctx: int, iters: int = 30) -> dict[str, float]:
    chunks, rows = _chunks(gpu, batch, q, ctx)
    for _ in range(3):
        gpu.forward_logits(chunks, rows).argmax(-1).tolist()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        gpu.forward_logits(chunks, rows).argmax(-1).tolist()
    step = (time.perf_counter() - t0) / iters
    out = {"step_ms": step * 1e3}
    if getattr(gpu, "graphs", None) is not None:
        from tandem.worker.cuda_graphs import batch_bucket

        g = gpu.graphs.get((batch_bucket(batch, gpu.max_graph_batch), q))
        if g is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.graph.replay()
            start.record()
            for _ in range(iters):
                g.graph.replay()
            end.record()
            torch.cuda.synchronize()
            out["gpu_ms"] = start.elapsed_time(end) / iters
    return out


# ---- reference check ----------------------------------------------------------------------------
@torch.inference_mode()
def reference_check(llm: Any, name: str, fp32: bool = False) -> dict[str, Any]:
    """Fast path vs plain-torch path on the same bf16 weights; with ``fp32``, both against a float32
    copy of the model run through the plain-torch path (how far each bf16 path is from exact)."""
    import copy

    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.worker.batch import SeqChunk
    from tandem.worker.gpu_runner import GpuModelRunner
    from tandem.worker.model_runner import TorchRunner

    eng = llm.engine
    model, arch, bs = eng.model, eng.arch, eng.block_size
    nblocks = 16
    runners: dict[str, Any] = {}
    runners["torch_bf16"] = TorchRunner(model, allocate_kv_cache(arch, nblocks, bs, eng.dtype, eng.device), bs,
                                        eng.device)
    if fp32:
        m32 = copy.deepcopy(model).float()
        runners["torch_fp32"] = TorchRunner(m32, allocate_kv_cache(arch, nblocks, bs, torch.float32, eng.device),
                                            bs, eng.device)
    runners["fast_bf16"] = GpuModelRunner(model, allocate_kv_cache(arch, nblocks, bs, eng.dtype, eng.device), bs,
                                          eng.device)
    base = "torch_fp32" if fp32 else "torch_bf16"
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, arch.vocab_size, (64,), generator=g).tolist()
    blocks = list(range(nblocks))[::-1]
    errs: dict[str, list[float]] = {k: [] for k in runners if k != base}
    agree = {k: 0 for k in errs}
    n = 0
    done = 0
    last = 0
    plan = [[], None, None, None, [7, 8, 9, None]]  # prefill 64, 3 decodes, a 4-token verify
    for new in plan:
        new = [last] if new is None else [last if t is None else t for t in new]
        toks.extend(new)
        chunk = [SeqChunk(list(toks[done:]), done, blocks)]
        rows = list(range(len(toks) - done))
        outs = {k: r.forward_logits(chunk, rows).double() for k, r in runners.items()}
        ref = outs[base]
        for k in errs:
            errs[k].append(((outs[k] - ref).norm() / ref.norm()).item())
            agree[k] += int((outs[k].argmax(-1) == ref.argmax(-1)).sum())
        n += len(rows)
        done = len(toks)
        last = int(ref[-1].argmax())
    res = {"reference": base, "rel_errs": errs, "argmax_agree": {k: f"{v}/{n}" for k, v in agree.items()},
           "max_rel_err": {k: max(v) for k, v in errs.items()}}
    for k in errs:
        say(f"[ref] {name} {k} vs {base}: logits rel err per step {['%.2e' % e for e in errs[k]]}, "
            f"argmax agree {agree[k]}/{n}")
    return res


@torch.inference_mode()
def section_profile(llm: Any, batch: int = 1, ctx: int = 256) -> None:
    """Kernel time per step by kernel (eager fused forward under the profiler) vs the graph replay."""
    from torch.profiler import ProfilerActivity, profile

    from tandem.config import RunnerConfig
    from tandem.worker.gpu_runner import GpuModelRunner

    eng = llm.engine
    gpu = GpuModelRunner(eng.model, eng.runner.kv_caches, eng.block_size, eng.device, RunnerConfig(cuda_graphs=False))
    chunks, rows = _chunks(gpu, batch, 1, ctx)
    for _ in range(3):
        gpu.forward_logits(chunks, rows)
    _sync()
    iters = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            gpu.forward_logits(chunks, rows)
        _sync()
    rows_out = []
    total = 0.0
    count = 0
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if t <= 0:
            continue
        total += t
        count += ev.count
        rows_out.append((t / iters, ev.count / iters, ev.key[:90]))
    rows_out.sort(reverse=True)
    RESULTS.setdefault("profile", {})[f"b{batch}"] = {
        "kernel_us_per_step": total / iters, "kernels_per_step": count / iters,
        "top": [{"us": u, "calls": c, "name": k} for u, c, k in rows_out[:25]]}
    say(f"[profile] 8B b={batch} ctx={ctx}: {count / iters:.0f} kernels/step, kernel time {total / iters / 1e3:.3f} ms/step")
    for u, c, k in rows_out[:16]:
        say(f"[profile]   {u:8.1f} us  x{c:4.0f}  {k}")


# ---- engine-level timing# ---- engine-level timing ------------------------------------------------------------------------
def set_spec(llm: Any, k: int | None, alpha: float | None) -> None:
    from tandem.config.speculative import SpeculativeConfig

    eng = llm.engine
    if k is None:
        eng.spec = None
        return
    # drafting every step (goodput policy off): η compares what drafting k tokens costs with the cost
    # model; with the policy on, an unfavourable target (8B int4, v > 1) would not draft at all
    eng.spec = SpeculativeConfig(method="draft_model", model=eng._suite_draft, num_speculative_tokens=k,
                                 rejection_sample_method="synthetic", synthetic_acceptance_rate=alpha,
                                 disable_by_acceptance=False)


def engine_decode(llm: Any, batch: int, prompt_len: int, gen: int, seed: int = 0) -> dict[str, float]:
    """Decode-phase tokens/s: from the first sampled token of every request to the last."""
    from tandem import SamplingParams

    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, eng.arch.vocab_size, (prompt_len,), generator=g).tolist()
        eng.add_request(f"b{seed}-{i}-{time.monotonic_ns()}", None, params, prompt_token_ids=ids)
    # prefill (and the draft's catch-up on the prompt) until every request has its first token
    outs: dict[str, Any] = {}
    while len(eng.scheduler.waiting) or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        for o in eng.step():
            outs[o.request_id] = o
    start_tokens = sum(r.num_output_tokens for r in eng.scheduler.running)
    steps = 0
    _sync()
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        steps += 1
    dt = time.perf_counter() - t0
    total = sum(len(o.outputs[0].token_ids) for o in outs.values() if o.finished)
    drafted = sum(o.outputs[0].num_draft_tokens for o in outs.values() if o.finished)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs.values() if o.finished)
    decoded = total - start_tokens
    return {"tok_s": decoded / dt, "steps": steps, "tokens": decoded, "seconds": dt,
            "tau": decoded / max(1, steps * batch), "drafted": drafted, "accepted": accepted,
            "ms_per_step": dt / max(1, steps) * 1e3}


def prewarm(llm: Any, batch: int, kmax: int) -> None:
    """Capture every graph the timed runs will use (target q ∈ {1, k+1}, draft q ∈ 1..k+1)."""
    eng = llm.engine
    t0 = time.perf_counter()
    from tandem.worker.cuda_graphs import BATCH_BUCKETS

    tgt = fast(eng.runner)
    sizes = [b for b in BATCH_BUCKETS if b < batch] + [batch]  # the batch shrinks as requests finish
    if hasattr(tgt, "capture"):
        tgt.capture(sizes, list(range(1, kmax + 2)))
    if eng.proposer is not None and hasattr(fast(eng.proposer.runner), "capture"):
        fast(eng.proposer.runner).capture(sizes, list(range(1, kmax + 2)))
    say(f"[prewarm] b={batch} q=1..{kmax + 1}: {time.perf_counter() - t0:.2f} s")


# ---- sections -----------------------------------------------------------------------------------
def section_decode(llms: dict[str, Any], names: list[str]) -> None:
    for name in names:
        llm = llms[name]
        eng = llm.engine
        if eng.spec is not None:
            set_spec(llm, None, None)
        gpu = fast(eng.runner)
        ctx = 128 + 128  # mean context of the engine run below (prompt 128, 256 generated)
        r = time_runner(gpu, 1, 1, ctx)
        fl = floor_s(eng.model, eng.arch, ctx)
        engine_decode(llm, 1, 128, 16, seed=99)  # warm-up
        e = engine_decode(llm, 1, 128, 256, seed=1)  # asynchronous decode (the CUDA default)
        eng.async_scheduling = False
        e_sync = engine_decode(llm, 1, 128, 256, seed=1)
        eng.async_scheduling = True
        row = {"floor_ms": fl * 1e3, "floor_tok_s": 1 / fl, **r, "engine_tok_s": e["tok_s"],
               "engine_ms_per_step": e["ms_per_step"], "engine_sync_tok_s": e_sync["tok_s"],
               "frac_gpu": fl * 1e3 / r.get("gpu_ms", float("nan")), "frac_step": fl * 1e3 / r["step_ms"],
               "frac_engine": e["tok_s"] * fl, "weights_gb": weight_bytes(eng.model) / 1e9}
        RESULTS.setdefault("decode", {})[name] = row
        say(f"[decode] {name} b=1 ctx~{ctx}: floor {row['floor_ms']:.3f} ms ({row['floor_tok_s']:.0f} tok/s); "
            f"graph replay {row.get('gpu_ms', float('nan')):.3f} ms ({row['frac_gpu']:.1%}); runner step "
            f"{row['step_ms']:.3f} ms ({row['frac_step']:.1%}); engine {e['tok_s']:.1f} tok/s "
            f"({row['frac_engine']:.1%}, {e['ms_per_step']:.3f} ms/step; synchronous: {e_sync['tok_s']:.1f} tok/s)")


def section_hostprof(llm: Any, out: Path, gen: int = 256) -> None:
    """Where the host time of an engine decode step goes (cProfile over ``engine_decode``)."""
    import cProfile
    import io
    import pstats

    engine_decode(llm, 1, 128, 16, seed=98)  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    e = engine_decode(llm, 1, 128, gen, seed=97)
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    (out / "hostprof.txt").write_text(buf.getvalue())
    say(f"[hostprof] {e['tok_s']:.1f} tok/s under cProfile ({e['ms_per_step']:.3f} ms/step); "
        f"table in hostprof.txt")


# Runner variants as RunnerConfig fields (config/runner.py).
_VARIANTS = [("graphs+fused", dict()), ("graphs+fused, cuBLAS only (skinny_rows=0)", dict(skinny_rows=0)),
             ("graphs+fused, no split-KV", dict(kv_splits=1)),
             ("graphs+fused, no PDL (pdl=False)", dict(pdl=False)),
             ("graphs+unfused", dict(fused=False)),
             ("eager+fused", dict(cuda_graphs=False)), ("eager+unfused", dict(cuda_graphs=False, fused=False))]
# Programmatic dependent launch A/B (pdl.py), twice each, so drift over the run shows.
_PDL_VARIANTS = [("PDL off", dict(pdl=False)), ("PDL on", dict()), ("PDL off (again)", dict(pdl=False)),
                 ("PDL on (again)", dict())]
# Layer bodies for steps of a few rows (verify: k + 1 rows at batch 1).
_ROWS_VARIANTS = [("before: one program per row up to 1 row (6 on small models), cuBLAS above",
                   dict(skinny_multirow="rows")),
                  ("default: one program per row up to 1 row (6 on small models), tensor cores up to 16",
                   dict()),
                  ("tensor cores for 2-16 rows", dict(skinny_multirow="dot"))]
_ROWS_STEPS = ((1, 1), (1, 2), (1, 4), (1, 5), (1, 6), (2, 1), (4, 1), (8, 1), (16, 1))  # (batch, query rows)



def section_variants(llm: Any, ctx: int = 256, name: str = "8B", variants: list[tuple[str, dict[str, Any]]] | None = None,
                     key: str = "variants", steps: tuple[tuple[int, int], ...] = ((1, 1),)) -> None:
    """Graph replay and runner step of decode (query 1) / verify (query k + 1) steps of the given
    (batch, query) shapes under runner / kernel variants (RunnerConfig fields)."""
    from tandem.config import RunnerConfig
    from tandem.worker.gpu_runner import GpuModelRunner
    from tandem.worker.pdl import set_pdl

    eng = llm.engine
    out = {}
    for label, kw in variants or _VARIANTS:
        try:
            gpu = GpuModelRunner(eng.model, eng.runner.kv_caches, eng.block_size, eng.device, RunnerConfig(**kw))
            for b, q in steps:
                r = time_runner(gpu, b, q, ctx, iters=20)
                fl = floor_s(eng.model, eng.arch, b * ctx)  # KV of every request read
                r["frac_step"] = fl * 1e3 / r["step_ms"]
                if "gpu_ms" in r:
                    r["frac_gpu"] = fl * 1e3 / r["gpu_ms"]
                out[label if (b, q) == (1, 1) else f"{label}, b={b} q={q}"] = r
                say(f"[{key}] {name} b={b} q={q} ctx={ctx} {label}: step {r['step_ms']:.3f} ms ({r['frac_step']:.1%})"
                    + (f", graph replay {r['gpu_ms']:.3f} ms ({r['frac_gpu']:.1%})" if "gpu_ms" in r else ""))
        finally:
            set_pdl(True)  # the switch is process-wide; the engine's runner runs with PDL on
        del gpu
        torch.cuda.empty_cache()
    RESULTS[f"{key}_{name.lower()}_b1_ctx{ctx}"] = out


def section_timeline(llm: Any, name: str, out: Path, gen: int = 64) -> None:
    """GPU timeline of steady batch-1 engine decode steps (torch.profiler): per step, the device time
    of each op kind and the idle time between ops, so what the engine adds around a graph replay shows."""
    from torch.profiler import ProfilerActivity, profile

    engine_decode(llm, 1, 128, 16, seed=94)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        e = engine_decode(llm, 1, 128, gen, seed=93)
    evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)
    steps = max(1, e["steps"])
    # the decode loop's device events: the last `steps` graph replays' worth (skip prefill)
    busy: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    prev_end, prev_name = None, ""
    for ev in evs:
        kind = ev.name if len(ev.name) < 60 else ev.name[:57] + "..."
        busy.setdefault(kind, []).append(ev.time_range.elapsed_us())
        if prev_end is not None and ev.time_range.start > prev_end:
            gaps.setdefault(f"{prev_name[:30]} -> {kind[:30]}", []).append(ev.time_range.start - prev_end)
        prev_end = max(prev_end or 0, ev.time_range.end)
        prev_name = kind
    span = (evs[-1].time_range.end - evs[0].time_range.start) if evs else 0.0
    rows = sorted(busy.items(), key=lambda kv: -sum(kv[1]))
    total_busy = sum(sum(v) for v in busy.values())
    lines = [f"{name}: {steps} decode steps, {e['ms_per_step']:.3f} ms/step in the loop; device span "
             f"{span / 1e3:.2f} ms, busy {total_busy / 1e3:.2f} ms (prefill included)",
             "| op | calls | total µs | µs/call |", "|---|---|---|---|"]
    lines += [f"| {k} | {len(v)} | {sum(v):.0f} | {sum(v) / len(v):.2f} |" for k, v in rows[:40]]
    lines += ["", "| idle before (prev -> next) | count | total µs | µs each |", "|---|---|---|---|"]
    lines += [f"| {k} | {len(v)} | {sum(v):.0f} | {sum(v) / len(v):.2f} |"
              for k, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:25]]
    (out / f"timeline_{name}.md").write_text("\n".join(lines) + "\n")
    RESULTS[f"timeline_{name}"] = {"steps": steps, "ms_per_step": e["ms_per_step"], "span_us": span,
                                    "busy_us": total_busy}
    say(f"[timeline] {name}: {e['ms_per_step']:.3f} ms/step under the profiler; table in timeline_{name}.md")
    for ln in lines[:14] + lines[len(rows[:40]) + 3:len(rows[:40]) + 14]:
        say("   " + ln)


def section_spec(llm: Any, configs: list[tuple[float, int]], batch: int = 1, gen: int = 256,
                 key: str = "spec", runs: int = 2) -> None:
    """Speculation vs the cost model. ``runs`` engine runs per configuration at batch 1 (different
    seeds): the synthetic acceptance draws are random, so τ — and with it the measured speedup —
    scatters around its expectation; more runs narrow that (η with the realised τ removes it)."""
    eng = llm.engine
    tgt, drf = fast(eng.runner), fast(eng.proposer.runner)
    ctx = 128 + gen // 2
    # c and v at runner level (host work + sync included, as the engine pays them), and GPU-only
    prewarm(llm, batch, max(k for _, k in configs))
    t1 = time_runner(tgt, batch, 1, ctx)
    d1 = time_runner(drf, batch, 1, ctx)
    set_spec(llm, None, None)
    engine_decode(llm, batch, 128, 16, seed=98)
    # η compares with the synchronous engine (the one speculation runs in, and the one c and v are
    # measured against); the asynchronous no-speculation engine is reported beside it.
    def baseline() -> dict[str, float]:  # ``runs`` runs pooled, as for the speculative configs
        done = [engine_decode(llm, batch, 128, gen, seed=2 + 100 * i) for i in range(runs if batch == 1 else 1)]
        return {**done[0], "tokens": sum(r["tokens"] for r in done), "seconds": sum(r["seconds"] for r in done),
                "tok_s": sum(r["tokens"] for r in done) / sum(r["seconds"] for r in done)}

    eng.async_scheduling = False
    base = baseline()
    eng.async_scheduling = True
    base_async = baseline()
    res = {"baseline": base, "baseline_async": base_async, "target_step": t1, "draft_step": d1, "configs": {}}
    say(f"[{key}] b={batch} baseline {base['tok_s']:.1f} tok/s (asynchronous decode: {base_async['tok_s']:.1f}); "
        f"target step {t1['step_ms']:.3f} ms "
        f"(gpu {t1.get('gpu_ms', float('nan')):.3f}); draft step {d1['step_ms']:.3f} ms (gpu {d1.get('gpu_ms', float('nan')):.3f})")
    for alpha, k in configs:
        tv = time_runner(tgt, batch, k + 1, ctx)
        c = d1["step_ms"] / t1["step_ms"]
        v = tv["step_ms"] / t1["step_ms"] - 1
        c_g = d1.get("gpu_ms", float("nan")) / t1.get("gpu_ms", float("nan"))
        v_g = tv.get("gpu_ms", float("nan")) / t1.get("gpu_ms", float("nan")) - 1
        set_spec(llm, k, alpha)
        engine_decode(llm, batch, 128, 16, seed=97)  # warm-up: captures this k's graphs
        done = [engine_decode(llm, batch, 128, gen, seed=3 + i) for i in range(runs if batch == 1 else 1)]
        tok_s = sum(r["tokens"] for r in done) / sum(r["seconds"] for r in done)
        tau = sum(r["tokens"] for r in done) / max(1, sum(r["steps"] for r in done) * batch)
        speedup = tok_s / base["tok_s"]
        s_model = cost_model_speedup(alpha, k, c, max(0.0, v))  # v < 0 is timing noise
        s_real = tau / (k * c + 1 + max(0.0, v))
        row = {"alpha": alpha, "k": k, "tok_s": tok_s, "speedup": speedup,
               "speedup_vs_async": tok_s / base_async["tok_s"], "c": c, "v": v, "c_gpu": c_g,
               "v_gpu": v_g, "S": s_model, "eta": speedup / s_model, "tau": tau, "S_realised_tau": s_real,
               "eta_realised_tau": speedup / s_real, "S_gpu": cost_model_speedup(alpha, k, c_g, max(0.0, v_g)) if c_g == c_g else float("nan"),
               "verify_step": tv}
        row["eta_gpu"] = speedup / row["S_gpu"]
        res["configs"][f"a{alpha}_k{k}"] = row
        say(f"[{key}] b={batch} α={alpha} k={k}: {tok_s:.1f} tok/s, speedup {speedup:.3f}; c={c:.3f} v={v:.3f} "
            f"→ S={s_model:.3f}, η={row['eta']:.3f}; realised τ={tau:.3f} → S={s_real:.3f}, η={row['eta_realised_tau']:.3f}; "
            f"GPU-only c={c_g:.3f} v={v_g:.3f} → η={row['eta_gpu']:.3f}; vs asynchronous no-spec x{row['speedup_vs_async']:.3f}")
    set_spec(llm, None, None)
    RESULTS[key] = res


def section_sweep(llm: Any, batches: list[int], alpha: float = 0.6, k: int = 3, gen: int = 128,
                  key: str = "sweep") -> None:
    eng = llm.engine
    out = {}
    for b in batches:
        prewarm(llm, b, k)
        set_spec(llm, None, None)
        engine_decode(llm, b, 128, 8, seed=96)
        base = engine_decode(llm, b, 128, gen, seed=4)  # asynchronous decode (the CUDA default)
        eng.async_scheduling = False
        base_sync = engine_decode(llm, b, 128, gen, seed=4)
        eng.async_scheduling = True
        set_spec(llm, k, alpha)
        engine_decode(llm, b, 128, 8, seed=95)
        sp = engine_decode(llm, b, 128, gen, seed=5)
        set_spec(llm, None, None)
        ctx = 128 + gen // 2
        fl = floor_s(eng.model, eng.arch, b * ctx)
        r = time_runner(fast(eng.runner), b, 1, ctx, iters=10)
        out[b] = {"base_tok_s": base["tok_s"], "base_sync_tok_s": base_sync["tok_s"], "spec_tok_s": sp["tok_s"],
                  "spec_tau": sp["tau"],
                  "floor_tok_s": b / fl, "base_frac_floor": base["tok_s"] / (b / fl),
                  "runner_step": r, "runner_frac_floor": fl * 1e3 / r["step_ms"],
                  "gpu_frac_floor": fl * 1e3 / r["gpu_ms"] if "gpu_ms" in r else None}
        say(f"[{key}] 8B b={b}: no-spec {base['tok_s']:.0f} tok/s (synchronous {base_sync['tok_s']:.0f}; "
            f"{out[b]['base_frac_floor']:.1%} of floor "
            f"{b / fl:.0f}); spec α={alpha} k={k} {sp['tok_s']:.0f} tok/s (τ={sp['tau']:.2f}, "
            f"x{sp['tok_s'] / base['tok_s']:.2f}); runner step {r['step_ms']:.2f} ms, replay {r.get('gpu_ms', float('nan')):.2f} ms")
    RESULTS[key] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="ref,decode,variants,spec,smol,sweep,b64")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_suite_out"))
    ap.add_argument("--root", default="/tmp/tandem_gpu_suite")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy shapes on CPU: checks the script only")
    ap.add_argument("--spec-runs", type=int, default=2, help="engine runs per speculation config (batch 1)")
    ap.add_argument("--sweep-batches", default="1,8,32,128", help="batch sizes of the sweep section")
    args = ap.parse_args()
    global DEVICE, COPY_BW
    if args.cpu_smoke:
        DEVICE = "cpu"
        SHAPES.update(TINY)
    sections = args.sections.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.root)
    _dummy_draft_workaround(root)
    RESULTS["device"] = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)"
    RESULTS["date"] = time.strftime("%Y-%m-%d")
    say(f"device {RESULTS['device']}, torch {torch.__version__}")
    if DEVICE == "cuda":  # the floor is this card's: an H100's HBM3 copies ~30 % slower than the H200's
        from _common import copy_bandwidth
        bw = copy_bandwidth(1 << 30, repeats=10, device="cuda")
        COPY_BW = bw["median_GBps"] * 1e9
        RESULTS["copy_GBps"] = {"median": bw["median_GBps"], "max": bw["max_GBps"]}
        say(f"copy bandwidth {bw['median_GBps']:.0f} GB/s (median of 10 x 1 GiB; max {bw['max_GBps']:.0f}): every floor below uses it")

    def dump() -> None:
        (out / "gpu_suite.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        (out / "gpu_suite.log").write_text("\n".join(LOG) + "\n")

    def guarded(label: str, fn: Any, *a: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn(*a, **kw)
        except Exception:  # noqa: BLE001 - keep later sections running; the log says what failed
            say(f"[{label}] FAILED:\n{traceback.format_exc()}")
        say(f"[{label}] took {time.perf_counter() - t0:.1f} s")
        dump()

    llms: dict[str, Any] = {}
    t0 = time.perf_counter()
    d8, d1 = write_dummy_dir(root, "llama-3.1-8b"), write_dummy_dir(root, "llama-3.2-1b")
    need_8b = any(s in sections for s in ("ref", "decode", "variants", "spec", "sweep", "b64", "profile", "pdl", "rows"))
    if need_8b:
        llms["8b"] = make_llm(d8, draft=d1, kv_gib=12.0)
        llms["8b"].engine._suite_draft = str(d1)
        say(f"built 8B (+1B draft) engine in {time.perf_counter() - t0:.1f} s")
    if "ref" in sections:
        guarded("ref", lambda: RESULTS.setdefault("ref", {}).update({"8b": reference_check(llms["8b"], "8B")}))
    if "profile" in sections:
        guarded("profile", section_profile, llms["8b"])
    if "decode" in sections:
        guarded("decode-8b", section_decode, {"8B": llms["8b"]}, ["8B"])
    if "pdl" in sections:
        guarded("pdl-8b", section_variants, llms["8b"], variants=_PDL_VARIANTS, key="pdl")
    if "spec" in sections:
        guarded("spec", section_spec, llms["8b"], [(0.6, 3), (0.8, 3), (0.6, 5), (0.8, 5)], runs=args.spec_runs)
    if "variants" in sections:
        guarded("variants", section_variants, llms["8b"])
        guarded("variants-ctx1024", section_variants, llms["8b"], ctx=1024)
    if "b64" in sections:
        guarded("b64", section_sweep, llms["8b"], [64], key="b64")
    if "sweep" in sections:
        guarded("sweep", section_sweep, llms["8b"], [int(b) for b in args.sweep_batches.split(",")])
    if "w4" in sections:
        llms.pop("8b", None)
        torch.cuda.empty_cache()
        t1 = time.perf_counter()
        llms["8b-w4"] = make_llm(d8, draft=d1, kv_gib=12.0, quantization="int4")
        llms["8b-w4"].engine._suite_draft = str(d1)
        say(f"built 8B int4 (+1B bf16 draft) engine in {time.perf_counter() - t1:.1f} s")
        guarded("ref-w4", lambda: RESULTS.setdefault("ref", {}).update({"8b-int4": reference_check(llms["8b-w4"], "8B-int4")}))
        guarded("decode-w4", section_decode, {"8B-int4": llms["8b-w4"]}, ["8B-int4"])
        guarded("spec-w4", section_spec, llms["8b-w4"], [(0.6, 3), (0.8, 3), (0.6, 5), (0.8, 5)], runs=args.spec_runs,
                key="spec-w4")
        llms.pop("8b-w4", None)
    if "rows" in sections and "8b" in llms:
        guarded("rows-8b", section_variants, llms["8b"], variants=_ROWS_VARIANTS, key="rows",
                steps=((1, 1), (1, 4), (1, 6), (4, 1), (8, 1), (16, 1)))
    if any(s in sections for s in ("decode", "ref", "decode1b", "pdl", "timeline", "rows")):
        llms.pop("8b", None)
        torch.cuda.empty_cache()
        t1 = time.perf_counter()
        llms["1b"] = make_llm(d1, kv_gib=4.0)
        say(f"built 1B engine in {time.perf_counter() - t1:.1f} s")
        if "ref" in sections:
            guarded("ref-1b", lambda: RESULTS.setdefault("ref", {}).update(
                {"1b": reference_check(llms["1b"], "1B", fp32=True)}))
        if "decode" in sections or "decode1b" in sections:
            guarded("decode-1b", section_decode, {"1B": llms["1b"]}, ["1B"])
        if "pdl" in sections:
            guarded("pdl-1b", section_variants, llms["1b"], name="1B", variants=_PDL_VARIANTS, key="pdl")
        if "timeline" in sections:
            guarded("timeline-1b", section_timeline, llms["1b"], "1B", out)
        if "rows" in sections:
            guarded("rows-1b", section_variants, llms["1b"], name="1B", variants=_ROWS_VARIANTS, key="rows",
                    steps=_ROWS_STEPS)
        llms.pop("1b", None)
    if "smol" in sections:
        llms.clear()
        torch.cuda.empty_cache()
        ds = write_dummy_dir(root, "smollm2-135m")
        llms["smol"] = make_llm(ds, kv_gib=2.0)
        if "ref" in sections:
            guarded("ref-smol", lambda: RESULTS.setdefault("ref", {}).update({"smol": reference_check(llms["smol"], "SmolLM2")}))
        guarded("decode-smol", section_decode, {"SmolLM2-135M": llms["smol"]}, ["SmolLM2-135M"])
        if "rows" in sections:
            guarded("rows-smol", section_variants, llms["smol"], name="SmolLM2", variants=_ROWS_VARIANTS,
                    key="rows", steps=_ROWS_STEPS)
        if "hostprof" in sections:
            guarded("hostprof", section_hostprof, llms["smol"], out)
    dump()
    say("\n" + summary_table())
    dump()


def summary_table() -> str:
    lines = ["| what | result |", "|---|---|"]
    for name, r in RESULTS.get("decode", {}).items():
        lines.append(f"| {name} b=1 decode | floor {r['floor_tok_s']:.0f} tok/s; graph replay {1e3 / r.get('gpu_ms', float('nan')):.0f} tok/s "
                     f"({r['frac_gpu']:.1%}); runner {1e3 / r['step_ms']:.0f} tok/s ({r['frac_step']:.1%}); engine "
                     f"{r['engine_tok_s']:.0f} tok/s ({r['frac_engine']:.1%}) |")
    for key in ("spec", "spec-w4"):
        for cfg, r in RESULTS.get(key, {}).get("configs", {}).items():
            lines.append(f"| 8B{'-int4' if key == 'spec-w4' else ''}+1B b=1 α={r['alpha']} k={r['k']} | {r['tok_s']:.0f} tok/s, x{r['speedup']:.2f}; c={r['c']:.3f} "
                         f"v={r['v']:.3f}; S={r['S']:.2f} η={r['eta']:.3f} (τ={r['tau']:.2f}: η={r['eta_realised_tau']:.3f}) |")
    for key in ("b64", "sweep"):
        for b, r in RESULTS.get(key, {}).items():
            lines.append(f"| 8B b={b} | no spec {r['base_tok_s']:.0f} tok/s ({r['base_frac_floor']:.1%} of floor); "
                         f"spec α=0.6 k=3 {r['spec_tok_s']:.0f} tok/s |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
