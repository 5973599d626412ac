"""CUDA fast path: Triton paged attention, fused layers, CUDA-graph runner (skipped without CUDA).

References: a float64 torch attention over the same paged metadata; ``CausalLM.forward`` with the
torch runner (``RunnerConfig(backend="torch")``) for whole-model checks. bf16 comparisons use
relative error ‖out − ref‖ / ‖ref‖ (bf16 operands land between 1e-3 and 1e-2).
"""

from __future__ import annotations

import random

import pytest
import torch

from gpu_utils import Seqs as _Seqs, rel as _rel, tiny_model as _tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _paged_case(seed: int, heads: int, kvh: int, d: int, page: int, qlens: list[int], ctxs: list[int],
                dtype: torch.dtype, pad_to: int | None = None):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    rng = random.Random(seed)
    nblocks = sum(-(-c // page) for c in ctxs) + 3
    k_cache = torch.randn(nblocks * page, kvh, d, generator=g, device=dev).to(dtype)
    v_cache = torch.randn(nblocks * page, kvh, d, generator=g, device=dev).to(dtype)
    perm = list(range(nblocks))
    rng.shuffle(perm)
    tables = [[perm.pop() for _ in range(-(-c // page))] for c in ctxs]
    w = max(1, max(len(t) for t in tables))
    bt = torch.zeros(len(ctxs), w, dtype=torch.int32, device=dev)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    if pad_to:
        qs = [i * pad_to for i in range(len(qlens) + 1)]
    else:
        qs = [0]
        for q in qlens:
            qs.append(qs[-1] + q)
    q = torch.randn(qs[-1], heads, d, generator=g, device=dev).to(dtype)
    meta = dict(block_tables=bt, seq_lens=torch.tensor(ctxs, device=dev), query_start=torch.tensor(qs, device=dev),
                query_lens=torch.tensor(qlens, device=dev))
    return q, k_cache, v_cache, tables, qs, meta


CASES = [
    # heads, kv heads, head dim, block size, query lens, context lens
    (32, 8, 128, 16, [1], [300]),  # 8B-shaped decode
    (32, 8, 128, 16, [1, 1, 1, 1], [5, 77, 513, 1]),
    (32, 8, 128, 16, [4, 4], [90, 200]),  # k=3 verify
    (32, 8, 128, 32, [6, 1, 3], [64, 64, 700]),  # mixed verify lengths
    (9, 3, 64, 16, [1, 2], [40, 41]),  # SmolLM2-shaped (G=3)
    (8, 8, 64, 1, [3], [50]),  # MHA, block size 1
    (16, 4, 128, 16, [100, 1], [130, 10]),  # prefill chunk with context + decode
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_matches_reference(case, splits, dtype):
    from tandem.worker.triton_attention import paged_attention_triton, reference_attention

    heads, kvh, d, page, qlens, ctxs = case
    q, kc, vc, tables, qs, m = _paged_case(0, heads, kvh, d, page, qlens, ctxs, dtype)
    out = paged_attention_triton(q, kc, vc, m["block_tables"], m["seq_lens"], m["query_start"], m["query_lens"],
                                 page, d**-0.5, max(qlens), splits)
    ref = reference_attention(q, kc, vc, tables, ctxs, qs[:-1], qlens, page, d**-0.5)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-2


def test_paged_attention_window_and_padding():
    from tandem.worker.triton_attention import paged_attention_triton, reference_attention

    q, kc, vc, tables, qs, m = _paged_case(1, 8, 2, 64, 16, [3, 1, 0], [40, 9, 0], torch.bfloat16, pad_to=4)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, m["block_tables"], m["seq_lens"], m["query_start"], m["query_lens"],
                           16, 0.125, 4, 3, sliding_window=8, out=out)
    ref = reference_attention(q, kc, vc, tables, [40, 9, 0], qs[:-1], [3, 1, 0], 16, 0.125, sliding_window=8)
    assert torch.isfinite(out).all(), "padding rows must be written (zeros)"
    assert (out[3:4] == 0).all() and (out[5:] == 0).all()
    assert _rel(out, ref) < 1e-2


def test_write_kv_skips_negative_slots():
    from tandem.worker.triton_attention import write_kv_triton

    dev = torch.device("cuda")
    kc = torch.zeros(32, 2, 64, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    kv = torch.randn(3, 2 * 2 * 64, device=dev).to(torch.bfloat16)
    k = kv[:, :128].view(3, 2, 64)  # strided views, as cut from a packed qkv
    v = kv[:, 128:].view(3, 2, 64)
    write_kv_triton(kc, vc, k, v, torch.tensor([7, -1, 0], device=dev))
    assert torch.equal(kc[7], k[0]) and torch.equal(vc[0], v[2])
    assert int((kc.abs().sum((1, 2)) > 0).sum()) == 2


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("fusion", ["none", "bias", "norm", "norm_gated", "res"])
@pytest.mark.parametrize("dot", [False, True])
def test_gemv_matches_reference(m, fusion, dot):
    from tandem.worker.triton_gemv import gemv

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(m)
    n, k = 1000, 1000  # neither a multiple of any block size
    w = torch.randn(2 * n if fusion == "norm_gated" else n, k, device=dev, generator=g).to(dt) / k ** 0.5
    x = torch.randn(m, k, device=dev, generator=g).to(dt)
    bias = torch.randn(w.shape[0], device=dev, generator=g).to(dt) if fusion in ("bias", "norm_gated") else None
    nw = (torch.rand(k, device=dev, generator=g) + 0.5).to(dt)
    res = torch.randn(m, n, device=dev, generator=g).to(dt)
    xf = x.float()
    if fusion.startswith("norm"):  # the unfused reference: rmsnorm rounded to bf16, then the matmul
        xf = ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt).float() * nw.float()).to(dt).float()
    want = xf @ w.float().T + (bias.float() if bias is not None else 0)
    if fusion == "norm_gated":
        want = torch.nn.functional.silu(want[:, :n]) * want[:, n:]
    if fusion == "res":
        want = res.float() + want.to(dt).float()
        r = res.clone()
        got = gemv(x, w, residual=r, dot=dot)
        assert got.data_ptr() == r.data_ptr()
    else:
        got = gemv(x, w, bias, norm_weight=nw if fusion.startswith("norm") else None, eps=1e-5,
                   gated=fusion == "norm_gated", dot=dot)
    assert got.shape == (m, n) and got.dtype == dt
    assert _rel(got.float(), want) < 1e-2


@pytest.mark.parametrize("fusion,n", [
    ("norm", 960), ("norm_gated", 1536), ("res", 576),  # SmolLM2's qkv, gate_up, o: triton_gemv.SHAPE_CONFIGS
    ("norm_gated", 960), ("res", 960),  # tiles from gemv_config's rule
])
def test_gemv_rows_are_one_row_products(fusion, n):
    """Several rows (one program per row): every row bit-identical to that row alone."""
    from tandem.worker.triton_gemv import gemv

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(7)
    k, m = 576, 6
    w = (torch.randn(2 * n if fusion == "norm_gated" else n, k, device=dev, generator=g) / k ** 0.5).to(dt)
    x = torch.randn(m, k, device=dev, generator=g).to(dt)
    nw = (torch.rand(k, device=dev, generator=g) + 0.5).to(dt)
    res = torch.randn(m, n, device=dev, generator=g).to(dt)

    def run(rows: slice) -> torch.Tensor:
        if fusion == "res":
            return gemv(x[rows], w, residual=res[rows].clone())
        return gemv(x[rows], w, norm_weight=nw, eps=1e-5, gated=fusion == "norm_gated")

    together = run(slice(0, m))
    for i in range(m):
        assert torch.equal(together[i], run(slice(i, i + 1))[0]), i


def test_logits_are_float32_products_on_cuda():
    """bf16 weights, float32 logits that were never rounded to bf16 (fewer argmax ties)."""
    model = _tiny_model("llama")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3, 256, device="cuda", generator=g).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    w = model.lm_head.weight
    want = hidden.double() @ w.double().T
    assert logits.dtype == torch.float32
    assert _rel(logits.double(), want) < 1e-5  # bf16-rounded logits would be ~1e-3 away
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_runner_matches_torch_path(family):
    from tandem.config import RunnerConfig
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.worker.runner import make_runner

    model = _tiny_model(family)
    arch, dev, bs = model.arch, torch.device("cuda"), 16

    def runner(**cfg):
        return make_runner(model, allocate_kv_cache(arch, 64, bs, torch.bfloat16, dev), bs, dev, RunnerConfig(**cfg))

    ref = runner(backend="torch")
    assert type(ref).__name__ == "TorchRunner"
    runners = {
        "graphs": runner(),
        "eager": runner(cuda_graphs=False),
        "unfused": runner(fused=False),
        "cublas": runner(skinny_rows=0),  # fused layers with cuBLAS matmuls for every row count
        "gemv16": runner(skinny_rows=16),  # skinny Triton matmuls for every step of <= 16 rows
        "gemv16_dot": runner(skinny_rows=16, skinny_multirow="dot"),  # ... on 16-row tensor-core tiles
    }
    assert type(runners["graphs"]).__name__ == "GpuModelRunner"
    seqs = _Seqs(0, (40, 17, 3))

    def step(plan: list[tuple[int, int]]) -> None:
        chunks, rows = seqs.step(plan)
        want = ref.forward_logits(chunks, rows)
        for name, r in runners.items():
            got = r.forward_logits(chunks, rows)
            assert got.shape == want.shape
            assert _rel(got, want) < 2e-2, (name, plan)
        seqs.advance(plan)

    step([(0, 40), (1, 17), (2, 3)])  # prefills (eager)
    for _ in range(3):
        step([(0, 1), (1, 1), (2, 1)])  # decodes (graph bucket 4, q=1)
    step([(0, 4), (1, 4), (2, 4)])  # verifies (q=4)
    step([(0, 1), (1, 3)])  # ragged draft catch-up (padded)
    for _ in range(2):
        step([(2, 1)])  # lone decodes (graph bucket 1, q=1: the 1-row skinny matmuls by default)
    assert runners["graphs"].num_graph_steps > 0 and runners["graphs"].graphs.graphs


def test_warm_up_compiles_every_step_variant():
    """After ``warm_up`` no step shape compiles a Triton kernel: short and long prefills (one split /
    several), decodes, verifies, batched steps (a compile mid-serving is a ~0.5-0.9 s stall)."""
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.sample.argmax import greedy_ids
    from tandem.worker import triton_argmax, triton_attention, triton_dot, triton_gemv, triton_ops
    from tandem.config import RunnerConfig
    from tandem.worker.batch import SeqChunk
    from tandem.worker.gpu_runner import GpuModelRunner

    kernels = [triton_attention._attn_kernel, triton_attention._merge_kernel, triton_ops._rope_kv_kernel,
               triton_ops._rmsnorm_kernel, triton_gemv._gemv_kernel, triton_argmax._partial_argmax_kernel,
               triton_argmax._final_argmax_kernel, triton_dot._dot_kernel]
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton does not expose its kernel caches")

    def compiled() -> int:
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    model = _tiny_model("llama", num_attention_heads=8, num_key_value_heads=2)  # G = 4
    dev, bs = torch.device("cuda"), 16
    r = GpuModelRunner(model, allocate_kv_cache(model.arch, 64, bs, torch.bfloat16, dev), bs, dev,
                       RunnerConfig(cuda_graphs=False))
    r.compile_kernels()
    before = compiled()
    rng = random.Random(3)
    blocks = [list(range(i * 20, i * 20 + 20)) for i in range(3)]
    lens = [3, 40, 200]  # a short prefill runs unsplit; longer ones split the keys
    for i, n in enumerate(lens):
        toks = [rng.randrange(3, 512) for _ in range(n)]
        greedy_ids(r.forward_logits([SeqChunk(toks, 0, blocks[i])], [n - 1]))
    chunks = [SeqChunk([5], n, blocks[i]) for i, n in enumerate(lens)]
    greedy_ids(r.forward_logits(chunks, [0, 1, 2]))  # batched decode
    greedy_ids(r.forward_logits(chunks[:1], [0]))  # 1-row decode (skinny matmuls)
    verify = [SeqChunk([5, 6, 7, 8], n + 1, blocks[i]) for i, n in enumerate(lens)]
    greedy_ids(r.forward_logits(verify, list(range(12))))
    assert compiled() == before


@pytest.mark.parametrize("rows", [1, 6, 64])
def test_greedy_argmax_kernel_matches_torch(rows):
    from tandem.sample.argmax import greedy_ids

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 128256, device="cuda", generator=g)
    x[0, 70000] = x[0, 3] = 1e4  # equal maxima in different pieces: the lower id wins
    if rows > 1:
        x[1, 9000] = x[1, 9001] = 1e4  # inside one piece
        x[-1] = float("-inf")
    assert torch.equal(greedy_ids(x), x.argmax(dim=-1))
    assert torch.equal(greedy_ids(x[:, 1:]), x[:, 1:].argmax(dim=-1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_programmatic_dependent_launch_changes_no_bit(family):
    """PDL lets each kernel start before its predecessor ends; a kernel that touched activations before
    its ``griddepcontrol.wait`` would race. Logits with PDL must equal the ones without, bit for bit, across prefill, 1-row decodes (skinny matmuls), a batched
    decode and a verify, in CUDA graphs and eagerly."""
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.config import RunnerConfig
    from tandem.worker.gpu_runner import GpuModelRunner
    from tandem.worker.pdl import pdl_enabled, set_pdl

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability() >= (9, 0):
        assert pdl_enabled(dev)  # the comparison below must exercise PDL where it exists
    model = _tiny_model(family, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=64)
    arch, bs = model.arch, 16
    envs = {"off": False, "on": True, "eager": True}  # PDL on?
    runners = {name: GpuModelRunner(model, allocate_kv_cache(arch, 64, bs, torch.bfloat16, dev), bs, dev,
                                    RunnerConfig(cuda_graphs=name != "eager", pdl=envs[name])) for name in envs}

    def run(name: str, fn):  # the switch is read when kernels are launched or captured (process-wide)
        set_pdl(envs[name])
        try:
            return fn(runners[name])
        finally:
            set_pdl(True)

    for name in envs:
        if name != "eager":
            run(name, lambda r: r.capture([1, 2], [1, 4]))
    seqs = _Seqs(1, (70, 33))
    for plan in [[(0, 70), (1, 33)]] + [[(0, 1)]] * 6 + [[(0, 1), (1, 1)]] * 2 + [[(0, 4), (1, 4)]] + [[(1, 1)]] * 3:
        chunks, rows = seqs.step(plan)
        want = run("off", lambda r: r.forward_logits(chunks, rows).clone())
        for name in envs:
            assert torch.equal(run(name, lambda r: r.forward_logits(chunks, rows)), want), (name, plan)
        seqs.advance(plan)
    assert runners["on"].num_graph_steps > 0


@pytest.mark.parametrize("mode", ["graph", "graph_fit", "eager"])
def test_runner_token_ids_feed(mode):
    """Device-side tokens (the draft loop's feed) give the same logits as host tokens, whichever
    buffer layout the step uses (exact bucket, a larger captured q bucket, eager)."""
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.config import RunnerConfig
    from tandem.worker.batch import SeqChunk
    from tandem.worker.gpu_runner import GpuModelRunner

    model = _tiny_model("llama")
    arch, dev, bs = model.arch, torch.device("cuda"), 16
    r = GpuModelRunner(model, allocate_kv_cache(arch, 64, bs, torch.bfloat16, dev), bs, dev,
                       RunnerConfig(cuda_graphs=mode != "eager"))
    if mode == "graph_fit":
        r.capture([2], [4])  # a q=1 step then runs padded in the (2, 4) graph
    blocks = [list(range(0, 4)), list(range(4, 8))]
    prompts = [[5, 9, 11, 3], [7, 7, 2]]
    r.forward_logits([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], [3, 6])
    steps = [SeqChunk([t], len(p), b) for p, b, t in zip(prompts, blocks, [13, 17])]
    want = r.forward_logits(steps, [0, 1]).clone()
    fed = [SeqChunk([0], c.start, c.block_ids) for c in steps]
    got = r.forward_logits(fed, [0, 1], token_ids=torch.tensor([13, 17], device=dev))
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["graph", "graph_fit", "eager"])
def test_runner_fed_rows(mode):
    """Drafts fed on the device into chosen query rows of a verify step (``FedTokens``: EAGLE's drafts
    never read before the verify) give the logits of the same step with the ids packed on the host,
    whichever buffer layout it uses."""
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.config import RunnerConfig
    from tandem.worker.batch import FedTokens, SeqChunk
    from tandem.worker.gpu_runner import GpuModelRunner

    model = _tiny_model("llama")
    arch, dev, bs = model.arch, torch.device("cuda"), 16
    r = GpuModelRunner(model, allocate_kv_cache(arch, 64, bs, torch.bfloat16, dev), bs, dev,
                       RunnerConfig(cuda_graphs=mode != "eager"))
    if mode == "graph_fit":
        r.capture([2], [8])  # the (2, 4) verify then runs padded in the (2, 8) graph
    blocks = [list(range(0, 4)), list(range(4, 8))]
    prompts = [[5, 9, 11, 3], [7, 7, 2]]
    r.forward_logits([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], [3, 6])
    queries = [[13, 21, 22, 23], [17, 31]]  # bonus token + 3 drafts, bonus token + 1 draft
    steps = [SeqChunk(q, len(p), b) for p, b, q in zip(prompts, blocks, queries)]
    rows = list(range(6))
    want = r.forward_logits(steps, rows).clone()
    drafts = torch.tensor([31, 21, 22, 23, 99], device=dev)  # flat device drafts, in another order
    placeholders = [SeqChunk([q[0]] + [-1] * (len(q) - 1), c.start, c.block_ids) for q, c in zip(queries, steps)]
    got = r.forward_logits(placeholders, rows, fed=FedTokens(drafts, (1, 2, 3, 0), (1, 2, 3, 5)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["graph", "graph_fit", "eager"])
def test_runner_chained_step(mode):
    """A step chained on a verify still on the device (``chain``: its first ids and positions fixed
    there from the verify's row argmaxes) gives the logits of the same step packed where the
    verify's outcome puts it, whichever buffer layout it uses."""
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.config import RunnerConfig
    from tandem.worker.batch import ChainedFrom, SeqChunk
    from tandem.worker.gpu_runner import GpuModelRunner

    model = _tiny_model("llama")
    arch, dev, bs = model.arch, torch.device("cuda"), 4
    r = GpuModelRunner(model, allocate_kv_cache(arch, 64, bs, torch.bfloat16, dev), bs, dev,
                       RunnerConfig(cuda_graphs=mode != "eager"))
    if mode == "graph_fit":
        r.capture([2], [8])
    blocks = [list(range(0, 6)), list(range(6, 12))]
    prompts = [[5, 9, 11, 3, 8, 8, 1], [7, 7, 2, 4, 4]]
    r.forward_logits([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], [6, 11])
    # the verify before: request 0 checked drafts (21, 22, 23, 24) and accepted 1 (emits 40);
    # request 1 checked (31,) and accepted it (emits 41)
    verify_rows = torch.tensor([21, 40, 50, 60, 70, 31, 41], device=dev)
    chain = ChainedFrom(verify_rows, (0, 5), ((21, 22, 23, 24), (31,)))
    queries = [[40, 13, 14], [41, 17]]
    steps = [SeqChunk(q, len(p), b) for p, b, q in zip(prompts, blocks, queries)]
    rows = list(range(5))
    want = r.forward_logits(steps, rows).clone()
    packed = [SeqChunk([0, *c.token_ids[1:]], c.start + s, c.block_ids) for c, s in zip(steps, (3, 0))]
    got = r.forward_logits(packed, rows, chain=chain)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(12))
def test_chain_fixup_kernel_matches_torch(seed):
    """The one-launch Triton fix-up writes what the torch reference writes (worker/chain.py)."""
    import numpy as np
    from test_chain import _case

    from tandem.worker.chain import chain_fixup, chain_width, pack_chain
    from tandem.worker.input_packer import pack

    bs, n, _, assumed, qlens, chain, _ = _case(seed)
    w = max(len(c.block_ids) for c in assumed)
    buf = np.zeros(8192, dtype=np.int64)
    length, t, _, _ = pack(bs, buf, assumed, qlens, n, max(qlens), w, None)
    _, off = pack_chain(buf, length, chain, qlens, max(qlens))
    cpu = torch.from_numpy(buf.copy())
    gpu = torch.from_numpy(buf.copy()).cuda()
    chain_fixup(cpu, t, n, w, bs, off, n, chain_width(chain), chain.row_tokens, max(qlens))
    chain_fixup(gpu, t, n, w, bs, off, n, chain_width(chain), chain.row_tokens.cuda(), max(qlens))
    assert torch.equal(gpu.cpu(), cpu)


def test_engine_generates_same_tokens_with_and_without_graphs(tmp_path, monkeypatch):
    from engine_utils import greedy, tokens_of
    from tiny_models import write_tiny_hf_checkpoint
    from tandem import LLM

    path = write_tiny_hf_checkpoint(tmp_path, "llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    prompts = [[5 + i, 9, 17, 33, 40 + i] for i in range(3)]

    def run(**env: str) -> list[list[int]]:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        llm = LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
                  enable_prefix_caching=False)
        out = tokens_of(llm.generate(prompts, greedy(16)))
        for k in env:
            monkeypatch.delenv(k)
        return out

    graphs = run()
    eager = run(TANDEM_CUDA_GRAPHS="0")
    assert graphs == eager


@pytest.mark.parametrize("spec", [None, "ngram", "suffix", "eagle3"])
def test_nothing_is_captured_or_compiled_while_serving(tmp_path, spec):
    """The engine captures the graph of every batch bucket up to max_num_seqs when it starts (every
    query length at batch <= 8, decodes and full verifies above) and compiles every kernel variant:
    serving 40 requests at once (the batch shrinking through every bucket as they finish; n-gram
    verifies of every length) captures no graph and compiles no Triton kernel. Suffix decoding's
    k = 24 is cut to the graphs' query length (7 drafts + 1). An EAGLE-3 head's steps (its fused
    kernels, its catch-ups over whole prompts, its graphs) neither."""
    from eagle_heads import write_eagle_head
    from engine_utils import greedy
    from tiny_models import write_tiny_hf_checkpoint
    from tandem import LLM
    from tandem.worker.compile_state import compiled_variants as _compiled_variants
    from tandem.worker.cuda_graphs import warm_up_plan

    path = write_tiny_hf_checkpoint(tmp_path, "llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cfg = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "disable_by_acceptance": False},
           "suffix": {"method": "suffix", "disable_by_acceptance": False}, None: None}.get(spec)
    if spec == "eagle3":
        head, _ = write_eagle_head(tmp_path, "speculators", path, aux=(1, 2, 3), draft_vocab=128)
        cfg = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "disable_by_acceptance": False}
    llm = LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=256 << 20, max_num_seqs=40,
              enable_prefix_caching=False, speculative_config=cfg)
    graphs = llm.engine.runner.graphs
    k = {"ngram": 3, "eagle3": 3, "suffix": llm.engine.runner.max_graph_q - 1, None: 0}[spec]
    assert spec is None or (llm.engine.speculator.k == k and k < 24)
    want = {(b, q) for sizes, qs in warm_up_plan(40, 256, k + 1) for b in sizes for q in qs}
    assert set(graphs.graphs) == want and (40, 1) in want
    head = llm.engine.proposer.runner if spec == "eagle3" else None
    head_graphs = lambda: ((set(head.graphs.graphs), set(head.graphs_f.graphs), set(head.graphs_c.graphs))  # noqa: E731
                           if head else None)
    before, before_head, compiled = set(graphs.graphs), head_graphs(), _compiled_variants()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(4, 120))] for _ in range(40)]
    outs = llm.generate(prompts, [greedy(4 + 3 * i) for i in range(40)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4 + 3 * i for i in range(40)]
    assert set(graphs.graphs) == before and head_graphs() == before_head
    now = _compiled_variants()
    assert {k: now[k] - compiled.get(k, set()) for k in now if now[k] - compiled.get(k, set())} == {}
    if spec:
        assert llm.engine.stats.spec.num_drafts > 0


def test_async_decode_on_cuda_matches_sync(tmp_path, monkeypatch):
    """Asynchronous decode (next step queued before the tokens are read, tokens fed on the device):
    same bf16 tokens as the synchronous engine (same kernels, same shapes), stops included.

    The one step already queued when a request finishes still carries it (batch 5, bucket 8 here)
    where the synchronous engine runs without it (batch 4). On a small model those take different
    layer bodies (one program per row up to 6 rows, tensor cores above: cuda_kernels.default_row_rows),
    which round differently in bf16, so the body is pinned to cuBLAS above 1 row for this check."""
    from engine_utils import greedy, tokens_of
    from tiny_models import write_tiny_hf_checkpoint
    from tandem import LLM

    monkeypatch.setenv("TANDEM_GEMV_ROWS", "1")

    path = write_tiny_hf_checkpoint(tmp_path, "llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    prompts = [[5 + i, 9, 17, 33, 40 + i] for i in range(5)]
    llms = [LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20, async_scheduling=a)
            for a in (False, True)]
    assert llms[1].engine.async_scheduling and not llms[0].engine.async_scheduling
    probe = tokens_of(llms[0].generate(prompts, greedy(12)))[1]  # same batch as below (bf16 kernels vary with it)
    params = [greedy(24), greedy(16, stop_token_ids=[probe[6]]), greedy(9), greedy(24), greedy(20)]
    sync, asy = ([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
                 for llm in llms)
    assert asy == sync
    assert sync[1][1] == "stop"
    assert llms[1].engine.num_chained_steps >= 15


def test_sampled_async_decode_on_cuda_matches_sync(tmp_path):
    """Sampled requests (temperature, top-k, top-p, min-p; seeded) chain asynchronously on CUDA with
    the tokens drawn on the device, and give the synchronous engine's tokens (same kernels: every
    request runs to the same length, so no step carries a finished row)."""
    from tiny_models import write_tiny_hf_checkpoint
    from tandem import LLM, SamplingParams

    path = write_tiny_hf_checkpoint(tmp_path, "llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    prompts = [[5 + i, 9, 17, 33, 40 + i] for i in range(5)]
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.8, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.1, min_p=0.05, top_k=50, top_p=0.9, seed=4, max_tokens=20,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    llms = [LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20, async_scheduling=a)
            for a in (False, True)]
    sync, asy = ([o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in llms)
    assert asy == sync
    assert llms[1].engine.num_chained_steps >= 15


def test_sampling_queues_without_a_host_sync():
    """Logits processing, the sampling distribution and the draw queue their work on the device
    without waiting for it (sample/upload.py): with CUDA's sync debug mode set to error, none of
    them synchronises. (The token read is the one sync, made by the caller.)"""
    from tandem import SamplingParams as SP
    from tandem.sample.logits import probs_from_logits, process_logits
    from tandem.sample.rows import SamplingRow
    from tandem.sample.sampler import sample
    from tandem.sample.seeded import SeededStream

    dev = torch.device("cuda")
    logits = torch.randn(6, 1000, device=dev)
    rows = [SamplingRow(SP(temperature=0.8), [1, 2], [3]),
            SamplingRow(SP(temperature=1.0, top_k=20, seed=3), [1, 2], [3, 4], (), SeededStream(3)),
            SamplingRow(SP(temperature=0.7, top_p=0.9), [1], []),
            SamplingRow(SP(temperature=1.2, min_p=0.1, top_k=40, top_p=0.95), [1], [7]),
            SamplingRow(SP(temperature=0.0), [1], [2]),
            SamplingRow(SP(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1,
                           logit_bias={5: 2.0}, min_tokens=4, max_tokens=8), [1, 5], [5, 6], (0,))]
    gen = torch.Generator(device=dev).manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample(probs_from_logits(process_logits(logits, rows), rows), rows, gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (6,) and int(tokens[4]) == int(logits[4].argmax())


def test_speculative_engine_on_cuda(tmp_path):
    from engine_utils import greedy, tokens_of
    from tiny_models import write_tiny_hf_checkpoint
    from tandem import LLM

    target = write_tiny_hf_checkpoint(tmp_path, "llama", name="t", vocab_size=256, hidden_size=128,
                                      intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    draft = write_tiny_hf_checkpoint(tmp_path, "llama", name="d", seed=1, vocab_size=256, hidden_size=64,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    prompts = [[5, 9, 17, 33, 40], [7, 7, 7]]
    plain = LLM(str(target), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
                enable_prefix_caching=False)
    spec = LLM(str(target), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
               enable_prefix_caching=False,
               speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                                   "disable_by_acceptance": False})  # draft every step
    a = tokens_of(plain.generate(prompts, greedy(20)))
    b = tokens_of(spec.generate(prompts, greedy(20)))
    # float32 on GPU: verify (k+1 rows) and decode (1 row) kernels may round differently, so demand
    # near-equality rather than identity.
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    assert same >= 0.9 * sum(len(p) for p in a)


def test_ngram_acceptance_gate_on_cuda(tmp_path):
    """n-gram on CUDA drafts under the goodput policy by default (spec_decode/policy.py); with it,
    without it and plain decoding give (near-)identical bf16 tokens (verify rows take the same skinny matmuls as decode
    rows on small models; attention over k + 1 queries may still round differently)."""
    from engine_utils import greedy, tokens_of
    from tiny_models import write_tiny_hf_checkpoint
    from tandem import LLM

    path = write_tiny_hf_checkpoint(tmp_path, "llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    plain = LLM(str(path), **kw)
    gated = LLM(str(path), speculative_config=ngram, **kw)
    ungated = LLM(str(path), speculative_config={**ngram, "disable_by_acceptance": False}, **kw)
    assert gated.engine.policy is not None and ungated.engine.policy is None
    prompts = [[5, 9, 17, 33, 40] * 4, [7, 7, 7, 7], [3, 11, 29, 60, 61, 62]]
    want = [tokens_of(plain.generate([p], greedy(40)))[0] for p in prompts]  # batch 1, as below
    for llm in (gated, ungated):
        got = [tokens_of(llm.generate([p], greedy(40)))[0] for p in prompts]
        same = sum(x == y for p, q in zip(want, got) for x, y in zip(p, q))
        assert same >= 0.9 * sum(len(p) for p in want)
    assert ungated.engine.stats.spec.num_drafts > 0
    assert sum(gated.engine.stats.spec.chosen_k) > 0  # the policy decided (drafting where it pays)
    policy = gated.engine.policy
    assert policy.acceptance.num_scored > 0 and not policy._pending and not policy.acceptance._reqs


def test_admission_groups_default_on_with_cuda_graphs(tmp_path):
    """With CUDA graphs a queue longer than the free seats is admitted in groups of max_num_seqs // 8
    (each admitting step is an eager prefill that breaks the asynchronous chain); eager engines admit at
    once. Every request still gets its tokens."""
    from engine_utils import greedy
    from tiny_models import write_tiny_hf_checkpoint
    from tandem import LLM

    path = write_tiny_hf_checkpoint(tmp_path, "llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    kw = {"device": "cuda", "dtype": "bfloat16", "kv_cache_memory_bytes": 128 << 20, "max_num_seqs": 32}
    assert LLM(str(path), enforce_eager=True, **kw).engine.scheduler.admission_group == 1
    llm = LLM(str(path), **kw)
    assert llm.engine.scheduler.admission_group == 4
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 40))] for _ in range(100)]
    outs = llm.generate(prompts, [greedy(6 + i % 13) for i in range(100)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6 + i % 13 for i in range(100)]
    assert llm.engine.num_chained_steps > 0 and llm.engine.pool.all_free()


def test_graph_capture_runs_without_cyclic_garbage_collection():
    """A dead engine's graphs (or Triton kernels) finalized by an automatic cyclic collection
    mid-capture invalidate the capture (torch >= 2.9 no longer collects before capturing):
    GraphCache turns the automatic collector off for the capture and restores it after."""
    import gc

    from tandem.worker.cuda_graphs import GraphCache

    x = torch.zeros(4, device="cuda")
    seen = []

    def run():
        seen.append(gc.isenabled())
        return x * 2

    cache = GraphCache(torch.device("cuda"))
    assert gc.isenabled()
    step = cache.capture((1, 1), run)
    assert seen == [True, False] and gc.isenabled()  # the warm-up run outside the capture, then inside
    gc.disable()
    try:
        cache.capture((2, 1), run)
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()
    x.fill_(3.0)
    step.graph.replay()
    assert step.logits.tolist() == [6.0] * 4
