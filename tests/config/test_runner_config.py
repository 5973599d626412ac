"""RunnerConfig and the TANDEM_* debug overrides (config/env.py): each variable maps onto one field,
a bad value is one ConfigError naming the variable, and the overrides win over the config."""

from __future__ import annotations

import pytest

from tandem.config import RunnerConfig, SpeculativeConfig
from tandem.config.env import runner_overrides
from tandem.config.runner import with_debug_overrides
from tandem.errors import ConfigError


@pytest.mark.parametrize("env, want", [
    ({}, {}),
    ({"TANDEM_GPU_RUNNER": "0"}, {"backend": "torch"}),
    ({"TANDEM_GPU_RUNNER": "1"}, {}),
    ({"TANDEM_CUDA_GRAPHS": "off"}, {"cuda_graphs": False}),
    ({"TANDEM_FUSED": "0", "TANDEM_PDL": "no"}, {"fused": False, "pdl": False}),
    ({"TANDEM_GEMV_DEFER": "1"}, {"skinny_defer": True}),
    ({"TANDEM_CPU_SCRIPT": "0"}, {"cpu_script": False}),
    ({"TANDEM_GEMV_ROWS": "16", "TANDEM_GEMV_MULTIROW": "dot"}, {"skinny_rows": 16, "skinny_multirow": "dot"}),
    ({"TANDEM_GEMV": "0", "TANDEM_GEMV_ROWS": "16"}, {"skinny_rows": 0}),  # cuBLAS only wins
    ({"TANDEM_MAX_GRAPH_BATCH": "64", "TANDEM_KV_SPLITS": "2"}, {"max_graph_batch": 64, "kv_splits": 2}),
])
def test_each_variable_maps_to_its_field(env, want):
    assert runner_overrides(env) == want


@pytest.mark.parametrize("env, name", [({"TANDEM_PDL": "sometimes"}, "TANDEM_PDL"),
                                       ({"TANDEM_KV_SPLITS": "two"}, "TANDEM_KV_SPLITS")])
def test_bad_variable_is_one_error_naming_it(env, name):
    with pytest.raises(ConfigError) as e:
        runner_overrides(env)
    assert e.value.key == name


def test_overrides_win_and_are_validated():
    cfg = RunnerConfig(cuda_graphs=True, skinny_rows=6)
    assert with_debug_overrides(cfg, {}) is cfg
    got = with_debug_overrides(cfg, {"cuda_graphs": False, "skinny_rows": 0})
    assert got == RunnerConfig(cuda_graphs=False, skinny_rows=0)
    with pytest.raises(ConfigError, match="skinny_multirow"):
        with_debug_overrides(cfg, {"skinny_multirow": "columns"})


@pytest.mark.parametrize("field, value", [("backend", "tpu"), ("cuda_graphs", 1), ("skinny_rows", -1),
                                          ("max_graph_batch", 0), ("kv_splits", 0), ("skinny_defer", "yes"),
                                          ("cpu_script", "no")])
def test_bad_runner_config_names_the_key(field, value):
    with pytest.raises(ConfigError) as e:
        RunnerConfig(**{field: value})
    assert e.value.key == field


def test_draft_runs_eager_when_enforce_eager():
    target = RunnerConfig(cuda_graphs=True, skinny_rows=3)
    spec = SpeculativeConfig(method="draft_model", model="x", num_speculative_tokens=2, enforce_eager=True)
    assert spec.draft_runner_config(target) == RunnerConfig(cuda_graphs=False, skinny_rows=3)
    same = SpeculativeConfig(method="draft_model", model="x", num_speculative_tokens=2)
    assert same.draft_runner_config(target) is target
