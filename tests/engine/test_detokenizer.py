"""Incremental detokenization: multi-byte characters split across byte-level BPE tokens, leading
spaces, and stop strings that span token boundaries."""

from __future__ import annotations

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    from tandem.loader.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


TEXTS = [
    "Hello wörld, ça va? 你好世界 🤖🚀 emoji! naïve café — “quotes”",
    "  leading spaces\n\ttabs and\nnewlines  ",
    "日本語のテキストと한국어 텍스트",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode_at_every_step(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("Say:"))
    for i, t in enumerate(ids):
        d.add_token(t)
        full = tok.decode(ids[: i + 1], skip_special_tokens=True)
        # released text never contains a broken character and is a prefix of the full decode
        assert "\ufffd" not in d.text
        assert full.startswith(d.text)
    assert d.text == tok.decode(ids, skip_special_tokens=True)


def test_multibyte_character_is_split_across_tokens(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # byte-level pieces: the test above is meaningful
    d = IncrementalDetokenizer(tok, [])
    d.add_token(ids[0])
    assert d.text == ""  # held back until complete


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("one two three four five")
    d = IncrementalDetokenizer(tok, [], stop=("hree fo",))
    hit = None
    for t in ids:
        hit = d.add_token(t)
        if hit:
            break
    assert hit == "hree fo" and d.text == "one two t"
    d = IncrementalDetokenizer(tok, [], stop=("hree fo",), include_stop_str_in_output=True)
    for t in ids:
        if d.add_token(t):
            break
    assert d.text == "one two three fo"


def test_fast_decoder_matches_transformers_decode(tok):
    """The engine decodes through the Rust backend when that gives transformers' exact text."""
    import random

    from tandem.engine.detokenizer import _BackendDecoder, fast_decoder

    d = fast_decoder(tok)
    assert isinstance(d, _BackendDecoder)
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))] + rng.sample(special, 1)
        for skip in (True, False):
            assert d.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    for text in TEXTS:
        d2 = IncrementalDetokenizer(d, tok.encode("Say:"))
        for t in tok.encode(text):
            d2.add_token(t)
        assert d2.text == tok.decode(tok.encode(text), skip_special_tokens=True)


def test_fast_decoder_keeps_transformers_when_it_rewrites_text():
    """A WordPiece tokenizer with clean_up_tokenization_spaces rewrites " ." → "."; the backend alone
    would not, so the probe must keep transformers' decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tandem.engine.detokenizer import fast_decoder

    vocab = {w: i for i, w in enumerate(["[UNK]", "[CLS]", "hi", ".", "yes", "?", "a", ",", "b"])}
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(cleanup=False)  # only transformers cleans up
    wp = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", cls_token="[CLS]",
                                 clean_up_tokenization_spaces=True)
    ids = wp.encode("hi . yes ?", add_special_tokens=False)
    assert wp.decode(ids) != wp.backend_tokenizer.decode(ids)  # the premise: transformers rewrites
    assert fast_decoder(wp) is wp
