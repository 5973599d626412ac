"""SpeculativeConfig: vLLM's speculative_config contract, deprecated spellings, CLI flags."""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import pytest

from tandem.errors import ConfigError
from tandem.config.speculative import (
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    DEPRECATED_KWARGS,
    NOT_YET_SUPPORTED_METHODS,
    SUPPORTED_METHODS,
    SpeculativeConfig,
    resolve_speculative_config,
    validate_against_target,
)
from tandem.engine.args import add_speculative_args, speculative_config_from_args


def cfg(**kw: Any) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict(kw)


def raises(key: str, *fragments: str, **kw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.from_dict(kw)
    err = info.value
    assert err.key == key, str(err)
    for fragment in fragments:
        assert fragment in str(err), str(err)
    return err


# --- valid configs ---------------------------------------------------------------------------------


def test_ngram_explicit() -> None:
    c = cfg(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    assert (c.method, c.num_speculative_tokens, c.model) == ("ngram", 4, None)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 3)
    assert not c.is_synthetic


def test_ngram_defaults_when_both_missing() -> None:
    c = cfg(method="ngram", num_speculative_tokens=4)
    assert c.prompt_lookup_min == DEFAULT_PROMPT_LOOKUP_MIN == 1
    assert c.prompt_lookup_max == DEFAULT_PROMPT_LOOKUP_MAX == 5


def test_ngram_one_missing_copies_the_other() -> None:
    c = cfg(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = cfg(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize("alias", ["ngram", "[ngram]"])
def test_model_alias_means_ngram(alias: str) -> None:
    c = cfg(model=alias, num_speculative_tokens=3)
    assert c.method == "ngram" and c.model is None
    c = cfg(method="ngram", model=alias, num_speculative_tokens=3)
    assert c.method == "ngram" and c.model is None


def test_bracket_method_normalised() -> None:
    assert cfg(method="[ngram]", num_speculative_tokens=2).method == "ngram"


def test_model_infers_draft_model() -> None:
    c = cfg(model="HuggingFaceTB/SmolLM2-135M-Instruct", num_speculative_tokens=5)
    assert c.method == "draft_model"
    assert c.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert c.prompt_lookup_min is None and c.prompt_lookup_max is None
    assert c.draft_sample_method == "greedy" and c.rejection_sample_method == "standard"


def test_draft_model_full() -> None:
    c = cfg(
        method="draft_model",
        model="draft",
        num_speculative_tokens=3,
        draft_tensor_parallel_size=1,
        max_model_len=2048,
        revision="main",
        enforce_eager=True,
        draft_sample_method="probabilistic",
    )
    assert c.max_model_len == 2048 and c.enforce_eager is True
    assert c.draft_sample_method == "probabilistic"


def test_synthetic() -> None:
    c = cfg(
        method="ngram",
        num_speculative_tokens=4,
        rejection_sample_method="synthetic",
        synthetic_acceptance_rate=0.7,
    )
    assert c.is_synthetic and c.synthetic_acceptance_rate == 0.7
    for rate in (0, 1, 0.0, 1.0):
        assert cfg(
            method="ngram",
            num_speculative_tokens=4,
            rejection_sample_method="synthetic",
            synthetic_acceptance_rate=rate,
        ).is_synthetic


def test_null_means_default() -> None:
    c = cfg(
        method="ngram",
        num_speculative_tokens=2,
        draft_tensor_parallel_size=None,
        draft_sample_method=None,
        rejection_sample_method=None,
        model=None,
    )
    assert c.draft_tensor_parallel_size == 1 and c.draft_sample_method == "greedy"


def test_to_dict_roundtrip_and_frozen() -> None:
    for c in (
        cfg(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3),
        cfg(model="d", num_speculative_tokens=2, max_model_len=128, enforce_eager=False),
        cfg(
            method="ngram",
            num_speculative_tokens=1,
            rejection_sample_method="synthetic",
            synthetic_acceptance_rate=0.5,
        ),
    ):
        d = c.to_dict()
        assert set(d) >= {"method", "num_speculative_tokens", "model", "synthetic_acceptance_rate"}
        assert SpeculativeConfig.from_dict(d) == c
        assert SpeculativeConfig.from_json(json.dumps(d)) == c
        assert SpeculativeConfig.from_json(c.to_json()) == c
    with pytest.raises(AttributeError):
        c.num_speculative_tokens = 9  # type: ignore[misc]


def test_direct_construction_is_validated() -> None:
    assert SpeculativeConfig("ngram", 3).prompt_lookup_max == 5
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig("ngram", 0)
    assert info.value.key == "num_speculative_tokens"


# --- errors: one ConfigError naming the key ---------------------------------------------------------


def test_unknown_key_suggests_closest() -> None:
    err = raises(
        "num_speculative_token", "did you mean 'num_speculative_tokens'", "known keys",
        method="ngram", num_speculative_token=3,
    )
    assert "prompt_lookup_max" in str(err)  # the known keys are listed


def test_unknown_key_deprecated_spelling_inside_config() -> None:
    raises(
        "ngram_prompt_lookup_max", "'prompt_lookup_max'",
        method="ngram", num_speculative_tokens=3, ngram_prompt_lookup_max=4,
    )


def test_unknown_key_without_close_match() -> None:
    err = raises("zzz", "unknown speculative_config key 'zzz'", method="ngram",
                 num_speculative_tokens=3, zzz=1)
    assert "did you mean" not in str(err)


@pytest.mark.parametrize(
    "key,value",
    [
        ("num_speculative_tokens", True),
        ("num_speculative_tokens", 2.0),
        ("num_speculative_tokens", "3"),
        ("prompt_lookup_min", False),
        ("prompt_lookup_max", 2.5),
        ("draft_tensor_parallel_size", True),
        ("max_model_len", "1024"),
        ("revision", 3),
        ("enforce_eager", 1),
        ("method", 1),
        ("draft_sample_method", 0),
        ("synthetic_acceptance_rate", True),
        ("synthetic_acceptance_rate", "0.5"),
    ],
)
def test_wrong_types(key: str, value: Any) -> None:
    kw: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 3}
    if key == "synthetic_acceptance_rate":
        kw["rejection_sample_method"] = "synthetic"
    kw[key] = value
    err = raises(key, **kw)
    assert "expected" in str(err)


def test_model_wrong_type() -> None:
    raises("model", "expected a string", model=5, num_speculative_tokens=3)


def test_num_speculative_tokens_required() -> None:
    raises("num_speculative_tokens", "is required", method="ngram")
    raises("num_speculative_tokens", "is required", method="ngram", num_speculative_tokens=None)


@pytest.mark.parametrize("k", [0, -1])
def test_num_speculative_tokens_positive(k: int) -> None:
    raises("num_speculative_tokens", "must be > 0", method="ngram", num_speculative_tokens=k)


def test_method_required_without_model() -> None:
    err = raises("method", "is required", num_speculative_tokens=3)
    assert err.allowed == list(SUPPORTED_METHODS)


@pytest.mark.parametrize("method", ["mtp", "medusa"])
def test_method_not_supported_yet(method: str) -> None:
    assert method in NOT_YET_SUPPORTED_METHODS
    err = raises("method", "not supported yet", method=method, model="x", num_speculative_tokens=3)
    assert err.allowed == list(SUPPORTED_METHODS)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_methods_need_a_head(method: str) -> None:
    raises("model", "needs an EAGLE head", method=method, num_speculative_tokens=3)
    raises("draft_sample_method", "only 'greedy'", method=method, model="x", num_speculative_tokens=3,
           draft_sample_method="probabilistic")


def test_method_unknown() -> None:
    err = raises("method", "unknown speculative method 'bogus'", method="bogus",
                 num_speculative_tokens=3)
    assert err.allowed == ["draft_model", "eagle", "eagle3", "ngram", "suffix"]


def test_draft_model_requires_model() -> None:
    raises("model", "needs a draft model", method="draft_model", num_speculative_tokens=3)


def test_draft_model_with_ngram_alias() -> None:
    raises("model", "use method 'ngram'", method="draft_model", model="[ngram]",
           num_speculative_tokens=3)


def test_ngram_with_real_model() -> None:
    raises("model", "uses no draft model", method="ngram", model="some/draft",
           num_speculative_tokens=3)


def test_prompt_lookup_only_for_ngram() -> None:
    raises("prompt_lookup_max", "only applies to method 'ngram'", model="d",
           num_speculative_tokens=3, prompt_lookup_max=3)


def test_prompt_lookup_min_greater_than_max() -> None:
    raises("prompt_lookup_min", "must not exceed prompt_lookup_max (2)", method="ngram",
           num_speculative_tokens=3, prompt_lookup_min=3, prompt_lookup_max=2)


def test_prompt_lookup_below_one() -> None:
    raises("prompt_lookup_min", ">= 1", method="ngram", num_speculative_tokens=3,
           prompt_lookup_min=0, prompt_lookup_max=2)
    raises("prompt_lookup_max", ">= 1", method="ngram", num_speculative_tokens=3,
           prompt_lookup_min=1, prompt_lookup_max=0)
    raises("prompt_lookup_min", ">= 1", method="ngram", num_speculative_tokens=3,
           prompt_lookup_min=0)


def test_draft_tensor_parallel_size_must_be_one() -> None:
    err = raises("draft_tensor_parallel_size", "not supported", model="d",
                 num_speculative_tokens=3, draft_tensor_parallel_size=2)
    assert err.allowed == [1]


def test_max_model_len_positive() -> None:
    raises("max_model_len", ">= 1", model="d", num_speculative_tokens=3, max_model_len=0)


def test_quantization_rejected() -> None:
    err = raises("quantization", "'fp8' is not supported by tandem", model="d", num_speculative_tokens=3,
                 quantization="fp8")
    assert err.allowed is not None and "int4" in err.allowed and "gptq" in err.allowed


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle3"])
def test_quantization_only_for_a_draft_model(method: str) -> None:
    extra = {"model": "smollm2-135m-instruct-eagle3"} if method == "eagle3" else {}
    err = raises("quantization", "only applies to method 'draft_model'", method=method, num_speculative_tokens=3,
                 quantization="int8", **extra)
    assert err.allowed == ["none"]
    cfg(method=method, num_speculative_tokens=3, quantization="none", **extra)  # a no-op: accepted


def test_draft_sample_method_allowed() -> None:
    err = raises("draft_sample_method", "'top_k'", model="d", num_speculative_tokens=3,
                 draft_sample_method="top_k")
    assert err.allowed == ["greedy", "probabilistic"]


def test_ngram_cannot_sample_probabilistically() -> None:
    raises("draft_sample_method", "no probabilities", method="ngram", num_speculative_tokens=3,
           draft_sample_method="probabilistic")


def test_rejection_sample_method_allowed() -> None:
    err = raises("rejection_sample_method", "'lossy'", method="ngram", num_speculative_tokens=3,
                 rejection_sample_method="lossy")
    assert err.allowed == ["standard", "synthetic"]


def test_synthetic_requires_rate() -> None:
    raises("synthetic_acceptance_rate", "is required", method="ngram", num_speculative_tokens=3,
           rejection_sample_method="synthetic")


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_synthetic_rate_range(rate: float) -> None:
    raises("synthetic_acceptance_rate", "between 0 and 1", method="ngram",
           num_speculative_tokens=3, rejection_sample_method="synthetic",
           synthetic_acceptance_rate=rate)


def test_rate_only_with_synthetic() -> None:
    raises("synthetic_acceptance_rate", "only applies", method="ngram", num_speculative_tokens=3,
           synthetic_acceptance_rate=0.5)


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.from_dict([("method", "ngram")])  # type: ignore[arg-type]
    assert info.value.key == "speculative_config"


# --- JSON ------------------------------------------------------------------------------------------


def test_from_json() -> None:
    c = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 4, 3, 3,
    )
    c = SpeculativeConfig.from_json('{"model": "d", "num_speculative_tokens": 2, "revision": null}')
    assert c.method == "draft_model" and c.revision is None


@pytest.mark.parametrize(
    "text", ["{'method': 'ngram'}", '{"method": "ngram",', "", "ngram"]
)
def test_from_json_bad_json(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.from_json(text)
    assert info.value.key == "speculative_config"
    assert "not valid JSON" in str(info.value) and "double quotes" in str(info.value)


@pytest.mark.parametrize("text", ["[1, 2]", "4", '"ngram"', "null"])
def test_from_json_not_an_object(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.from_json(text)
    assert info.value.key == "speculative_config" and "JSON object" in str(info.value)


def test_from_json_errors_name_inner_key() -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": true}')
    assert info.value.key == "num_speculative_tokens"


# --- checks against the loaded models ---------------------------------------------------------------


def test_validate_against_target_ok() -> None:
    c = cfg(model="d", num_speculative_tokens=3, max_model_len=1024)
    validate_against_target(c, target_vocab_size=100, draft_vocab_size=100,
                            target_max_model_len=2048, draft_max_model_len=1024)
    n = cfg(method="ngram", num_speculative_tokens=3)
    validate_against_target(n, target_vocab_size=100, draft_vocab_size=None,
                            target_max_model_len=2048, draft_max_model_len=None)


def test_validate_vocab_mismatch() -> None:
    c = cfg(model="d", num_speculative_tokens=3)
    with pytest.raises(ConfigError) as info:
        validate_against_target(c, target_vocab_size=152064, draft_vocab_size=151936,
                                target_max_model_len=2048, draft_max_model_len=2048)
    assert info.value.key == "model"
    assert "draft vocabulary (151936) differs from the target's (152064)" in str(info.value)


def test_validate_max_model_len() -> None:
    c = cfg(model="d", num_speculative_tokens=3, max_model_len=4096)
    with pytest.raises(ConfigError) as info:
        validate_against_target(c, target_vocab_size=10, draft_vocab_size=10,
                                target_max_model_len=2048, draft_max_model_len=8192)
    assert info.value.key == "max_model_len" and "larger than the target's (2048)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        validate_against_target(c, target_vocab_size=10, draft_vocab_size=10,
                                target_max_model_len=8192, draft_max_model_len=2048)
    assert info.value.key == "max_model_len" and "draft model's (2048)" in str(info.value)


# --- deprecated spellings ---------------------------------------------------------------------------


def resolve_recording(
    spec: Any, deprecated: dict[str, Any]
) -> tuple[SpeculativeConfig | None, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = resolve_speculative_config(spec, deprecated)
    return out, list(caught)


def test_deprecated_kwargs_map_and_warn_once_each() -> None:
    deprecated = {
        "speculative_model": "[ngram]",
        "num_speculative_tokens": 4,
        "ngram_prompt_lookup_max": 4,
        "ngram_prompt_lookup_min": 2,
        "speculative_draft_tensor_parallel_size": 1,
        "speculative_max_model_len": 1024,
    }
    assert set(deprecated) == set(DEPRECATED_KWARGS)
    c, caught = resolve_recording(None, deprecated)
    assert c == SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "draft_tensor_parallel_size": 1, "max_model_len": 1024}
    )
    assert len(caught) == len(deprecated)
    assert all(w.category is FutureWarning for w in caught)
    messages = [str(w.message) for w in caught]
    for old, new in DEPRECATED_KWARGS.items():
        (msg,) = [m for m in messages if m.startswith(f"`{old}`")]
        assert "--" + old.replace("_", "-") in msg and "is deprecated" in msg
        assert f"speculative_config={{'{new}': " in msg and f'--speculative-config \'{{"{new}": ' in msg


def test_deprecated_message_text() -> None:
    _, caught = resolve_recording(None, {"speculative_model": "tiny", "num_speculative_tokens": 3})
    msgs = sorted(str(w.message) for w in caught)
    assert msgs[1] == (
        "`speculative_model` (--speculative-model) is deprecated; use "
        "speculative_config={'model': 'tiny'} (--speculative-config '{\"model\": \"tiny\"}')"
    )


def test_deprecated_draft_model() -> None:
    c, caught = resolve_recording(None, {"speculative_model": "tiny", "num_speculative_tokens": 3,
                                         "ngram_prompt_lookup_max": None})
    assert c is not None and c.method == "draft_model" and c.model == "tiny"
    assert len(caught) == 2  # None values were not "given"


def test_deprecated_without_model_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_recording(None, {"num_speculative_tokens": 3})
    assert info.value.key == "speculative_model"


def test_mixing_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_recording({"method": "ngram", "num_speculative_tokens": 3},
                          {"speculative_model": "[ngram]"})
    assert info.value.key == "speculative_config"
    assert "cannot be combined with deprecated" in str(info.value)
    assert "speculative_model (--speculative-model)" in str(info.value)


def test_resolve_new_forms_do_not_warn() -> None:
    want = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    for spec in (want, want.to_dict(), want.to_json()):
        got, caught = resolve_recording(spec, {})
        assert got == want and caught == []
    assert resolve_recording(None, {}) == (None, [])
    assert resolve_recording(None, {"speculative_model": None}) == (None, [])


def test_resolve_bad_type() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_speculative_config(4, {})  # type: ignore[arg-type]
    assert info.value.key == "speculative_config"


# --- CLI ---------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem")
    add_speculative_args(p)
    return p


def test_cli_no_flags() -> None:
    assert speculative_config_from_args(parser().parse_args([])) is None


def test_cli_speculative_config_roundtrip() -> None:
    want = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}
    )
    ns = parser().parse_args(["--speculative-config", want.to_json()])
    assert speculative_config_from_args(ns) == want
    ns = parser().parse_args(["--speculative-config", '{"model": "d", "num_speculative_tokens": 2}'])
    got = speculative_config_from_args(ns)
    assert got is not None and got.method == "draft_model" and got.model == "d"


def test_cli_deprecated_flags() -> None:
    argv = ["--speculative-model", "[ngram]", "--num-speculative-tokens", "5",
            "--ngram-prompt-lookup-max", "4", "--ngram-prompt-lookup-min", "2",
            "--speculative-draft-tensor-parallel-size", "1", "--speculative-max-model-len", "512"]
    ns = parser().parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = speculative_config_from_args(ns)
    assert got == SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "max_model_len": 512}
    )
    assert len(caught) == 6 and all(w.category is FutureWarning for w in caught)


def test_cli_mixing_is_an_error() -> None:
    ns = parser().parse_args(["--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 3}', "--num-speculative-tokens", "3"])
    with pytest.raises(ConfigError) as info:
        speculative_config_from_args(ns)
    assert info.value.key == "speculative_config"


def test_cli_bad_json_is_a_config_error() -> None:
    ns = parser().parse_args(["--speculative-config", "{method: ngram}"])
    with pytest.raises(ConfigError) as info:
        speculative_config_from_args(ns)
    assert info.value.key == "speculative_config"


def test_cli_help_marks_deprecated() -> None:
    text = parser().format_help()
    assert "--speculative-config" in text
    for old in DEPRECATED_KWARGS:
        assert "--" + old.replace("_", "-") in text
    assert text.count("[deprecated]") == len(DEPRECATED_KWARGS)


# --- method "suffix" -------------------------------------------------------------------------------


def test_suffix_defaults_are_vllms() -> None:
    c = cfg(method="suffix")
    assert c.num_speculative_tokens == 24  # unset: the tree depth, a maximum (as vLLM)
    assert (c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    assert c.model is None and c.prompt_lookup_min is None
    assert SpeculativeConfig.from_dict(c.to_dict()) == c
    assert SpeculativeConfig.from_json(c.to_json()) == c
    assert cfg(method="suffix", suffix_decoding_max_tree_depth=8).num_speculative_tokens == 8
    c = cfg(method="suffix", num_speculative_tokens=16, suffix_decoding_max_cached_requests=0,
            suffix_decoding_max_spec_factor=2, suffix_decoding_min_token_prob=0)
    assert (c.num_speculative_tokens, c.suffix_decoding_max_cached_requests) == (16, 0)
    direct = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
    assert direct.suffix_decoding_max_tree_depth == 24


@pytest.mark.parametrize("key,value,fragment", [
    ("suffix_decoding_max_tree_depth", 0, ">= 1"),
    ("suffix_decoding_max_tree_depth", True, "expected"),
    ("suffix_decoding_max_tree_depth", 2.5, "expected"),
    ("suffix_decoding_max_cached_requests", -1, ">= 0"),
    ("suffix_decoding_max_spec_factor", 0, "> 0"),
    ("suffix_decoding_max_spec_factor", float("inf"), "finite"),
    ("suffix_decoding_max_spec_factor", "2", "expected a number"),
    ("suffix_decoding_min_token_prob", 1.5, "between 0 and 1"),
    ("suffix_decoding_min_token_prob", -0.1, "between 0 and 1"),
    ("suffix_decoding_min_token_prob", float("nan"), "between 0 and 1"),
    ("num_speculative_tokens", 0, "must be > 0"),
    ("model", "x", "uses no draft model"),
    ("prompt_lookup_max", 3, "only applies to method 'ngram'"),
    ("disable_by_acceptance", "yes", "expected true, false or null"),
    ("disable_by_batch_size", 0, ">= 1"),
    ("draft_sample_method", "probabilistic", "only 'greedy'"),
])
def test_suffix_bad_values_name_the_key(key: str, value: Any, fragment: str) -> None:
    raises(key, fragment, method="suffix", **{key: value})


@pytest.mark.parametrize("method,extra", [("ngram", {}), ("draft_model", {"model": "d"})])
def test_suffix_keys_only_for_suffix(method: str, extra: dict[str, Any]) -> None:
    for key in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
        raises(key, "only applies to method 'suffix'", method=method, num_speculative_tokens=3,
               **extra, **{key: 1})
    with pytest.raises(ConfigError) as info:  # k stays required for the other methods
        SpeculativeConfig.from_dict({"method": method, **extra})
    assert info.value.key == "num_speculative_tokens"
