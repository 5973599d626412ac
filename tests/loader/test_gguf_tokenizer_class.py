"""A GGUF file's tokenizer is the one ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` builds —
same class, same ids — without the model config transformers 5 builds first to pick the class
(importing it costs ~180 MB of peak RSS on a first run; loader/tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import transformers
from gguf import GGUFReader, GGUFWriter
from transformers import AutoTokenizer

from tandem.loader.gguf_tokenizer_check import checked_gguf_tokenizer, gguf_architecture
from tandem.loader.tokenizer import load_tokenizer

TEXTS = ["the cat in a hat", "  the\n\tcat  ", "ünï 你好", "<|im_start|>the<|im_end|>", ""]


def _bpe_vocab(w: GGUFWriter) -> None:
    """A GPT-2 style byte-level BPE vocabulary (SmolLM2, Qwen)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe", "in", "Ġa"]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n", "Ġ a"])
    w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)


def _spm_vocab(w: GGUFWriter) -> None:
    """A SentencePiece vocabulary with byte fallback and ``add_bos_token`` (Gemma)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += ["▁", "t", "h", "e", "▁the", "he", "▁t", "a", "▁a", "c", "▁c", "at", "▁cat"]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)])
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * (len(tokens) - 260))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)


def _write(path: Path, arch: str, vocab: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    (_bpe_vocab if vocab == "bpe" else _spm_vocab)(w)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,vocab", [("llama", "bpe"), ("qwen2", "bpe"), ("qwen3", "bpe"),
                                        ("llama", "spm"), ("gemma3", "spm")])
def test_the_tokenizer_is_autotokenizers_without_a_model_config(tmp_path, monkeypatch, arch, vocab):
    path = _write(tmp_path / arch / "m.gguf", arch, vocab)
    assert gguf_architecture(path) == arch == GGUFReader(str(path)).fields["general.architecture"].contents()
    reference = checked_gguf_tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), path)

    if hasattr(transformers, "TokenizersBackend"):  # transformers 5: the config is skipped
        def no_config(*args, **kwargs):
            raise AssertionError("the tokenizer built the model's config")

        monkeypatch.setattr(transformers.AutoConfig, "for_model", no_config)
    tok = load_tokenizer(path, use_cache=False)
    assert type(tok) is type(reference)
    assert tok.special_tokens_map == reference.special_tokens_map and len(tok) == len(reference)
    for text in TEXTS:
        assert tok(text).input_ids == reference(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == reference.decode(reference(text).input_ids)


def test_an_unlisted_architecture_takes_autotokenizers_own_way(tmp_path, monkeypatch):
    path = _write(tmp_path / "m.gguf", "mistral3", "bpe")
    calls = []
    real = AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    try:
        load_tokenizer(path, use_cache=False)
    except Exception:  # noqa: BLE001 - whether transformers knows the architecture is not the point
        pass
    assert calls and "tokenizer_type" not in calls[0] and calls[0].get("gguf_file") == "m.gguf"
