"""Small pieces of train-draft: draft vocabulary, batching, schedule, prompt selection, data cache."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.errors import ConfigError
from tandem.train.batches import epoch_batches, group_by_length, make_batch
from tandem.train.config import TrainConfig
from tandem.train.data import (
    DraftData,
    Sequence,
    load_cached,
    load_prompts,
    select_prompts,
)
from tandem.train.schedule import fit_total, lr_factor
from tandem.train.validate import expected_tau
from tandem.train.vocab import build_draft_vocab


def test_draft_vocab_is_the_most_frequent_ids_sorted_with_offsets():
    gen = [torch.tensor([7, 7, 7, 3, 3, 9, 1]), torch.tensor([9, 9, 5])]
    v = build_draft_vocab(gen, 12, 3)
    assert v.kept.tolist() == [3, 7, 9]  # counts 7:3, 9:3, 3:2 (ties → lower id first)
    assert v.d2t.tolist() == [3, 6, 7]  # target = draft + d2t[draft]
    assert torch.nonzero(v.t2d).squeeze(1).tolist() == [3, 7, 9]
    assert v.coverage == pytest.approx(8 / 10)
    assert build_draft_vocab(gen, 12, 50).size == 12  # never more than the target vocabulary


def test_batches_stay_within_the_token_budget_and_cover_every_sequence():
    seqs = [Sequence(torch.arange(n) + 1, 2) for n in (3, 9, 4, 17, 5, 8, 30)]
    groups = group_by_length(seqs, 32)
    assert sorted(i for g in groups for i in g) == list(range(7))
    for g in groups:
        b = make_batch([seqs[i] for i in g], 32)
        assert b.ids.numel() <= 32 or len(g) == 1
        for row, i in enumerate(g):
            n = min(len(seqs[i].tokens), 32)
            assert b.ids[row, :n].tolist() == seqs[i].tokens[:n].tolist() and int(b.lengths[row]) == n
    assert epoch_batches(seqs, 32, 0, 1) == epoch_batches(seqs, 32, 0, 1)  # a resume sees the same order


def test_schedule_warms_up_then_decays_to_zero():
    assert lr_factor(0, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 100, 0.1) == pytest.approx(0.5)
    assert lr_factor(100, 100, 0.1) == pytest.approx(0.0)
    assert fit_total(1000, 10, 10.0, 20.0) == 30  # 1 s/step, 20 s left
    assert fit_total(1000, 10, 10.0, 5000.0) == 1000
    assert expected_tau([0.5, 0.5]) == pytest.approx(1.75)


def test_held_out_prompts_are_disjoint_and_long_prompts_skipped(tmp_path):
    from tiny_models import tiny_tokenizer

    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "x" * (i % 7 + 1)} for i in range(30)] + [{"prompt": "y" * 400}]
    rows.append({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    f.write_text("\n".join(json.dumps(r) for r in rows))
    convs, _ = load_prompts(str(f))
    cfg = TrainConfig(target="t", out=str(tmp_path), data=str(f), num_prompts=100, val_prompts=5, max_prompt_tokens=64)
    sel = select_prompts(convs, tiny_tokenizer(), cfg)
    vi, ti = sel.val_idx, sel.train_idx
    assert len(sel.val) == 5 and not set(vi) & set(ti) and 30 not in vi + ti and len(vi + ti) == 31
    assert all(len(p) <= 64 for p in sel.val + sel.train) and not sel.given


def test_raw_text_rows_and_given_conversations(tmp_path):
    """``{"text"}`` rows are prompts without the chat template; conversations ending with an
    assistant turn train as given (prompt = everything before the first reply, cut to
    max_prompt_tokens + max_tokens) and are never held out; ``record`` is kept per row."""
    from tiny_models import tiny_tokenizer

    from tandem.loader.tokenizer import apply_chat_template

    tok = tiny_tokenizer()
    conv = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "runs fast " * 40},
            {"role": "user", "content": "and"}, {"role": "assistant", "content": "the dog"}]
    rows = [{"text": "def f(x):\n    return", "record": 3}] * 6 + [{"messages": conv, "record": 9}]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    loaded, _ = load_prompts(str(f))
    assert [r.record for r in loaded] == [3] * 6 + [9] and loaded[-1].given and not loaded[0].given
    cfg = TrainConfig(target="t", out=str(tmp_path), data=str(f), num_prompts=100, val_prompts=2,
                      max_prompt_tokens=64, max_tokens=16)
    sel = select_prompts(loaded, tok, cfg)
    assert len(sel.val) == 2 and len(sel.train) == 4 and sel.given_idx == [6]
    assert sel.val[0] == list(tok.encode("def f(x):\n    return", add_special_tokens=True))
    (seq,) = sel.given
    head = apply_chat_template(tok, conv[:1], add_generation_prompt=True)
    full = apply_chat_template(tok, conv, add_generation_prompt=False)
    assert seq.prompt_len == len(head) and seq.tokens.tolist() == full[:64 + 16] and len(full) > 80
    with pytest.raises(ConfigError, match="data"):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": []}))
        load_prompts(str(tmp_path / "bad.jsonl"))


def test_sharegpt_rows_cover_turns_given_conversations_and_code_prefixes():
    from tandem.train.sources import code_prefixes, sharegpt_rows

    code = "Here:\n```python\nimport os\nx = 1\ny = 2\nz = 3\nprint(x)\nprint(y)\n```\nand ```\na\n```"
    records = [
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q1"},
                           {"from": "gpt", "value": code}, {"from": "human", "value": "q2"},
                           {"from": "gpt", "value": "a2"}, {"from": "human", "value": "q3"}]},
        {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "human", "value": "x" * 50}, {"from": "gpt", "value": "y" * 50}]},
    ]
    assert code_prefixes(code) == ["import os\nx = 1\n"]  # a third of 6 lines; the 1-line block skipped
    rows = list(sharegpt_rows(records, 0, 2))
    user = [r for r in rows if "messages" in r and r["messages"][-1]["role"] == "user"]
    given = [r for r in rows if "messages" in r and r["messages"][-1]["role"] == "assistant"]
    text = [r for r in rows if "text" in r]
    assert [len(r["messages"]) for r in user] == [1, 3, 5, 1] and [r["record"] for r in user] == [0, 0, 0, 1]
    assert [m["content"] for m in given[0]["messages"]] == ["q1", code, "q2", "a2"] and len(given) == 1
    assert text == [{"text": "import os\nx = 1\n", "record": 0}]
    # the record range is honoured; prompts and given conversations stay within their character caps
    rows = list(sharegpt_rows(records, 2, 3, max_prompt_chars=60, max_given_chars=60))
    assert rows == [{"messages": [{"role": "user", "content": "x" * 50}], "record": 2}]


def test_data_cache_is_reused_only_for_the_same_generation_settings(tmp_path):
    cfg = TrainConfig(target="t", out=str(tmp_path), num_prompts=3, val_prompts=1)
    seq = Sequence(torch.arange(6), 2)
    data = DraftData([seq], [seq], [4], [0], "src", 1.0)
    path = tmp_path / "cache" / "data.pt"
    path.parent.mkdir()
    torch.save({"key": json.dumps(cfg.generation_key(), sort_keys=True), "source": "src",
                "train": {"tokens": [seq.tokens], "prompt_lens": [2]}, "val": {"tokens": [seq.tokens], "prompt_lens": [2]},
                "train_indices": data.train_indices, "val_indices": data.val_indices}, path)
    got = load_cached(cfg)
    assert got is not None and got.train_indices == [4] and got.train[0].tokens.tolist() == list(range(6))
    assert load_cached(TrainConfig(target="t", out=str(tmp_path), num_prompts=3, val_prompts=1, max_tokens=7)) is None


def test_bad_settings_name_their_key():
    for kw, key in (({"method": "medusa"}, "method"), ({"lr": 0.0}, "lr"), ({"warmup": 1.5}, "warmup"),
                    ({"eval_k": (0,)}, "eval_k"), ({"method": "eagle", "aux_layers": (1,)}, "aux_layers")):
        with pytest.raises(ConfigError, match=key):
            TrainConfig(target="t", out="o", **kw)


def test_sources_command_writes_rows_a_run_can_read(tmp_path, capsys):
    """``python -m tandem.train.sources`` over a gzipped ShareGPT file: one JSON row per line (text
    with U+2028 kept), readable by ``load_prompts``."""
    import gzip

    from tandem.train.sources import main as sources_main

    recs = [{"conversations": [{"from": "human", "value": f"q{i}\u2028more"}, {"from": "gpt", "value": "a"}]}
            for i in range(5)]
    src = tmp_path / "sg.json.gz"
    src.write_bytes(gzip.compress(json.dumps(recs).encode()))
    out = tmp_path / "mix.jsonl"
    sources_main(["--sharegpt", str(src), "--records", "1:4", "--given-records", "3:4", "--out", str(out)])
    assert "3 user turns to answer, 1 given conversations, 0 code prefixes" in capsys.readouterr().out
    rows, _ = load_prompts(str(out))
    assert [r.record for r in rows] == [1, 2, 3, 3] and rows[-1].given
    assert rows[0].messages[0]["content"] == "q1\u2028more"


def test_data_cache_round_trip_is_flat_and_small(tmp_path):
    """The cache holds one flat tensor (uint16 when every id fits, else int32) and reads back the
    same sequences; caches in the older per-sequence layout still load."""
    from tandem.train.data import _from_state, _to_state

    seqs = [Sequence(torch.tensor([5, 60000, 7]), 1), Sequence(torch.tensor([1, 2, 3, 4, 9]), 3)]
    state = _to_state(seqs)
    assert state["flat"].dtype == torch.uint16 and state["flat"].numel() == 8
    path = tmp_path / "c.pt"
    torch.save(state, path)
    back = _from_state(torch.load(path, weights_only=True))
    assert [(s.tokens.tolist(), s.prompt_len) for s in back] == [(s.tokens.tolist(), s.prompt_len) for s in seqs]
    assert all(s.tokens.dtype == torch.long for s in back)
    big = [Sequence(torch.tensor([1, 262143]), 1)]  # Gemma-sized ids keep int32
    assert _to_state(big)["flat"].dtype == torch.int32 and _from_state(_to_state(big))[0].tokens.tolist() == [1, 262143]
    assert _from_state(_to_state([])) == []
