"""vLLM launch-script flags that configure nothing in tandem (tandem/config/compat.py): accepted or refused."""

from __future__ import annotations

import logging

import pytest

from tandem.config import EngineConfig, ModelConfig
from tandem.config.compat import COMPAT_KWARGS
from tandem.engine.args import ENGINE_KWARGS, engine_config, engine_kwargs
from tandem.errors import ConfigError

from cli_utils import from_cli, parser


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_compat_keywords_are_llm_keywords_and_change_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert set(COMPAT_KWARGS) <= set(ENGINE_KWARGS)
    assert set(COMPAT_KWARGS) >= {"trust_remote_code", "swap_space", "tensor_parallel_size"}
    assert engine_kwargs(parser().parse_args([])) == {}  # unset unless given
    with caplog.at_level(logging.WARNING):
        cfg = engine_config("m", trust_remote_code=False, swap_space=0, tensor_parallel_size=1,
                            pipeline_parallel_size=1, enable_chunked_prefill=True, kv_cache_dtype="auto")
    assert cfg == EngineConfig(ModelConfig("m"))
    assert warnings_of(caplog) == []  # what tandem does anyway: silent


@pytest.mark.parametrize("argv,needle", [
    (["--trust-remote-code"], "trust_remote_code: tandem runs no remote code"),
    (["--swap-space", "16"], "swap_space: tandem has no CPU swap space; a preempted request frees its KV blocks "
                             "and is recomputed when it resumes (swap_space=16 ignored)"),
    (["--swap-space", "0.5"], "swap_space=0.5 ignored"),
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill=False: tandem always prefills"),
])
def test_accepted_flags_warn_one_line(caplog: pytest.LogCaptureFixture, argv: list[str], needle: str) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = from_cli(*argv)
    assert cfg == EngineConfig(ModelConfig("m"))
    got = warnings_of(caplog)
    assert len(got) == 1 and needle in got[0] and "\n" not in got[0]


@pytest.mark.parametrize("argv", [[], ["-tp", "1"], ["--tensor-parallel-size", "1"], ["-pp", "1"],
                                  ["--pipeline-parallel-size", "1"], ["--enable-chunked-prefill"],
                                  ["--swap-space", "0"], ["--kv-cache-dtype", "auto"], ["--no-trust-remote-code"]])
def test_accepted_silently(caplog: pytest.LogCaptureFixture, argv: list[str]) -> None:
    with caplog.at_level(logging.WARNING):
        assert from_cli(*argv) == EngineConfig(ModelConfig("m"))
    assert warnings_of(caplog) == []


def test_flags_parse_to_the_keywords() -> None:
    ns = parser().parse_args(["--trust-remote-code", "--swap-space", "4", "-tp", "1", "-pp", "1",
                              "--enable-chunked-prefill", "--kv-cache-dtype", "auto"])
    assert engine_kwargs(ns) == {"trust_remote_code": True, "swap_space": 4.0, "tensor_parallel_size": 1,
                                 "pipeline_parallel_size": 1, "enable_chunked_prefill": True,
                                 "kv_cache_dtype": "auto"}
    assert parser().parse_args(["-q", "awq"]).quantization == "awq"


@pytest.mark.parametrize("argv,key,text", [
    (["-tp", "2"], "tensor_parallel_size",
     "tensor_parallel_size: tandem runs a model on one device; --tensor-parallel-size (-tp) 2 is not supported "
     "(allowed: 1)"),
    (["--tensor-parallel-size", "8"], "tensor_parallel_size", "--tensor-parallel-size (-tp) 8 is not supported"),
    (["-pp", "2"], "pipeline_parallel_size",
     "pipeline_parallel_size: tandem runs a model on one device; --pipeline-parallel-size (-pp) 2 is not "
     "supported (allowed: 1)"),
    (["--quantization", "fp8"], "quantization", "quantization method 'fp8' is not supported by tandem"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype",
     "kv_cache_dtype: --kv-cache-dtype fp8 is not supported: the KV cache is stored in the model's dtype "
     "(allowed: auto)"),
    (["--swap-space", "-1"], "swap_space", "expected a number of GiB >= 0"),
])
def test_refused_flags_are_one_config_error(argv: list[str], key: str, text: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_cli(*argv)
    assert err.value.key == key and text in str(err.value)


def test_refused_parallel_sizes_list_the_allowed_value() -> None:
    with pytest.raises(ConfigError) as err:
        engine_config("m", tensor_parallel_size=2)
    assert err.value.allowed == [1]


@pytest.mark.parametrize("kwargs,key", [
    ({"tensor_parallel_size": "1"}, "tensor_parallel_size"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size"),
    ({"trust_remote_code": "yes"}, "trust_remote_code"),
    ({"swap_space": "4"}, "swap_space"),
    ({"enable_chunked_prefill": 1}, "enable_chunked_prefill"),
])
def test_bad_keyword_types_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        engine_config("m", **kwargs)
    assert err.value.key == key


def test_help_shows_the_compat_group() -> None:
    text = parser().format_help()
    for flag in ("--trust-remote-code", "--swap-space", "-tp", "--tensor-parallel-size", "-pp",
                 "--enable-chunked-prefill", "--quantization", "--kv-cache-dtype", "vLLM compatibility"):
        assert flag in text
