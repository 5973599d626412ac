"""The checks on a tokenizer transformers builds from a GGUF file (loader/gguf_tokenizer_check.py):
the header scan reads the BOS/EOS flags as ``gguf.GGUFReader`` does, the flags are applied to a
tokenizer that ignores them, and a tokenizer that cannot encode its own vocabulary is refused."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from tiny_models import tiny_tokenizer

from tandem.errors import ModelLoadError
from tandem.loader.gguf_tokenizer_check import (
    MIN_VOCAB_TO_CHECK,
    apply_special_token_flags,
    check_round_trip,
    gguf_special_token_flags,
    round_trip_share,
)


def _gguf(path: Path, bos: bool | None, eos: bool | None) -> Path:
    """A GGUF whose flags come after arrays of strings, floats and ints (as in a real vocabulary)."""
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(300)] + ["▁ünïcödé"])
    w.add_token_scores([float(-i) for i in range(301)])
    w.add_token_types([1] * 301)
    w.add_bos_token_id(1)
    if bos is not None:
        w.add_add_bos_token(bos)
    w.add_uint64("tiny.some_count", 7)
    w.add_float64("tiny.some_float", 0.5)
    if eos is not None:
        w.add_add_eos_token(eos)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("bos,eos", [(True, False), (False, True), (True, None), (None, None)])
def test_header_scan_reads_the_flags_gguf_reader_reads(tmp_path, bos, eos):
    path = _gguf(tmp_path / "t.gguf", bos, eos)
    fields = GGUFReader(str(path)).fields
    expected = {name: bool(fields[f"tokenizer.ggml.{name}"].contents())
                for name in ("add_bos_token", "add_eos_token") if f"tokenizer.ggml.{name}" in fields}
    assert gguf_special_token_flags(path) == expected
    assert expected == {k: v for k, v in (("add_bos_token", bos), ("add_eos_token", eos)) if v is not None}


def test_not_a_gguf_gives_no_flags(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all")
    assert gguf_special_token_flags(path) == {}
    # a damaged header: a key length past the end of the file is refused, not allocated
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 60))
    assert gguf_special_token_flags(path) == {}


def test_flags_the_tokenizer_ignores_are_applied():
    tok = tiny_tokenizer()
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert tok("ab").input_ids[0] != bos  # as transformers 5.17-5.22 built Gemma's: no <bos>
    apply_special_token_flags(tok, {"add_bos_token": True, "add_eos_token": False}, Path("m.gguf"))
    ids = tok("ab").input_ids
    assert ids[0] == bos and ids[-1] != eos and tok("ab", add_special_tokens=False).input_ids == ids[1:]
    apply_special_token_flags(tok, {"add_bos_token": False, "add_eos_token": True}, Path("m.gguf"))
    assert tok("ab").input_ids == ids[1:] + [eos]


def _word_tokenizer(merged: bool):  # type: ignore[no-untyped-def]
    """Words of 2-4 letters over 'abcdefgh': a word-level tokenizer (every word one token), or a
    BPE with the same vocabulary and no merges (each word falls apart into letters, as transformers
    5.17's Gemma tokenizer split " capital" into four pieces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = "abcdefgh"
    words = ["".join(p) for n in (2, 3, 4) for p in itertools.product(letters, repeat=n)][: MIN_VOCAB_TO_CHECK + 200]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(letters)}}
    vocab.update({w: len(vocab) + i for i, w in enumerate(w for w in words if w not in vocab)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>") if merged
                     else models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def test_a_tokenizer_that_splits_its_own_tokens_is_refused():
    good, bad = _word_tokenizer(merged=True), _word_tokenizer(merged=False)
    assert len(good) >= MIN_VOCAB_TO_CHECK
    assert round_trip_share(good)[0] == 1.0
    check_round_trip(good, Path("good.gguf"))
    share, misses = round_trip_share(bad)
    assert share < 0.1 and len(misses[0][2]) > 1
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: the tokenizer transformers .* encodes only"):
        check_round_trip(bad, Path("bad.gguf"))
    check_round_trip(tiny_tokenizer(), Path("tiny.gguf"))  # too small a vocabulary to judge: passes
