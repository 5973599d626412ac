"""Shared helpers for engine-level tests: tiny checkpoints, engines, HF reference generation."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import torch

from tandem import LLM, SamplingParams


def make_llm(path: Path | str, **kw) -> LLM:
    """A small CPU fp32 engine. Speculation drafts every step unless the test says otherwise
    (``disable_by_acceptance``): these tests exercise the drafting path, which the goodput policy
    (on by default) would often skip on a tiny model; the policy has its own tests."""
    spec = kw.get("speculative_config")
    if isinstance(spec, dict) and "disable_by_acceptance" not in spec:
        kw["speculative_config"] = {**spec, "disable_by_acceptance": False}
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    kw.setdefault("block_size", 4)
    return LLM(str(path), **kw)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens_of(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_greedy(path: Path | str, prompt_ids: list[int], max_new: int) -> list[int]:
    model = _hf_model(str(path))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(n: int, vocab: int, lo: int = 3, hi: int = 40, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


def token_counts(llm, n: int, params: SamplingParams, position: int) -> Counter:
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * n,
                        [params.clone(seed=i) for i in range(n)], use_tqdm=False)
    return Counter(o.outputs[0].token_ids[position] for o in outs)


def chi2_same(a: Counter, b: Counter) -> float:
    """Two-sample chi-square p-value (rare categories pooled so expected counts stay >= 5)."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b))
    common = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    rare = [k for k in keys if k not in common]
    table = [[c.get(k, 0) for k in common] + [sum(c.get(k, 0) for k in rare)] for c in (a, b)]
    if not rare:
        table = [row[:-1] for row in table]
    return chi2_contingency(table)[1]
