"""``train-draft --gen-procs N``: prompts answered by N spawned engines give the same data as one
engine (greedy, and sampled: a sampled answer's seed follows its prompt, not its process)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_hf_checkpoint

from tandem.errors import ConfigError
from tandem.train.config import TrainConfig
from tandem.train.data import GenerationEngines, answer_all
from tandem.train.device import engine_kwargs


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_two_processes_answer_as_one_engine_does(tmp_path, temperature):
    target = str(write_tiny_hf_checkpoint(tmp_path, "llama", std=0.5, name="target"))
    cfg = TrainConfig(target=target, out=str(tmp_path / "out"), max_tokens=10, temperature=temperature, seed=3)
    prompts = [[1 + (7 * i + 3 * j) % 60 for j in range(2 + i % 6)] for i in range(7)]
    kwargs = engine_kwargs(torch.device("cpu"), 32)
    one = answer_all(GenerationEngines(target, kwargs, 1), prompts, cfg)
    two = answer_all(GenerationEngines(target, kwargs, 2), prompts, cfg)
    assert all(s is not None for s in one)
    for a, b, p in zip(one, two, prompts):
        assert b is not None and b.prompt_len == len(p) == a.prompt_len
        assert b.tokens.tolist() == a.tokens.tolist()
    if temperature:  # the seeds differ per prompt: sampled answers to different prompts are not all alike
        assert len({tuple(s.generated.tolist()) for s in one}) > 1  # type: ignore[union-attr]


def test_gen_procs_must_be_positive():
    with pytest.raises(ConfigError, match="gen_procs"):
        TrainConfig(target="t", out="o", gen_procs=0)
