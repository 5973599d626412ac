"""``LLM(skip_tokenizer_init=True)`` (vLLM's): no tokenizer; token-id prompts only; outputs carry ids, no text."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_utils import greedy, make_llm, tokens_of
from tiny_models import write_tiny_hf_checkpoint

from tandem import LLM, SamplingParams
from tandem.cli import main
from tandem.errors import RequestError

PROMPTS = [[5, 9, 13, 2, 7], [3, 4, 5, 6]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("skip_tok"), family="llama")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return make_llm(ckpt, skip_tokenizer_init=True)


def test_no_tokenizer_is_loaded(llm: LLM) -> None:
    assert llm.get_tokenizer() is None
    assert llm.engine.config.model.skip_tokenizer_init is True


def test_token_prompts_give_the_same_tokens_and_no_text(ckpt: Path, llm: LLM) -> None:
    ref = make_llm(ckpt).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(8), use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(8), use_tqdm=False)
    assert tokens_of(got) == tokens_of(ref)
    for out in got:
        assert out.error is None and out.prompt is None
        assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 8
    assert tokens_of(llm.generate(PROMPTS[0], greedy(8), use_tqdm=False)) == tokens_of(ref)[:1]  # a list of ints


def test_speculation_still_works(ckpt: Path) -> None:
    llm = make_llm(ckpt, skip_tokenizer_init=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    ref = make_llm(ckpt).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(8), use_tqdm=False)
    assert tokens_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(8), use_tqdm=False)) \
        == tokens_of(ref)


@pytest.mark.parametrize("prompts", ["hello", ["hello"], [{"prompt": "hello"}], [PROMPTS[0], "hello"]])
def test_text_prompts_are_one_clear_error(llm: LLM, prompts: object) -> None:
    with pytest.raises(RequestError, match="text prompts need the tokenizer, which skip_tokenizer_init=True"):
        llm.generate(prompts, greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued


def test_engine_level_text_prompt_and_stop_strings_are_refused(llm: LLM) -> None:
    with pytest.raises(RequestError, match="skip_tokenizer_init"):
        llm.engine.add_request("x", "hello", greedy(4))
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, stop=["a"]), use_tqdm=False)[0]
    assert out.error is not None and "stop strings need the tokenizer" in out.error
    assert llm.generate(PROMPTS[0], greedy(4, stop_token_ids=[1]), use_tqdm=False)[0].error is None


def test_chat_is_refused(llm: LLM) -> None:
    with pytest.raises(RequestError, match="chat needs the tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_generate_command_says_why(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "hello", "--model", str(ckpt), "--device", "cpu", "--kv-cache-memory-bytes",
               str(16 << 20), "--skip-tokenizer-init"])
    assert rc == 2
    assert "error: text prompts need the tokenizer" in capsys.readouterr().err
