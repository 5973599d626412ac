"""Engine integration on CPU with tiny random checkpoints: HF equality, batch invariance, chunked
prefill, preemption, per-request failures, aborts."""

from __future__ import annotations

import pytest

from engine_utils import greedy, hf_greedy, make_llm, random_prompts, tokens_of
from tandem import SamplingParams
from tiny_models import write_tiny_hf_checkpoint

CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {}),
    ("qwen2", {}),  # qkv bias
    ("qwen3", {"tie_word_embeddings": True}),  # qk-norm
    ("gemma3", {}),  # sandwich norms, sliding window 8 < prompt + output
    ("llama", {"num_key_value_heads": 4}),  # MHA (no GQA)
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llama_llm(llama_dir):
    return make_llm(llama_dir)


@pytest.mark.parametrize("family,overrides", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_greedy_matches_hf_token_for_token(tmp_path, family, overrides):
    path = write_tiny_hf_checkpoint(tmp_path, family, **overrides)
    llm = make_llm(path)
    prompts = random_prompts(3, 100, lo=5, hi=30, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24), use_tqdm=False)
    for p, got in zip(prompts, tokens_of(outs)):
        assert got == hf_greedy(path, p, 24)


def test_batch_invariance_and_small_chunks(llama_dir, llama_llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(16, 100, lo=2, hi=60, seed=2)]
    params = greedy(20)
    alone = [tokens_of(llama_llm.generate(p, params, use_tqdm=False))[0] for p in prompts]
    together = tokens_of(llama_llm.generate(prompts, params, use_tqdm=False))
    assert together == alone
    chunked = make_llm(llama_dir, max_num_batched_tokens=32)
    assert tokens_of(chunked.generate(prompts, params, use_tqdm=False)) == alone
    assert chunked.engine.pool.all_free()


def test_preemption_completes_every_request_with_same_output(llama_dir, llama_llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(12, 100, lo=30, hi=50, seed=3)]
    params = greedy(24)
    ref = tokens_of(llama_llm.generate(prompts, params, use_tqdm=False))
    # 80 blocks of 4 tokens: far less than 12 × ~70 tokens, but enough for max_model_len (64 blocks)
    small = make_llm(llama_dir, kv_cache_memory_bytes=80 * 2048)  # 2 KiB per block
    assert small.engine.num_blocks == 80
    outs = small.generate(prompts, params, use_tqdm=False)
    assert tokens_of(outs) == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.pool.all_free()


def test_prompt_too_long_fails_alone(llama_llm):
    ok = {"prompt_token_ids": [5, 6, 7]}
    too_long = {"prompt_token_ids": [5] * 300}  # max_model_len is 256
    outs = llama_llm.generate([ok, too_long, ok], greedy(5), use_tqdm=False)
    assert outs[1].error and "max_model_len=256" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    assert len(outs[0].outputs[0].token_ids) == 5 and outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_max_model_len_ends_generation_with_length(llama_llm):
    out = llama_llm.generate({"prompt_token_ids": [5] * 250}, greedy(100), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 256


def test_abort_frees_blocks(llama_llm):
    eng = llama_llm.engine
    eng.add_request("a", None, greedy(50), prompt_token_ids=[5, 6, 7, 8])
    eng.add_request("b", None, greedy(50), prompt_token_ids=[9, 10])
    eng.step()
    eng.step()
    eng.abort_request("a")
    outs = eng.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.pool.all_free()


def test_text_prompts_and_chat_template(llama_llm):
    out = llama_llm.generate("Hello world", greedy(8), use_tqdm=False)[0]
    tok = llama_llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("Hello world")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    chat = llama_llm.chat([{"role": "user", "content": "Hi"}], greedy(4), use_tqdm=False)[0]
    assert chat.prompt_token_ids[0] == 4  # <|im_start|> from the ChatML template


def test_n_and_seed_reproducible_regardless_of_batch(llama_llm):
    sp = SamplingParams(temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    p = {"prompt_token_ids": [5, 6, 7]}
    alone = tokens_of(llama_llm.generate(p, sp, use_tqdm=False))[0]
    others = [{"prompt_token_ids": q} for q in random_prompts(6, 100, seed=4)]
    mixed = llama_llm.generate(others[:3] + [p] + others[3:],
                               [SamplingParams(temperature=1.0, max_tokens=16)] * 3 + [sp]
                               + [SamplingParams(temperature=1.0, max_tokens=16)] * 3, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    n2 = llama_llm.generate(p, sp.clone(n=3), use_tqdm=False)[0]
    assert len(n2.outputs) == 3 and n2.outputs[0].token_ids == alone
    assert n2.outputs[1].token_ids != n2.outputs[0].token_ids


def test_stop_conditions(llama_llm):
    p = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    full = llama_llm.generate(p, greedy(24), use_tqdm=False)[0].outputs[0]
    # stop token id: generation ends at its first occurrence, stop_reason = the id
    tid = full.token_ids[5]
    first = full.token_ids.index(tid)
    o = llama_llm.generate(p, greedy(24, stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    assert o.token_ids == full.token_ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == tid
    # stop string: text cut before it
    stop = full.text[6:9]
    o = llama_llm.generate(p, greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == full.text[: full.text.index(stop)]
    o = llama_llm.generate(p, greedy(24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert o.text == full.text[: full.text.index(stop) + len(stop)]
    # max_tokens
    o = llama_llm.generate(p, greedy(7), use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == 7 and o.finish_reason == "length"


def test_eos_and_min_tokens(llama_llm):
    eng = llama_llm.engine
    p = {"prompt_token_ids": [5, 6, 7]}
    # bias EOS (id 2) up: without min_tokens the first token is EOS
    bias = {2: 100.0}
    o = llama_llm.generate(p, SamplingParams(temperature=0, max_tokens=10, logit_bias=bias), use_tqdm=False)[0]
    assert o.outputs[0].token_ids == [2] and o.outputs[0].finish_reason == "stop"
    assert 2 in eng.eos_token_ids
    o = llama_llm.generate(p, SamplingParams(temperature=0, max_tokens=10, logit_bias=bias, min_tokens=4),
                           use_tqdm=False)[0]
    assert o.outputs[0].token_ids[:4].count(2) == 0 and o.outputs[0].token_ids[4] == 2
    o = llama_llm.generate(p, SamplingParams(temperature=0, max_tokens=6, logit_bias=bias, ignore_eos=True),
                           use_tqdm=False)[0]
    assert o.outputs[0].token_ids == [2] * 6


def test_logprobs_and_prompt_logprobs(llama_llm):
    import torch

    p = [5, 6, 7, 8]
    o = llama_llm.generate({"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1),
                           use_tqdm=False)[0]
    c = o.outputs[0]
    assert len(c.logprobs) == 3
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1 and len(entry) >= 2
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
    for tok, entry in zip(p[1:], o.prompt_logprobs[1:]):
        assert tok in entry
        assert entry[tok].logprob <= 0
    assert all(isinstance(v.logprob, float) for e in o.prompt_logprobs[1:] for v in e.values())
    del torch


def test_bad_sampling_param_values_name_the_field():
    from tandem.errors import SamplingParamsError

    for kw, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
                      ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"),
                      ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"logprobs": 50}, "logprobs"),
                      ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                      ({"stop": [1]}, "stop"), ({"seed": -1}, "seed"), ({"logit_bias": {"x": 1}}, "logit_bias")]:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**kw)
        assert e.value.field == field and field in str(e.value)


def test_logit_bias_outside_vocab_rejected_per_request(llama_llm):
    from tandem.errors import SamplingParamsError

    with pytest.raises(SamplingParamsError):
        llama_llm.engine.add_request("x", None, SamplingParams(logit_bias={10_000: 1.0}), prompt_token_ids=[5])
    assert not llama_llm.engine.has_unfinished_requests()


def test_kv_cache_too_small_for_max_model_len_says_how_much(llama_dir):
    from tandem.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        make_llm(llama_dir, kv_cache_memory_bytes=10 * 1024)
    assert "KiB missing" in str(e.value) and e.value.key == "kv_cache_memory_bytes"
