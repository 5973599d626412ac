"""What a request's outputs carry while it runs (``SamplingParams.output_kind``, vLLM's
``RequestOutputKind``) and ``detokenize=False``: per-step outputs of the engine on CPU with a tiny
random checkpoint, compared with the cumulative outputs of the same requests."""

from __future__ import annotations

import pytest

from engine_utils import greedy, make_llm
from tandem import RequestOutputKind, SamplingParams
from tandem.errors import SamplingParamsError
from tiny_models import write_tiny_hf_checkpoint

PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 40], [7] * 12]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return make_llm(write_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


def _run(llm, params: SamplingParams, prompts=PROMPTS) -> dict[str, list]:
    """Every RequestOutput engine.step() returned, per request, in order."""
    eng = llm.engine
    seen: dict[str, list] = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", None, params, prompt_token_ids=p)
        seen[f"r{i}"] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    return seen


def _lps(entries: list) -> list[float]:
    return [lp.logprob for e in entries for lp in e.values()]


def test_final_only_gives_one_output_equal_to_the_cumulative_last(llm):
    base = greedy(20, logprobs=1)
    cum = _run(llm, base)
    final = _run(llm, base.clone(output_kind=RequestOutputKind.FINAL_ONLY))
    for rid, outs in final.items():
        assert len(cum[rid]) > 1  # several steps, each with an output
        assert len(outs) == 1 and outs[0].finished
        a, b = outs[0].outputs[0], cum[rid][-1].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert _lps(a.logprobs) == pytest.approx(_lps(b.logprobs), abs=1e-4)  # the prompt's KV may be cached now


def test_deltas_concatenate_to_the_cumulative_output(llm):
    base = greedy(20, logprobs=1)
    cum = _run(llm, base)
    delta = _run(llm, base.clone(output_kind=RequestOutputKind.DELTA))
    for rid, outs in delta.items():
        last = cum[rid][-1].outputs[0]
        assert len(outs) == len(cum[rid])
        assert "".join(o.outputs[0].text for o in outs) == last.text
        assert sum((o.outputs[0].token_ids for o in outs), []) == last.token_ids
        assert _lps(sum((o.outputs[0].logprobs for o in outs), [])) == pytest.approx(_lps(last.logprobs), abs=1e-4)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def test_delta_text_held_back_while_a_stop_string_may_still_cut_it(llm):
    full = _run(llm, greedy(24))["r0"][-1].outputs[0]
    stop = full.text[6:9]
    params = greedy(24, stop=[stop], output_kind=RequestOutputKind.DELTA)
    outs = _run(llm, params, PROMPTS[:1])["r0"]
    sent = ""
    for o in outs:
        sent += o.outputs[0].text
        assert full.text.startswith(sent)  # never text the stop string later cuts
    assert sent == full.text[: full.text.index(stop)] and outs[-1].outputs[0].stop_reason == stop


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    with_text = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(16), use_tqdm=False)
    without = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(16, detokenize=False),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in without] == [o.outputs[0].token_ids for o in with_text]
    assert all(o.outputs[0].text == "" for o in without) and all(o.outputs[0].text for o in with_text)


def test_generate_asks_for_final_outputs_only_and_leaves_the_params_alone(llm):
    params = greedy(8)
    steps: list[int] = []
    real_step = llm.engine.step

    def counting_step():
        outs = real_step()
        steps.append(sum(not o.finished for o in outs))
        return outs

    llm.engine.step = counting_step
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        del llm.engine.step
    assert sum(steps) == 0 and len(steps) >= 8  # no output of an unfinished request was built
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_bad_output_kind_and_stop_without_text_name_the_field():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(output_kind=7)
    assert e.value.field == "output_kind" and "FINAL_ONLY (2)" in str(e.value)
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(detokenize=False, stop=["x"])
    assert e.value.field == "stop"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(detokenize="no")
    assert e.value.field == "detokenize"
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
