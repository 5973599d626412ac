"""EAGLE on the CUDA fast path (skipped without CUDA): the target's runner returns features from its
graphs and eager steps as the torch runner does; the CUDA head runner (Triton attention, graphs)
drafts what the torch head runner drafts; the engine stays lossless with a head on CUDA."""

from __future__ import annotations

import pytest
import torch

from gpu_utils import Seqs, rel, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_target_runner_returns_and_caches_features_of_every_row():
    """The runner returns the features of every query row, and writes them to their slots in the
    feature cache — from its graphs (padded rows write only the spare row) and its eager steps —
    whether or not ``forward`` asked for them (the engine calls ``forward_logits``)."""
    from tandem.config import RunnerConfig
    from tandem.kv.feature_cache import FeatureCache
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.worker.runner import make_runner

    model = tiny_model("llama", num_hidden_layers=4)
    arch, dev, bs = model.arch, torch.device("cuda"), 16
    layers = (1, 2, arch.num_layers)  # two aux layers and the final post-norm hidden state

    def runner(**cfg):
        cache = FeatureCache(3 * arch.hidden_size, 64, bs, torch.bfloat16, dev)
        return make_runner(model, allocate_kv_cache(arch, 64, bs, torch.bfloat16, dev), bs, dev,
                           RunnerConfig(**cfg), feature_layers=layers, feature_cache=cache)

    ref, fast, eager = runner(backend="torch"), runner(), runner(cuda_graphs=False)
    seqs = Seqs(0, (40, 17, 3))
    for n, plan in enumerate(([(0, 40), (1, 17), (2, 3)], [(0, 1), (1, 1), (2, 1)], [(0, 4), (1, 4), (2, 4)],
                              [(0, 1), (1, 3)], [(2, 1)])):
        chunks, rows = seqs.step(plan)
        sampled = rows[-1:]  # logits of one row only: features still cover every query row
        want = ref.forward(chunks, sampled, aux_layers=layers)
        want_f = torch.cat(want.aux_hidden, dim=-1)
        slots = torch.cat([torch.from_numpy(fast.feature_cache.slots(c.block_ids, c.start, c.start + len(c.token_ids)))
                           for c in chunks]).to(dev)
        for r in (fast, eager):
            if n % 2:
                got = r.forward(chunks, sampled, aux_layers=layers)
                assert len(got.aux_hidden) == 1 and got.aux_hidden[0].shape == want_f.shape, plan
                assert rel(got.aux_hidden[0], want_f) < 2e-2, plan
                logits = got.logits
            else:
                logits = r.forward_logits(chunks, sampled)
            assert rel(logits, want.logits) < 2e-2, plan
            assert rel(r.feature_cache.gather(slots), want_f) < 2e-2, plan
        seqs.advance(plan)
    assert fast.num_graph_steps > 0
    used = {s for b in seqs.blocks for s in range(b[0] * bs, (b[-1] + 1) * bs)}
    spare = [s for s in range(fast.feature_cache.num_slots) if s not in used]
    assert not fast.feature_cache.rows[spare].any()  # padding rows wrote only the spare row


# the tiny target of the head-runner tests (eagle_heads.head_over_features)
TINY_TARGET = {"vocab_size": 256, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32}


def test_gpu_head_runner_drafts_like_the_torch_head_runner(tmp_path):
    from eagle_heads import head_over_features
    from tandem.worker.batch import SeqChunk
    from tandem.worker.gpu_head_runner import GpuHeadRunner
    from tandem.worker.head_runner import HeadRunner

    dev, bs = torch.device("cuda"), 16
    head, kv, features, _ = head_over_features(tmp_path, "speculators", dev, num_blocks=64, block_size=bs,
                                               draft_vocab=200, **TINY_TARGET)
    g = torch.Generator(device=dev).manual_seed(1)
    torch_r = HeadRunner(head, kv(), bs, dev, features)
    gpu_r = GpuHeadRunner(head, kv(), bs, dev, max_model_len=512, lookahead=4, features=features)
    gpu_r.warm_up([1, 3], [1, 2, 3, 4])
    blocks = [list(range(i * 20, i * 20 + 20)) for i in range(3)]
    toks = [[(7 * i + 3 * j) % 250 + 3 for j in range(60)] for i in range(3)]
    # catch-up over prompts (eager), then ragged catch-ups (graph, padded), then chain steps (graph);
    # "features": the step reads its hidden inputs from the feature cache (a proposal's first step)
    done = [0, 0, 0]
    for lens, source in (([30, 12, 5], "features"), ([2, 4, 1], "features"), ([1, 1, 1], "fed"),
                         ([3, 1, 2], "fed"), ([1, 1, 1], "features"), ([1, 1, 1], "fed")):
        chunks = [SeqChunk(toks[i][done[i] + 1:done[i] + 1 + n], done[i], blocks[i]) for i, n in enumerate(lens)]
        hidden = torch.randn(sum(lens), 128, generator=g, device=dev) if source == "fed" else None
        rows = list(torch.cumsum(torch.tensor(lens), 0) - 1)
        a = torch_r.forward(chunks, rows, hidden)
        b = gpu_r.forward(chunks, rows, hidden)
        assert torch.equal(a.token_ids, b.token_ids), lens
        assert rel(b.feedback, a.feedback) < 2e-3, lens  # float32 matmuls on CUDA may use TF32
        done = [d + n for d, n in zip(done, lens)]
    assert gpu_r.num_graph_steps >= 4 and gpu_r.num_eager_steps >= 1
    assert gpu_r.graphs_f.get((1, 4)) is not None and gpu_r.graphs.get((1, 1)) is not None
    assert gpu_r.graphs.get((1, 4)) is None  # chain steps are one row: fed graphs only for q = 1


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_engine_with_eagle_on_cuda(tmp_path, layout):
    from eagle_heads import write_eagle_head
    from engine_utils import greedy, tokens_of
    from tandem import LLM
    from tiny_models import write_tiny_hf_checkpoint

    target = write_tiny_hf_checkpoint(tmp_path, "llama", name="t", std=0.2, vocab_size=256, hidden_size=128,
                                      intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32)
    head, _ = write_eagle_head(tmp_path, layout, target, aux=(1, 2, 3), draft_vocab=128)
    prompts = [[5, 9, 17, 33, 40], [7, 7, 7], list(range(3, 60))]
    kw = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20)
    plain = LLM(str(target), **kw)
    spec = LLM(str(target), **kw, speculative_config={"model": str(head), "num_speculative_tokens": 3,
                                                      "disable_by_acceptance": False})  # draft every step
    a = tokens_of(plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(24)))
    b = tokens_of(spec.generate([{"prompt_token_ids": p} for p in prompts], greedy(24)))
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    assert same >= 0.9 * sum(len(p) for p in a)  # float32 on GPU: k+1-row vs 1-row kernels may round apart
    assert spec.engine.stats.spec.num_draft_tokens > 0
    hr = spec.engine.proposer.runner
    assert type(hr).__name__ == "GpuHeadRunner" and hr.num_graph_steps > 0
    assert hr.num_proposal_graphs > 0  # whole proposals in one graph (forward_proposal)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_gpu_chained_proposal_drafts_what_a_proposal_after_the_read_drafts(tmp_path, graphs):
    """The CUDA head runner's chained steps (Triton fix-ups, graphs or eager) against the torch
    runner's synchronous steps on the verify's outcome (eagle_heads.compare_chained_head_steps)."""
    from eagle_heads import compare_chained_head_steps, head_over_features
    from tandem.worker.gpu_head_runner import GpuHeadRunner
    from tandem.worker.head_runner import HeadRunner

    dev, bs = torch.device("cuda"), 16
    head, kv, features, _ = head_over_features(tmp_path, "eagle3", dev, num_blocks=64, block_size=bs,
                                               draft_vocab=200, **TINY_TARGET)
    gpu_r = GpuHeadRunner(head, kv(), bs, dev, max_model_len=512, lookahead=4, features=features, use_graphs=graphs)
    gpu_r.warm_up([1, 8], [1, 2, 3, 4, 5, 6, 7, 8])
    blocks = [list(range(i * 8 + 7, i * 8 - 1, -1)) for i in range(8)]  # (out of order)
    steps = compare_chained_head_steps(gpu_r, HeadRunner(head, kv(), bs, dev, features), blocks, 256, tol=2e-3)
    assert steps == 3
    assert gpu_r.num_eager_steps >= 1 and (gpu_r.graphs is not None) == graphs  # (the prior catch-up: eager)


@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_chain_graph_drafts_what_synchronous_steps_draft(tmp_path, batch):
    """``forward_chain``: a chained proposal's steps 2..k in one graph, each position, context and KV
    slot advanced on the device, draft what the torch runner's synchronous steps on the verify's
    outcome draft — positions moved back by each verify's rejections, across block boundaries, at a
    batch padded to its bucket (3 → 4). Its graphs are captured at warm-up (steps 2..k − 1)."""
    from eagle_heads import compare_chained_head_steps, head_over_features
    from tandem.worker.gpu_head_runner import GpuHeadRunner
    from tandem.worker.head_runner import HeadRunner

    dev, bs = torch.device("cuda"), 16
    head, kv, features, _ = head_over_features(tmp_path, "eagle3", dev, num_blocks=64, block_size=bs,
                                               draft_vocab=200, **TINY_TARGET)
    gpu_r = GpuHeadRunner(head, kv(), bs, dev, max_model_len=512, lookahead=5, features=features)
    gpu_r.warm_up([batch], [1, 2, 3, 4, 5, 6])
    b = 1 if batch == 1 else 4
    assert {k for k in gpu_r.graphs_c.graphs} == {(b, 2), (b, 3), (b, 4)}
    blocks = [list(range(i * 8 + 7, i * 8 - 1, -1)) for i in range(batch)]
    steps = compare_chained_head_steps(gpu_r, HeadRunner(head, kv(), bs, dev, features), blocks, 256, k=5, tol=2e-3,
                                       chain_graph=True)
    assert steps == 5


@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_proposal_graph_drafts_what_synchronous_steps_draft(tmp_path, batch):
    """``forward_proposal``: a chained proposal's first step and its chain steps in one graph — the
    chain's inputs derived on the device from the first step's selected rows, moved back by each
    verify's rejections — draft what the torch runner's synchronous steps on the verify's outcome
    draft, at a batch padded to its bucket (3 → 4). Captured at warm-up for every q and 1..k − 1 steps."""
    from eagle_heads import compare_chained_head_steps, head_over_features
    from tandem.worker.gpu_head_runner import GpuHeadRunner
    from tandem.worker.head_runner import HeadRunner

    dev, bs = torch.device("cuda"), 16
    head, kv, features, _ = head_over_features(tmp_path, "eagle3", dev, num_blocks=64, block_size=bs,
                                               draft_vocab=200, **TINY_TARGET)
    gpu_r = GpuHeadRunner(head, kv(), bs, dev, max_model_len=512, lookahead=5, features=features)
    gpu_r.warm_up([batch], range(1, 9))
    b = 1 if batch == 1 else 4
    assert set(gpu_r.graphs_p.graphs) == {(b, q, s) for q in range(1, 9) for s in range(1, 5)}
    blocks = [list(range(i * 8 + 7, i * 8 - 1, -1)) for i in range(batch)]
    for k in ((5, 2) if batch == 1 else (4, 2)):  # (a catch-up of up to k + 4 rows: at most 8)
        steps = compare_chained_head_steps(gpu_r, HeadRunner(head, kv(), bs, dev, features), blocks, 256, k=k,
                                           tol=2e-3, proposal_graph=True)
        assert steps == k
    assert gpu_r.num_proposal_graphs == 2


def test_gpu_proposal_graph_after_a_read_verify(tmp_path):
    """``forward_proposal`` without a chained verify (the synchronous proposal after a read): ragged
    first steps (1..4 rows per request, padded), then k − 1 chain steps, against the torch runner's
    steps; a batch or step count no graph holds returns None (the caller takes the steps apart)."""
    from eagle_heads import head_over_features
    from tandem.worker.batch import SeqChunk
    from tandem.worker.gpu_head_runner import GpuHeadRunner
    from tandem.worker.head_runner import HeadRunner

    dev, bs, k = torch.device("cuda"), 16, 4
    head, kv, features, _ = head_over_features(tmp_path, "eagle3", dev, num_blocks=64, block_size=bs,
                                               draft_vocab=200, **TINY_TARGET)
    torch_r = HeadRunner(head, kv(), bs, dev, features)
    gpu_r = GpuHeadRunner(head, kv(), bs, dev, max_model_len=512, lookahead=k, features=features)
    gpu_r.warm_up([3], [1, 2, 3, 4, 5])
    blocks = [list(range(i * 20, i * 20 + 20)) for i in range(3)]
    toks = [[(7 * i + 3 * j) % 250 + 3 for j in range(80)] for i in range(3)]
    done = [0, 0, 0]
    for lens in ([30, 12, 5], [2, 4, 1], [1, 1, 1], [4, 3, 2]):
        chunks = [SeqChunk(toks[i][done[i] + 1:done[i] + 1 + n], done[i], blocks[i]) for i, n in enumerate(lens)]
        rows = [sum(lens[:i + 1]) - 1 for i in range(3)]
        got = gpu_r.forward_proposal(chunks, rows, k - 1)
        if max(lens) > 5:  # no proposal graph of that many rows: the caller's step-by-step path
            assert got is None
            gpu_r.forward(chunks, rows, None)
            torch_r.forward(chunks, rows, None)
        else:
            want = torch_r.forward(chunks, rows, None)
            for j in range(k):
                assert torch.equal(got[j], want.token_ids), (lens, j)
                if j + 1 < k:
                    nxt = [SeqChunk([0], done[i] + lens[i] + j, blocks[i]) for i in range(3)]
                    want = torch_r.forward(nxt, range(3), want.feedback, token_ids=want.token_ids)
        done = [d + n for d, n in zip(done, lens)]
    assert gpu_r.forward_proposal(chunks, rows, k) is None  # k drafts + 1: no graph (past the lookahead)
    assert gpu_r.num_proposal_graphs == 3
