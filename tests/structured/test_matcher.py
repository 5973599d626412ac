"""RequestGrammar and the verify masks, on a tiny fake vocabulary (no weights, no tokenizer files).

Vocabulary: 0 <unk>, 1 <s>, 2 </s> (EOS, the stop token), 3 <pad>, then single characters; the logits
are 40 wide, wider than the 4 + len(CHARS) tokens, so the top ids never appear in any mask.
"""

from __future__ import annotations

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from tandem.sample.grammar_mask import apply_grammar_bitmask, unpack_bitmask  # noqa: E402
from tandem.sample.rejection import greedy_verify, rejection_sample  # noqa: E402
from tandem.structured.compiler import GrammarCompilerCache  # noqa: E402
from tandem.structured.params import StructuredOutputsParams  # noqa: E402
from tandem.structured.step_masks import step_bitmask  # noqa: E402

CHARS = list('abc-{}":, 0123456789')
VOCAB = ["<unk>", "<s>", "</s>", "<pad>"] + CHARS
V = 40
EOS = 2


def tok(s: str) -> list[int]:
    return [VOCAB.index(c) for c in s]


@pytest.fixture(scope="module")
def cache() -> GrammarCompilerCache:
    info = xgrammar.TokenizerInfo(VOCAB, vocab_size=V, stop_token_ids=[EOS])
    return GrammarCompilerCache(info)


def allowed(g, drafts=()) -> list[set[int]]:
    bm, rows = step_bitmask([(g, list(drafts))])
    assert rows == list(range(len(drafts) + 1))
    return [set(torch.nonzero(r).flatten().tolist()) for r in unpack_bitmask(bm, V)]


def test_masks_follow_the_grammar_and_eos_only_at_termination(cache: GrammarCompilerCache) -> None:
    g = cache.matcher(StructuredOutputsParams(regex=r"ab?c"))
    (first,) = allowed(g)
    assert first == set(tok("a"))
    assert g.accept(tok("a")[0]) and not g.accept(tok("a")[0])  # a refused token leaves the state alone
    assert allowed(g)[0] == set(tok("bc"))
    assert g.accept(tok("c")[0])
    assert allowed(g)[0] == {EOS}  # complete: only the stop token
    assert not g.is_terminated
    assert g.accept(EOS) and g.is_terminated
    assert not g.accept(tok("a")[0])


def test_verify_masks_assume_the_drafts_before_them_and_roll_back(cache: GrammarCompilerCache) -> None:
    g = cache.matcher(StructuredOutputsParams(choice=["abc", "ab-", "b"]))
    rows = allowed(g, tok("ab"))
    assert rows == [set(tok("ab")), set(tok("b")), set(tok("c-"))]
    assert allowed(g)[0] == set(tok("ab"))  # state unchanged by the tentative advance
    # A draft the grammar refuses: its row excludes it, the rows after it are unused (all allowed).
    rows = allowed(g, tok("ac") + tok("b"))
    assert rows[0] == set(tok("ab")) and rows[1] == set(tok("b")) and rows[2] == set(range(V))
    # A draft that terminates the grammar: rows after the stop token are unused.
    g2 = cache.matcher(StructuredOutputsParams(choice=["b"]))
    rows = allowed(g2, [tok("b")[0], EOS, tok("a")[0]])
    assert rows[:2] == [set(tok("b")), {EOS}] and rows[2] == rows[3] == set(range(V))
    assert not g2.is_terminated and allowed(g2)[0] == set(tok("b"))


def test_drafts_that_leave_the_grammar_are_cut(cache: GrammarCompilerCache) -> None:
    g = cache.matcher(StructuredOutputsParams(regex=r"[ab]+-[0-9]"))
    assert g.validate(tok("ab-5a-")) == tok("ab-5")
    assert g.validate(tok("ab-5") + [EOS, EOS]) == tok("ab-5") + [EOS]  # nothing after termination
    assert g.validate(tok("c")) == []
    assert g.validate([1, 39, 45]) == []  # special, beyond the tokenizer, beyond the logits
    assert g.validate(tok("a-c0"), keep_refused=True) == tok("a-c")  # sampled drafts keep the refused one
    assert g.num_accepted == 0 and allowed(g)[0] == set(tok("ab"))


def test_rejected_draft_positions_roll_the_matcher_back(cache: GrammarCompilerCache) -> None:
    """A verify of 3 drafts whose second one leaves the grammar: the masked target rejects it, only the
    accepted tokens advance the matcher, and the next masks start from there."""
    g = cache.matcher(StructuredOutputsParams(regex=r"a[bc]-"))
    drafts = tok("a-b")  # "-" is not allowed after "a"
    logits = torch.zeros(4, V)
    logits[:, tok("-")[0]] = 5.0  # the unconstrained target loves "-"
    logits[:, tok("c")[0]] = 1.0
    bm, rows = step_bitmask([(g, drafts)])
    masked = apply_grammar_bitmask(logits, logits, bm, rows)
    res = greedy_verify(masked, [drafts])
    assert res.token_ids[0] == tok("ac") and res.num_accepted[0] == 1
    for t in res.token_ids[0]:
        assert g.accept(t)
    assert allowed(g)[0] == set(tok("-"))
    # Random verification: a refused draft has p = 0 and is always rejected.
    g3 = cache.matcher(StructuredOutputsParams(regex=r"a[bc]-"))
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(apply_grammar_bitmask(logits, logits, *step_bitmask([(g3, drafts)])), -1)
    for _ in range(20):
        res = rejection_sample(probs, [drafts], None, [False], [gen])
        assert res.num_accepted[0] == 1 and res.token_ids[0][1] in tok("bc")


def test_step_bitmask_rows_follow_the_step_layout(cache: GrammarCompilerCache) -> None:
    g1 = cache.matcher(StructuredOutputsParams(regex="a+"))
    g2 = cache.matcher(StructuredOutputsParams(regex="b+"))
    bm, rows = step_bitmask([(None, [5, 6]), (g1, tok("a")), (None, []), (g2, [])])
    assert rows == [3, 4, 6]
    sets = [set(torch.nonzero(r).flatten().tolist()) for r in unpack_bitmask(bm, V)]
    assert sets == [set(tok("a")), set(tok("a")) | {EOS}, set(tok("b"))]
    assert step_bitmask([(None, [1]), (None, [])]) is None


def test_grammar_wins_over_min_tokens() -> None:
    """min_tokens banning the EOS the grammar requires would leave nothing: the row falls back to the
    raw logits under the grammar mask."""
    raw = torch.randn(2, V)
    processed = raw.clone()
    processed[0, EOS] = float("-inf")
    bm = torch.zeros(2, 2, dtype=torch.int32)
    bm[0, 0] = 1 << EOS
    bm[1, 0] = (1 << 5) | (1 << 7)
    out = apply_grammar_bitmask(processed, raw, bm, [0, 1])
    assert out[0].argmax().item() == EOS and torch.isinf(out[0]).sum() == V - 1
    assert set(torch.nonzero(torch.isfinite(out[1])).flatten().tolist()) == {5, 7}
    assert torch.equal(processed[0, :EOS], raw[0, :EOS])  # inputs untouched


def test_compiled_once_per_constraint(cache: GrammarCompilerCache) -> None:
    before = cache.num_compiled
    for _ in range(3):
        cache.matcher(StructuredOutputsParams(json={"type": "object", "properties": {"q": {"type": "integer"}}}))
        cache.matcher(StructuredOutputsParams(json='{"properties": {"q": {"type": "integer"}}, "type": "object"}'))
    assert cache.num_compiled == before + 1


def test_special_tokens_never_allowed_even_if_xgrammar_reads_them_as_text() -> None:
    """xgrammar takes "<s>" (id 1) for three characters; the tokenizer's special ids are banned anyway
    (the detokenizer would drop them: the text would not match)."""
    chars = list("<s>a")
    vocab = ["<unk>", "<s>", "</s>", "<pad>"] + chars
    info = xgrammar.TokenizerInfo(vocab, vocab_size=V, stop_token_ids=[EOS])
    spec = StructuredOutputsParams(regex="(<s>)?a")
    loose = GrammarCompilerCache(info).matcher(spec)
    assert 1 in allowed(loose)[0]  # the premise: xgrammar alone allows it
    strict = GrammarCompilerCache(info, special_token_ids=[0, 1, EOS, 3]).matcher(spec)
    assert allowed(strict)[0] == {4, 7}  # "<" and "a"
    assert strict.validate([1, 7]) == [] and not strict.accept(1)
    assert strict.accept(7) and allowed(strict)[0] == {EOS}  # the stop token stays allowed
    keep = GrammarCompilerCache(info, special_token_ids=[0, 31, 32, 39]).keep  # word edges, sign bit
    assert keep is not None
    banned = set(torch.nonzero(~unpack_bitmask(keep[None], V)[0]).flatten().tolist())
    assert banned == {0, 31, 32, 39} | {t for t in info.special_token_ids if t != EOS}
