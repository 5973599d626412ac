"""The scripted CPU lone decode / verify (``worker/lone_decode.py``) computes the eager forward's bits:
the same logits and the same KV written, for 1- to 8-row steps, over consecutive and scattered blocks,
with 1 and 2 threads; greedy speculation still equals plain decoding; it is used only where it fits."""

from __future__ import annotations

import pytest
import torch

from tiny_models import write_tiny_hf_checkpoint


def _llm(tmp_path, family="llama", quantization="int4", **over):
    from tandem import LLM

    # SmolLM2's attention shape (9 heads over 3 KV heads of 64)
    path = write_tiny_hf_checkpoint(tmp_path, family, std=0.2, num_hidden_layers=2, hidden_size=576,
                                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                    intermediate_size=256, max_position_embeddings=512, **over)
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, block_size=4,
               quantization=quantization)


@pytest.mark.parametrize("threads,one_thread_attention", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("kernel", ["cpu_q4", "int4pack"])
def test_scripted_decode_equals_eager_bitwise(tmp_path, monkeypatch, threads, one_thread_attention, scattered, kernel):
    from tandem.models.quant import cpu_q4
    from tandem.worker.batch import SeqChunk
    from tandem.worker.lone_decode import LoneDecoder

    monkeypatch.setattr(LoneDecoder, "ONE_THREAD_ATTENTION", one_thread_attention)
    if kernel == "int4pack":  # the kernel of machines without AVX-512 BF16
        monkeypatch.setattr(cpu_q4, "available", lambda: False)
    elif not cpu_q4.available():
        pytest.skip("cpu_q4 needs AVX-512 BF16 and a C compiler")

    llm = _llm(tmp_path)
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.mlp.down_proj.kernel == kernel
    runner = llm.engine.runner
    blocks = [90 - b for b in range(90)] if scattered else list(range(3, 93))  # 90, 89, ... : a gather
    prompt = [(7 * j) % 90 + 6 for j in range(300)]  # long enough for 2-thread softmax / bmm splits
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner.forward_logits([SeqChunk(prompt, 0, blocks)], [len(prompt) - 1])
        k_caches = [kv[0] for kv in runner.kv_caches]
        pos = len(prompt)
        for r, t in enumerate([1, 1, 5, 1, 3, 8, 1, 2]):  # decodes, and verifies of t rows
            tokens = [(11 * r + 5 * j) % 90 + 3 for j in range(t)]
            step, rows = [SeqChunk(tokens, pos, blocks)], list(range(t))
            runner._lone = False  # eager
            ref = runner.forward_logits(step, rows).clone()
            ref_k = [k.clone() for k in k_caches]
            for k in k_caches:  # the scripted step must write the new tokens' KV itself
                for p in range(pos, pos + t):
                    k[blocks[p // 4] * 4 + p % 4] = float("nan")
            runner._lone = None
            got = runner.forward_logits(step, rows)
            pos += t
            assert isinstance(runner._lone, LoneDecoder)
            # with cpu_q4, both paths also take cpu_attention.py (where it builds: the same AVX-512 machines)
            own = kernel == "cpu_q4"
            assert runner.attention.cpu_kernel == runner._lone.c_attn == own
            assert torch.equal(got, ref), r
            assert all(torch.equal(a, b) for a, b in zip(k_caches, ref_k)), r
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(old)


def test_greedy_generate_is_unchanged(tmp_path):
    from tandem import SamplingParams

    llm = _llm(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + j, 9, 17, 3 * j + 1]} for j in range(3)]
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert llm.engine.runner._lone  # batch-1 decodes went through the script
    llm.engine.runner._lone = False
    ref = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == ref


@pytest.mark.parametrize("family,quantization", [("llama", "none"), ("llama", "int8"), ("gemma3", "int4"),
                                                 ("qwen3", "int4")])
def test_only_plain_int4_llama_layers_are_scripted(tmp_path, family, quantization):
    from tandem.worker.batch import SeqChunk

    llm = _llm(tmp_path, family, quantization)
    runner = llm.engine.runner
    runner.forward_logits([SeqChunk([5, 6, 7], 0, [0, 1])], [2])
    runner.forward_logits([SeqChunk([8], 3, [0, 1])], [0])
    assert runner._lone is False


def test_refuses_a_cpu_fuser(tmp_path, monkeypatch):
    from tandem.worker.batch import SeqChunk

    llm = _llm(tmp_path)
    runner = llm.engine.runner
    runner.forward_logits([SeqChunk([5, 6, 7], 0, [0, 1])], [2])
    monkeypatch.setattr(torch._C, "_jit_can_fuse_on_cpu", lambda: True)
    with pytest.raises(RuntimeError, match="fuser"):
        runner.forward_logits([SeqChunk([8], 3, [0, 1])], [0])


def test_ngram_speculation_still_equals_plain_decoding(tmp_path, monkeypatch):
    from tandem import LLM, SamplingParams
    from tandem.worker.lone_decode import LoneDecoder

    sizes: list[int] = []
    orig = LoneDecoder.logits
    monkeypatch.setattr(LoneDecoder, "logits", lambda self, tokens, *a: sizes.append(len(tokens)) or orig(self, tokens, *a))

    path = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2, num_hidden_layers=2, hidden_size=576,
                                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                    intermediate_size=256, max_position_embeddings=512)
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, block_size=4, quantization="int4")
    plain = LLM(str(path), **kw)
    # (the policy off: drafts every step, whatever this random model's acceptance)
    spec = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                              "prompt_lookup_max": 3, "disable_by_acceptance": False}, **kw)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 17, 5, 9, 17, 5, 9, 17, 5, 9]}  # repetitive: drafts get proposed
    a = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    b = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.engine.runner._lone and plain.engine.runner._lone
    assert max(sizes) > 1  # verifies went through the script
    assert a == b


def test_runner_config_turns_it_off(tmp_path):
    from tandem import SamplingParams

    path = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2, num_hidden_layers=2)
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, quantization="int4")
    from tandem import LLM

    off = LLM(str(path), runner_config={"cpu_script": False}, **kw)
    on = LLM(str(path), **kw)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 9, 17]}]
    assert (off.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == on.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert off.engine.runner._lone is False and on.engine.runner._lone


def test_scripted_step_returns_the_eager_aux_hidden_states(tmp_path):
    """EAGLE's features (the stream entering chosen layers, and the final post-norm state) come from
    the scripted step too, bitwise the eager ones, in the eager order — so an EAGLE engine's plain
    decode steps are not pushed off the scripted path."""
    from tandem.worker.batch import SeqChunk
    from tandem.worker.lone_decode import LoneDecoder

    runner = _llm(tmp_path).engine.runner
    blocks = list(range(3, 93))
    prompt = [(5 * j) % 90 + 6 for j in range(40)]
    runner.forward_logits([SeqChunk(prompt, 0, blocks)], [len(prompt) - 1])
    pos = len(prompt)
    for t, layers in ((1, (0, 1, 2)), (4, (1, 2)), (1, (2,)), (3, (0,))):
        step, rows = [SeqChunk([(7 * j + t) % 90 + 3 for j in range(t)], pos, blocks)], list(range(t))
        runner._lone = False
        ref = runner.forward(step, rows, aux_layers=layers)
        runner._lone = None
        got = runner.forward(step, rows, aux_layers=layers)
        pos += t
        assert isinstance(runner._lone, LoneDecoder)
        assert torch.equal(got.logits, ref.logits)
        assert len(got.aux_hidden) == len(ref.aux_hidden) == len(layers)
        assert all(torch.equal(a, b) for a, b in zip(got.aux_hidden, ref.aux_hidden)), (t, layers)
