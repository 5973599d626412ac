"""Helpers for CUDA tests: relative error, tiny dummy-weight models on the GPU, token sequences."""

from __future__ import annotations

import random

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tiny_model(family: str = "llama", dtype: torch.dtype = torch.bfloat16, **kw):
    from tandem.engine.model_loader import build_model
    from tandem.loader.arch import ModelArch
    from tandem.loader.dummy import dummy_weights
    from tandem.loader.checkpoint import expected_parameter_shapes

    arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    cfg = dict(architectures=[arch_name], model_type=family, vocab_size=512, hidden_size=256,
               intermediate_size=512, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
               head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
               tie_word_embeddings=False)
    cfg.update(kw)
    arch = ModelArch.from_hf(cfg)
    dev = torch.device("cuda")
    w = dummy_weights(expected_parameter_shapes(arch), family=arch.family, seed=0, std=0.05)
    return build_model(arch, w, dtype, dev, 512)


class Seqs:
    """Sequences of random tokens, 20 KV blocks each, for runner tests: ``step(plan)`` gives one step's
    chunks and flat rows for ``plan`` = [(sequence, new tokens)], ``advance(plan)`` marks them computed."""

    def __init__(self, seed: int, lens: tuple[int, ...]) -> None:
        self.rng = random.Random(seed)
        self.blocks = [list(range(i * 20, i * 20 + 20)) for i in range(len(lens))]
        self.toks = [[self.rng.randrange(3, 512) for _ in range(n)] for n in lens]
        self.done = [0] * len(lens)

    def step(self, plan: list[tuple[int, int]]) -> tuple[list, list[int]]:
        from tandem.worker.batch import SeqChunk

        chunks, rows, t = [], [], 0
        for i, n in plan:
            while len(self.toks[i]) < self.done[i] + n:
                self.toks[i].append(self.rng.randrange(3, 512))
            chunks.append(SeqChunk(self.toks[i][self.done[i]:self.done[i] + n], self.done[i], self.blocks[i]))
            rows.extend(range(t, t + n))
            t += n
        return chunks, rows

    def advance(self, plan: list[tuple[int, int]]) -> None:
        for i, n in plan:
            self.done[i] += n
