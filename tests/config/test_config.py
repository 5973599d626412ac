"""Engine arguments (tandem/engine/args.py): flags and LLM(**kwargs) generated from the config fields."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig, SpeculativeConfig
from tandem.config.speculative import DEPRECATED_KWARGS
from tandem.engine import args as engine_args
from tandem.engine.args import (
    ENGINE_KWARGS,
    FLAG_CONFIGS,
    cli_type,
    engine_config,
    engine_kwargs,
    flag_fields,
    runner_config,
)
from tandem.errors import ConfigError

from cli_utils import from_cli, parser


# ---- flags are the fields ---------------------------------------------------------------------------------


def test_every_field_is_a_flag_with_the_fields_default() -> None:
    ns = parser().parse_args([])
    for cls in FLAG_CONFIGS:
        for f in flag_fields(cls):
            assert hasattr(ns, f.name), f"{cls.__name__}.{f.name} has no flag"
            assert getattr(ns, f.name) == (None if f.default is MISSING else f.default), f.name


def test_every_flag_field_has_help_and_no_help_is_stale() -> None:
    all_fields = [f for cls in FLAG_CONFIGS for f in flag_fields(cls)]
    assert [f.name for f in all_fields if not engine_args.field_help(f)] == []
    assert set(engine_args._HELP) <= {f.name for f in all_fields}


def test_no_flags_means_no_kwargs_and_the_default_config() -> None:
    assert engine_kwargs(parser().parse_args([])) == {}
    assert from_cli() == engine_config("m") == EngineConfig(ModelConfig("m"))


def test_existing_flag_spellings_still_parse() -> None:
    # Spellings that scripts and tests use (vLLM's); a rename of a config field must not drop one silently.
    argv = ["--tokenizer", "tok", "--dtype", "float32", "--device", "cpu", "--seed", "3", "--load-format", "dummy",
            "--max-model-len", "64", "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1024",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--no-async-scheduling", "--block-size", "8",
            "--no-enable-prefix-caching", "--enforce-eager", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}']
    cfg = from_cli(*argv)
    assert cfg.model == ModelConfig("m", tokenizer="tok", dtype="float32", device="cpu", seed=3, load_format="dummy",
                                    max_model_len=64)
    assert cfg.cache == CacheConfig(block_size=8, gpu_memory_utilization=0.5, kv_cache_memory_bytes=1024,
                                    enable_prefix_caching=False)
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, async_scheduling=False)
    assert cfg.runner == RunnerConfig(cuda_graphs=False)
    assert cfg.speculative == SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})


def test_runner_flags() -> None:
    cfg = from_cli("--runner-backend", "torch", "--no-fused", "--skinny-rows", "0", "--skinny-multirow", "dot",
                   "--max-graph-batch", "32", "--kv-splits", "2", "--no-pdl", "--skinny-defer")
    assert cfg.runner == RunnerConfig(backend="torch", fused=False, skinny_rows=0, skinny_multirow="dot",
                                      max_graph_batch=32, kv_splits=2, pdl=False, skinny_defer=True)
    assert from_cli("--no-cuda-graphs").runner == from_cli("--enforce-eager").runner
    assert from_cli("--no-enforce-eager").runner == RunnerConfig()


def test_cli_and_kwargs_build_the_same_config() -> None:
    got = from_cli("--max-num-seqs", "2", "--kv-splits", "4", "--enforce-eager", "--dtype", "bfloat16")
    assert got == engine_config("m", max_num_seqs=2, dtype="bfloat16", enforce_eager=True,
                                runner_config={"kv_splits": 4})


def test_help_lists_the_generated_flags_with_defaults() -> None:
    text = parser().format_help()
    for flag in ("--max-num-seqs", "--enforce-eager", "--runner-backend", "--cuda-graphs, --no-cuda-graphs",
                 "--speculative-config", "--speculative-model"):
        assert flag in text
    assert "(default: 256)" in text and "(default: on)" in text


def test_deprecated_flags_take_their_type_from_the_config_field() -> None:
    ns = parser().parse_args(["--speculative-model", "[ngram]", "--num-speculative-tokens", "3"])
    assert ns.speculative_model == "[ngram]" and ns.num_speculative_tokens == 3
    with pytest.warns(FutureWarning):
        cfg = engine_config("m", **engine_kwargs(ns))
    assert cfg.speculative is not None and cfg.speculative.num_speculative_tokens == 3


def test_cli_type() -> None:
    assert cli_type(int | None) is int and cli_type(bool | None) is bool and cli_type(float) is float
    assert cli_type(str | torch.dtype) is str


# ---- LLM(**kwargs) ----------------------------------------------------------------------------------------

VLLM_KWARGS = ("tokenizer", "dtype", "device", "seed", "load_format", "revision", "max_model_len",
               "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
               "async_scheduling", "block_size", "enable_prefix_caching", "speculative_config", "log_stats",
               "enforce_eager", "runner_config")


def test_llm_accepts_vllms_keywords() -> None:
    assert set(VLLM_KWARGS) | set(DEPRECATED_KWARGS) <= set(ENGINE_KWARGS)


def test_llm_restates_no_default() -> None:
    from tandem.engine.llm import LLM

    params = inspect.signature(LLM.__init__).parameters
    assert [p.kind for p in params.values()][-1] is inspect.Parameter.VAR_KEYWORD
    assert [n for n, p in params.items() if p.default is not inspect.Parameter.empty] == ["model"]


def test_llm_builds_its_engine_from_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.engine.llm as llm_mod

    class FakeEngine:
        def __init__(self, config: EngineConfig) -> None:
            self.config = config

    monkeypatch.setattr(llm_mod, "LLMEngine", FakeEngine)
    llm = llm_mod.LLM("m", max_num_seqs=3, enforce_eager=True, runner_config=RunnerConfig(kv_splits=2))
    assert llm.engine.config == EngineConfig(ModelConfig("m"), scheduler=SchedulerConfig(max_num_seqs=3),
                                             runner=RunnerConfig(kv_splits=2, cuda_graphs=False))
    with pytest.raises(TypeError, match="max_num_seqs"):
        llm_mod.LLM("m", max_num_seq=3)


def test_unknown_keyword_is_a_type_error_with_a_hint() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_num_seq'; did you mean 'max_num_seqs'"):
        engine_config("m", max_num_seq=3)
    with pytest.raises(TypeError, match=r"runner_config=\{'pdl'"):
        engine_config("m", pdl=False)


@pytest.mark.parametrize("kwargs,key", [
    ({"dtype": "fp17"}, "dtype"),
    ({"dtype": torch.int8}, "dtype"),
    ({"block_size": 3}, "block_size"),
    ({"gpu_memory_utilization": 2.0}, "gpu_memory_utilization"),
    ({"max_num_seqs": "8"}, "max_num_seqs"),
    ({"seed": True}, "seed"),
    ({"load_format": "onnx"}, "load_format"),
    ({"async_scheduling": "yes"}, "async_scheduling"),
    ({"log_stats": 1}, "log_stats"),
    ({"enforce_eager": "yes"}, "enforce_eager"),
    ({"runner_config": 5}, "runner_config"),
    ({"runner_config": {"kv_split": 2}}, "kv_split"),
    ({"runner_config": {"kv_splits": 0}}, "kv_splits"),
    ({"enforce_eager": True, "runner_config": {"cuda_graphs": True}}, "enforce_eager"),
    ({"enforce_eager": False, "runner_config": RunnerConfig(cuda_graphs=False)}, "enforce_eager"),
    ({"speculative_config": {"method": "ngram"}}, "num_speculative_tokens"),
])
def test_a_bad_value_is_one_config_error_naming_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        engine_config("m", **kwargs)
    assert info.value.key == key, str(info.value)


def test_runner_config_forms() -> None:
    assert runner_config(None) == RunnerConfig()
    assert runner_config({"pdl": False}) == runner_config(RunnerConfig(pdl=False)) == RunnerConfig(pdl=False)
    assert runner_config(RunnerConfig(fused=False), enforce_eager=True) == RunnerConfig(fused=False, cuda_graphs=False)
    assert runner_config({"cuda_graphs": False}, enforce_eager=True) == RunnerConfig(cuda_graphs=False)


def test_engine_kwargs_are_the_config_fields() -> None:
    top = {f.name for cls in (ModelConfig, CacheConfig, SchedulerConfig) for f in fields(cls)} - {"model"}
    assert top <= set(ENGINE_KWARGS)
    assert not {f.name for f in fields(RunnerConfig)} & set(ENGINE_KWARGS)  # those go in runner_config


# ---- commands share the flags -----------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["generate", "hi"],
    ["serve", "m"],
    ["bench", "latency"],
    ["bench", "throughput"],
])
def test_every_engine_command_has_the_engine_flags(argv: list[str]) -> None:
    from tandem.cli import build_parser

    ns = build_parser().parse_args([*argv, "--enforce-eager", "--max-num-seqs", "7", "--no-pdl"])
    assert engine_kwargs(ns) == {"max_num_seqs": 7, "runner_config": {"pdl": False}, "enforce_eager": True}


def test_readme_lists_every_engine_flag() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    names = [engine_args.flag_name(f.name) for cls in FLAG_CONFIGS for f in flag_fields(cls)]
    missing = [n for n in [*names, "--enforce-eager", "--speculative-config"] if n.removeprefix("--") not in readme]
    assert not missing, f"README.md's engine flags section lacks {missing}"


def test_batch_invariant_flag() -> None:
    assert from_cli("--batch-invariant").model == ModelConfig("m", batch_invariant=True)
    assert engine_config("m", batch_invariant=True).model.batch_invariant is True
    with pytest.raises(ConfigError, match="batch_invariant"):
        ModelConfig("m", batch_invariant="yes")  # type: ignore[arg-type]
