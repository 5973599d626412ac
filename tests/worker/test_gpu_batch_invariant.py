"""Batch-invariant mode on CUDA (issue #19): kernel rows equal their 1-row results in bf16, and greedy
engine output is identical with and without speculation (n-gram, draft model, EAGLE) at batch 1, 8
and 32 on dummy SmolLM2 / Llama-3.2-1B shapes. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "smol": (576, 1536, 30, 9, 3, 49152),
    "1b": (2048, 8192, 16, 32, 8, 128256),
}


def dummy_dir(root: Path, shape: str, layers: int | None = None) -> Path:
    hid, inter, n_layers, heads, kvh, vocab = SHAPES[shape]
    d = root / f"{shape}-{layers or n_layers}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hid,
        "intermediate_size": inter, "num_hidden_layers": layers or n_layers, "num_attention_heads": heads,
        "num_key_value_heads": kvh, "head_dim": hid // heads, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}))
    return d


@pytest.mark.parametrize("rows", [2, 7, 16, 40, 70])  # 70: split-K products run in launches of 64 rows
@pytest.mark.parametrize("n,k,n_gated", [(1536, 576, 3072), (6144, 4096, 16384)])  # small / 8B-sized tiles
def test_kernel_rows_equal_one_row_results(rows, n, k, n_gated):
    from tandem.worker.cuda_kernels import invariant_logits
    from tandem.worker.triton_attention import paged_attention_triton
    from tandem.worker.triton_gemv import gemv

    g = torch.Generator(device=CUDA).manual_seed(rows)
    w = (torch.randn(n, k, device=CUDA, generator=g) / k ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(n_gated, k, device=CUDA, generator=g) / k ** 0.5).to(torch.bfloat16)
    nw = (torch.rand(k, device=CUDA, generator=g) + 0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, device=CUDA, generator=g).to(torch.bfloat16)
    r = torch.randn(rows, n, device=CUDA, generator=g).to(torch.bfloat16)
    for f in (lambda i, j: gemv(x[i:j], w, dot=True, invariant=True),
              lambda i, j: gemv(x[i:j], w2, norm_weight=nw, eps=1e-5, gated=True, dot=True, invariant=True),
              lambda i, j: gemv(x[i:j], w, residual=r[i:j].clone(), dot=True, invariant=True),
              lambda i, j: invariant_logits(x[i:j], w)):
        whole = f(0, rows)
        for i in range(rows):
            assert torch.equal(whole[i], f(i, i + 1)[0]), i
    # attention: prefill rows equal decodes of the same positions
    heads, kvh, d, page, L = 9, 3, 64, 16, rows + 20
    kc = torch.randn(64 * page, kvh, d, device=CUDA, generator=g).to(torch.bfloat16)
    vc = torch.randn(64 * page, kvh, d, device=CUDA, generator=g).to(torch.bfloat16)
    bt = torch.randperm(64, device=CUDA, generator=g)[:8].to(torch.int32)[None]
    q = torch.randn(L, heads, d, device=CUDA, generator=g).to(torch.bfloat16)

    def attend(first, n_q):
        t = lambda v: torch.tensor(v, device=CUDA)  # noqa: E731
        return paged_attention_triton(q[first:first + n_q].contiguous(), kc, vc, bt, t([first + n_q]), t([0, n_q]),
                                      t([n_q]), page, d ** -0.5, n_q, 1, fixed_tiles=True)

    prefill = attend(0, L)
    for p in range(L):
        assert torch.equal(attend(p, 1)[0], prefill[p]), p


def _llm(path: Path, spec: dict | None = None, **kw):
    from tandem import LLM

    return LLM(str(path), load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
               max_model_len=1024, kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False, batch_invariant=True,
               speculative_config=spec, **kw)


def _generate(llm, prompts, batch: int) -> list[list[int]]:
    from tandem import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        out += [list(r.outputs[0].token_ids) for r in llm.generate(prompts[i:i + batch], sp, use_tqdm=False)]
    return out


@pytest.mark.parametrize("shape", ["smol", "1b"])
def test_greedy_output_identical_with_and_without_speculation(tmp_path, shape):
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[shape][-1]
    # repetitive prompts, so n-gram drafts are accepted as well as rejected
    prompts = []
    for n in torch.randint(8, 60, (32,), generator=g).tolist():
        motif = torch.randint(3, vocab, (5,), generator=g).tolist()
        prompts.append({"prompt_token_ids": (motif * (n // 5 + 1))[:n]})
    target = dummy_dir(tmp_path, shape)
    plain = _llm(target)
    ref = _generate(plain, prompts, 1)
    for b in (8, 32):
        assert _generate(plain, prompts, b) == ref, f"no speculation, batch {b}"
    del plain
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
             "draft_model": {"method": "draft_model", "model": str(dummy_dir(tmp_path, shape, layers=2)),
                             "num_speculative_tokens": 3}}
    for name, spec in specs.items():
        llm = _llm(target, {**spec, "disable_by_acceptance": False})
        for b in (1, 8, 32):
            assert _generate(llm, prompts, b) == ref, f"{name}, batch {b}"
        assert llm.engine.stats.spec.num_draft_tokens > 0
        if name == "ngram":  # its verifies chain (engine/async_decode.py): drafts proposed before the read
            assert llm.engine.num_chained_verifies > 0 and llm.engine.stats.spec.num_assumed_failed > 0
        del llm
        torch.cuda.empty_cache()


def test_eagle_head_output_identical(tmp_path):
    """EAGLE-3 (a random head in the speculators layout, tests/eagle_heads.py) on the dummy SmolLM2 shape."""
    from eagle_heads import write_eagle_head

    target = dummy_dir(tmp_path, "smol")
    head, _ = write_eagle_head(tmp_path, "speculators", target, draft_vocab=4096, std=0.05)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 49152, (int(n),), generator=g).tolist()}
               for n in torch.randint(8, 60, (16,), generator=g)]
    ref = _generate(_llm(target), prompts, 1)
    llm = _llm(target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                        "disable_by_acceptance": False})
    for b in (1, 8):
        assert _generate(llm, prompts, b) == ref, b
