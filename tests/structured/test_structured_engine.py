"""Structured output through the engine on a tiny random model: every output matches its constraint,
with and without speculation (n-gram, suffix, draft model, EAGLE-3), greedy outputs are identical with and
without it, and structured requests never take the asynchronous decode path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from eagle_heads import write_eagle_head
from engine_utils import make_llm
from tiny_models import write_tiny_hf_checkpoint

from tandem.engine.async_decode import device_greedy
from tandem.errors import SamplingParamsError
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
PROMPTS = ['{"name": "abc", "age": 12, ', "the quick brown fox", "x"]


def valid(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"name", "age", "ok"} and isinstance(v["name"], str)
            and re.fullmatch("[a-z]{1,6}", v["name"]) is not None
            and type(v["age"]) is int and 0 <= v["age"] <= 99 and type(v["ok"]) is bool)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("structured"), family="llama")


def specs(ckpt: Path) -> dict[str, dict | None]:
    return {"none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
            "suffix": {"method": "suffix", "num_speculative_tokens": 4},
            "draft_model": {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3},
            "draft_probabilistic": {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3,
                                    "draft_sample_method": "probabilistic"}}


def test_constraints_hold_with_every_speculation_method(ckpt: Path) -> None:
    json_p = StructuredOutputsParams(json=SCHEMA)
    greedy: dict[str, list[str]] = {}
    for name, spec in specs(ckpt).items():
        llm = make_llm(ckpt, max_model_len=256, speculative_config=spec, async_scheduling=True)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200, structured_outputs=json_p))
        greedy[name] = [o.outputs[0].text for o in outs]
        sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=200,
                                                        structured_outputs=json_p))
        for o in outs + sampled:
            for c in o.outputs:
                assert c.finish_reason == "stop" and valid(c.text), (name, c.text)
        regex = llm.generate(PROMPTS, SamplingParams(temperature=0.7, seed=1, max_tokens=20,
                                                      structured_outputs={"regex": r"[a-c]{2,4}-\d\d"}))
        assert all(re.fullmatch(r"[a-c]{2,4}-\d\d", o.outputs[0].text) for o in regex), name
        choice = llm.generate(PROMPTS * 3, SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                                                           structured_outputs={"choice": ["yes", "no", "maybe"]}))
        assert {o.outputs[0].text for o in choice} <= {"yes", "no", "maybe"}
        # A plain request in the same engine is unaffected (and may still decode asynchronously).
        plain = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert len(plain[0].outputs[0].token_ids) == 8
    for name, texts in greedy.items():
        assert texts == greedy["none"], name


def test_eagle3_under_a_grammar(tmp_path: Path) -> None:
    """EAGLE-3 drafts (a head on a 4-layer target) are cut and verified under the grammar like any other."""
    target = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2, name="target", num_hidden_layers=4)
    head, _ = write_eagle_head(tmp_path / "heads", "eagle3", target, aux=(1, 2, 3), draft_vocab=96)
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    plain = make_llm(target, max_model_len=256).generate(PROMPTS, params)
    llm = make_llm(target, max_model_len=256,
                   speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    spec = llm.generate(PROMPTS, params)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert all(valid(o.outputs[0].text) for o in spec)
    sampled = llm.generate(PROMPTS, params.clone(temperature=1.0, seed=5, n=2))
    assert all(valid(c.text) for o in sampled for c in o.outputs)
    assert llm.engine.stats.spec.num_draft_tokens > 0


def test_speculation_drafts_inside_the_grammar(ckpt: Path) -> None:
    """With the target as its own draft model, greedy drafts are the target's argmax: after the cut at
    the first refused token, every verified draft is accepted."""
    llm = make_llm(ckpt, max_model_len=256, speculative_config=specs(ckpt)["draft_model"])
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200,
                                                structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    drafted = sum(c.num_draft_tokens for o in out for c in o.outputs)
    accepted = sum(c.num_accepted_tokens for o in out for c in o.outputs)
    assert drafted > 0 and accepted == drafted


def test_structured_requests_stay_on_the_host(ckpt: Path) -> None:
    llm = make_llm(ckpt, max_model_len=256)
    llm.engine.add_request("a", "hello", SamplingParams(temperature=0, max_tokens=4,
                                                         structured_outputs={"regex": "[a-z]+"}))
    (r,) = llm.engine.scheduler.waiting
    assert r.grammar is not None and not device_greedy(r, 1)


def test_bad_constraint_fails_at_admission(ckpt: Path) -> None:
    llm = make_llm(ckpt, max_model_len=256)
    with pytest.raises(SamplingParamsError) as e:
        llm.engine.add_request("a", "hello", SamplingParams(structured_outputs={"regex": "(("}))
    assert e.value.field == "structured_outputs.regex"


@pytest.mark.parametrize("sample_method", ["probabilistic", "greedy"])
def test_sampled_structured_distribution_matches_target(tmp_path: Path, sample_method: str) -> None:
    """Under a grammar, the drafted-and-verified token follows the same (masked) distribution with and
    without speculation: a draft model sampling from its own q (its refused drafts kept and rejected,
    so the recovered token comes from norm(max(p - q, 0))) or proposing its argmax (refused drafts cut)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    target = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2, name="target")
    draft = write_tiny_hf_checkpoint(tmp_path, "llama", std=0.2, name="close", num_hidden_layers=1)
    # Every printable character: most of q's mass is allowed, the rest (ids the tokenizer never makes)
    # is refused, so norm(max(p - q, 0)) differs from p and cutting refused sampled drafts is detected.
    params = SamplingParams(temperature=1.0, max_tokens=4, structured_outputs={"regex": "[ -~]{3}"})
    n = 2000

    def counts(llm) -> Counter:
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * n, [params.clone(seed=i) for i in range(n)],
                            use_tqdm=False)
        assert all(re.fullmatch("[ -~]{3}", o.outputs[0].text) for o in outs)
        return Counter(o.outputs[0].text[1] for o in outs)  # position 1: drafted and verified

    plain = counts(make_llm(target, max_num_seqs=1024))
    spec = make_llm(target, max_num_seqs=1024, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
        "draft_sample_method": sample_method})
    drafted = counts(spec)
    st = spec.engine.stats.spec
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    keys = sorted(set(plain) | set(drafted))
    common = [k for k in keys if plain[k] + drafted[k] >= 10]
    rare = [k for k in keys if k not in common]
    table = [[c[k] for k in common] + [sum(c[k] for k in rare)] for c in (plain, drafted)]
    if not rare:
        table = [row[:-1] for row in table]
    assert chi2_contingency(table)[1] > 1e-3
