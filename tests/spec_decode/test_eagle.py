"""EAGLE / EAGLE-3 speculation in the engine: heads in every public layout load, drafts are
accepted, and output equals the target's without speculation (greedy fp32, batch 1 and 16,
chunked prefill and preemption), sampled distribution included."""

from __future__ import annotations

import pytest

from eagle_heads import write_eagle_head
from engine_utils import greedy, make_llm, random_prompts, tokens_of
from tandem.errors import ConfigError, ModelLoadError
from tiny_models import write_tiny_hf_checkpoint

LAYOUTS = ("eagle", "eagle3", "speculators")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle")
    return write_tiny_hf_checkpoint(base, "llama", std=0.2, name="target", num_hidden_layers=4)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    base = tmp_path_factory.mktemp("heads")
    return {
        "eagle": write_eagle_head(base, "eagle", target)[0],
        "eagle3": write_eagle_head(base, "eagle3", target, aux=(1, 2, 3), draft_vocab=96)[0],
        "speculators": write_eagle_head(base, "speculators", target, aux=(0, 2, 3), draft_vocab=64)[0],
    }


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(16, 100, lo=2, hi=50, seed=5)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return tokens_of(make_llm(target).generate(prompts, greedy(32), use_tqdm=False))


def _method(layout: str) -> str:
    return "eagle" if layout == "eagle" else "eagle3"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_equals_no_speculation(target, heads, prompts, reference, layout):
    llm = make_llm(target, speculative_config={"method": _method(layout), "model": str(heads[layout]),
                                               "num_speculative_tokens": 3})
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference  # batch 16
    for p, want in zip(prompts[:3], reference[:3]):  # batch 1
        assert tokens_of(llm.generate([p], greedy(32), use_tqdm=False)) == [want]
    st = llm.engine.stats.spec
    assert st.num_draft_tokens > 0
    assert llm.engine.pool.all_free()


def test_method_is_inferred_from_the_checkpoint(target, heads, prompts, reference):
    llm = make_llm(target, speculative_config={"model": str(heads["speculators"]), "num_speculative_tokens": 2})
    assert llm.engine.spec.method == "eagle3"
    assert tokens_of(llm.generate(prompts[:4], greedy(32), use_tqdm=False)) == reference[:4]


def test_with_preemption_and_chunking(target, heads, prompts, reference):
    # 4-token blocks: (target 4 layers + head 1) x K,V x (2 kv heads x 16) x 4 B x 4 = 5 KiB per block
    llm = make_llm(target, kv_cache_memory_bytes=36 * 5120, max_num_batched_tokens=40, max_model_len=128,
                   speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                       "num_speculative_tokens": 4})
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.all_free()


def test_with_prefix_caching(target, heads, prompts, reference):
    llm = make_llm(target, enable_prefix_caching=True,
                   speculative_config={"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3})
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference  # cache hits
    assert llm.engine.stats.prefix_cache_hits > 0


def test_head_that_does_not_fit_is_a_clear_error(tmp_path, heads):
    other = write_tiny_hf_checkpoint(tmp_path, "llama", name="wide", hidden_size=96, num_hidden_layers=4)
    with pytest.raises(ModelLoadError, match="hidden"):
        make_llm(other, speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                            "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="eagle3"):
        make_llm(other, speculative_config={"method": "eagle", "model": str(heads["eagle3"]),
                                            "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="draft_sample_method"):
        make_llm(other, speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                            "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"})
