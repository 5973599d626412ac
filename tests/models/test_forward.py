"""The one model forward on CPU: the hidden-state hook (what EAGLE-3 heads read) equals Hugging Face's
hidden states, the runner's row selection, and the backend objects the torch runner picks."""

from __future__ import annotations

import pytest
import torch

from tiny_models import write_tiny_hf_checkpoint
from tandem.config import RunnerConfig
from tandem.engine.model_loader import build_model
from tandem.kv.kv_cache import allocate_kv_cache
from tandem.loader.checkpoint import open_checkpoint
from tandem.worker.batch import SeqChunk
from tandem.worker.runner import make_runner


def _runner(path):
    ckpt = open_checkpoint(str(path))
    model = build_model(ckpt.arch, ckpt.weights(), torch.float32, torch.device("cpu"), 128)
    kv = allocate_kv_cache(ckpt.arch, 32, 4, torch.float32, torch.device("cpu"))
    return make_runner(model, kv, 4, torch.device("cpu"), RunnerConfig())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_aux_hidden_states_equal_hf_hidden_states(tmp_path, family):
    """Hidden state entering layer i (residual stream included) == HF's ``hidden_states[i]``; the
    last row of a second chunk (decode after a prefill) too, so the KV path is exercised."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_hf_checkpoint(tmp_path, family)
    runner = _runner(path)
    n_layers = runner.model.arch.num_layers
    layers = tuple(range(n_layers))
    prompt = [5, 9, 17, 33, 40, 41, 7, 8, 99]
    blocks = list(range(8))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [11]]), output_hidden_states=True)
    out = runner.forward([SeqChunk(prompt, 0, blocks)], list(range(len(prompt))), aux_layers=layers)
    assert len(out.aux_hidden) == n_layers
    for i, h in enumerate(out.aux_hidden):
        torch.testing.assert_close(h, ref.hidden_states[i][0, : len(prompt)], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits[0, : len(prompt)], rtol=1e-4, atol=1e-4)
    step = runner.forward([SeqChunk([11], len(prompt), blocks)], [0], aux_layers=(n_layers - 1,))
    torch.testing.assert_close(step.aux_hidden[0][0], ref.hidden_states[n_layers - 1][0, -1], rtol=1e-5, atol=1e-5)


def test_torch_runner_selects_rows_and_picks_torch_backends(tmp_path):
    path = write_tiny_hf_checkpoint(tmp_path, "llama")
    runner = _runner(path)
    assert type(runner).__name__ == "TorchRunner"
    chunks = [SeqChunk([5, 9, 17], 0, [0]), SeqChunk([7, 8], 0, [1])]
    every = runner.forward(chunks, range(5), aux_layers=(1,))
    picked = runner.forward(chunks, [4, 1], aux_layers=(1,))
    # (the second run rewrites identical KV; the LM head's row count changes the GEMM path: ~1e-7)
    torch.testing.assert_close(picked.logits, every.logits[[4, 1]], rtol=1e-5, atol=1e-5)
    # aux hidden states cover every query row whatever rows are sampled (an EAGLE head reads them all)
    torch.testing.assert_close(picked.aux_hidden[0], every.aux_hidden[0], rtol=0, atol=0)
    assert picked.aux_hidden[0].shape[0] == 5
    # id num_layers: the final post-norm hidden state (EAGLE-1), whose LM-head product is the logits
    n = runner.model.arch.num_layers
    final = runner.forward(chunks, range(5), aux_layers=(n,)).aux_hidden[0]
    with torch.inference_mode():
        torch.testing.assert_close(runner.model.compute_logits(final), every.logits, rtol=1e-5, atol=1e-5)
    assert runner.forward([], []).logits.shape == (0, runner.model.arch.vocab_size)
