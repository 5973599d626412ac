"""``tandem train-draft`` end to end on a tiny target (CPU): the trained head is accepted by the
engine far more often than an untrained one, loads by path, keeps greedy output unchanged, and a
stopped run resumed from its checkpoint ends with the same weights as an uninterrupted one.

The tiny target has its attention outputs zeroed (``o_proj = 0``): its next token is then a fixed
function of the current token, which a one-layer head learns from a few thousand tokens. A fully
random target's next token depends on its context through random attention, which a head cannot
learn from the ~5k tokens a CI test can afford (measured: 3-10 % acceptance either way).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from engine_utils import make_llm
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import write_tiny_hf_checkpoint

from tandem.cli import main
from tandem.loader.checkpoint import open_checkpoint
from tandem.loader.eagle import load_eagle_head, read_eagle_config
from tandem.sampling_params import SamplingParams

WORDS = ["the", "cat", "dog", "runs", "fast", "slow", "a", "red", "blue", "sky", "is", "big", "small", "and"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    target = write_tiny_hf_checkpoint(base, "llama", std=0.5, name="target", num_hidden_layers=4)
    w = load_file(str(target / "model.safetensors"))
    save_file({k: v * 0 if "o_proj" in k else v for k, v in w.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    rng = random.Random(0)
    lines = []
    for i in range(140):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        lines.append({"prompt": text} if i % 2 else {"messages": [{"role": "user", "content": text}]})
    for i in range(20):  # conversations trained on as given (no generation), each naming its record
        said = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(2)]
        lines.append({"messages": [{"role": "user", "content": said[0]}, {"role": "assistant", "content": said[1]}],
                      "record": 1000 + i})
    data = base / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return base, target, data, lines


def _args(setup, out, *extra):
    base, target, data, _ = setup
    return ["train-draft", "--target", str(target), "--out", str(out), "--data", str(data),
            "--data-cache", str(base / "data.pt"), "--num-prompts", "120", "--val-prompts", "12",
            "--max-tokens", "32", "--draft-vocab-size", "48", "--batch-tokens", "512", "--lr", "3e-3",
            "--device", "cpu", *extra]


def _report(out):
    return json.loads((out / "training.json").read_text())


def test_trained_head_beats_untrained_and_keeps_greedy_output(setup):
    base, target, _, lines = setup
    trained, untrained = base / "trained", base / "untrained"
    assert main(_args(setup, trained, "--max-steps", "120", "--val-every", "60", "--eval-k", "3")) == 0
    assert main(_args(setup, untrained, "--max-steps", "0", "--eval-k", "3", "--norm-before-fc")) == 0
    rt, ru = _report(trained), _report(untrained)
    et, eu = rt["engine_eval"][0], ru["engine_eval"][0]
    assert et["k"] == 3 and et["num_drafts"] > 0
    assert et["acceptance_rate"] >= 0.6, et
    assert et["acceptance_rate"] >= eu["acceptance_rate"] + 0.4, (et, eu)
    assert et["mean_accepted_length"] > eu["mean_accepted_length"] + 1.0
    for e in (et, eu):  # the evaluation drafts at every step (measures the head, not the goodput policy)
        assert e["num_drafts"] * e["mean_accepted_length"] >= 0.8 * (e["output_tokens"] - 12), e
    # the unroll's validation predicts the engine's first-position acceptance
    assert abs(rt["final_validation"]["acceptance"][0] - et["per_position"][0]) < 0.15
    assert [h["step"] for h in rt["training"]["history"]] == [60, 120]
    # held-out prompts were never trained on, and the indices name lines of the prompt file
    val, train = set(rt["data"]["val_prompt_indices"]), set(rt["data"]["train_prompt_indices"])
    assert len(val) == 12 and not val & train and max(val | train) < len(lines)
    assert rt["data"]["given_conversations"] == 20 and set(range(140, 160)) <= train
    assert rt["data"]["records"] == list(range(1000, 1020)) and rt["data"]["given_tokens"] > 20 * 4
    assert "tandem train-draft" in (trained / "TRAINING.md").read_text()

    # the speculators layout: bf16 tensors, no embeddings, d2t/t2d, flags
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 48
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # vLLM's (2, 2, 1) for 4 layers, deduped
    with safe_open(str(trained / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.hidden_norm.weight"} <= names and not any("embed" in n for n in names)
    assert torch.equal(torch.nonzero(t2d).squeeze(1), torch.arange(48) + d2t)
    ecfg = read_eagle_config(trained, open_checkpoint(str(target)).arch)
    assert ecfg.kind == "eagle3" and ecfg.aux_layer_ids == (1, 2)
    load_eagle_head(ecfg, 64, torch.float32, torch.device("cpu"))
    # --norm-before-fc: the Eagle-3.1 flag and its input_norm over the aux concat, read back by the loader
    assert not cfg["norm_before_fc"] and json.loads((untrained / "config.json").read_text())["norm_before_fc"]
    with safe_open(str(untrained / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("input_norm.weight").shape == (ecfg.fc_in_features,) and "input_norm.weight" not in names
    assert read_eagle_config(untrained, open_checkpoint(str(target)).arch).norm_before_fc

    # by path, method inferred; greedy output equals no speculation on the held-out prompts
    convs = [lines[i]["messages"] if "messages" in lines[i] else [{"role": "user", "content": lines[i]["prompt"]}]
             for i in rt["data"]["val_prompt_indices"]]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    ref = [o.outputs[0].token_ids for o in make_llm(target).chat(convs, params, use_tqdm=False)]
    llm = make_llm(target, speculative_config={"model": str(trained), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)] == ref
    assert llm.engine.stats.spec.acceptance_rate >= 0.6


def test_eagle1_head_trains_exports_and_runs(setup):
    base, target, _, _ = setup
    out = base / "eagle1"
    assert main(_args(setup, out, "--method", "eagle", "--max-steps", "4", "--eval-k", "2")) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert "speculators_model_type" not in cfg and cfg["num_hidden_layers"] == 1
    ecfg = read_eagle_config(out, open_checkpoint(str(target)).arch)
    assert ecfg.kind == "eagle" and ecfg.fc_bias and not ecfg.has_lm_head
    assert _report(out)["engine_eval"][0]["num_drafts"] > 0


def test_resume_continues_to_the_same_weights(setup):
    base = setup[0]
    common = ("--max-steps", "6", "--eval-k", "", "--checkpoint-every", "2", "--ttt-steps", "3")
    assert main(_args(setup, base / "straight", *common)) == 0
    assert main(_args(setup, base / "split", *common, "--stop-at-step", "3")) == 0
    half = torch.load(base / "split" / "checkpoint" / "train_state.pt", weights_only=False)
    assert half["state"]["step"] == 3
    assert main(_args(setup, base / "split", *common, "--resume")) == 0
    a = torch.load(base / "straight" / "checkpoint" / "train_state.pt", weights_only=False)
    b = torch.load(base / "split" / "checkpoint" / "train_state.pt", weights_only=False)
    assert a["state"]["step"] == b["state"]["step"] == 6
    assert not torch.equal(half["head"]["fc.weight"], a["head"]["fc.weight"])  # it did train on
    for name, t in a["head"].items():
        assert torch.equal(t, b["head"][name]), name
    assert _report(base / "split")["training"]["steps"] == 6


def test_time_budget_stops_training_and_still_saves(setup):
    base = setup[0]
    out = base / "budget"
    assert main(_args(setup, out, "--epochs", "5000", "--time-budget-s", "6", "--eval-reserve-s", "0",
                      "--eval-k", "", "--ttt-steps", "2")) == 0
    training = _report(out)["training"]
    assert training["stopped"] == "time budget" and 0 < training["steps"] < 100000
    assert training["planned_steps"] < 100000  # the schedule was fitted to the budget
    assert (out / "model.safetensors").is_file()


def test_max_steps_schedule_survives_a_budget_stop_and_resumes(setup):
    """--max-steps fixes the schedule: a budget stop keeps it, and --resume goes on with it."""
    base = setup[0]
    out = base / "budget_fixed"
    common = ("--max-steps", "100000", "--eval-reserve-s", "0", "--eval-k", "", "--ttt-steps", "2")
    assert main(_args(setup, out, *common, "--time-budget-s", "4")) == 0
    first = _report(out)["training"]
    assert first["stopped"] == "time budget" and first["planned_steps"] == 100000
    assert main(_args(setup, out, *common, "--time-budget-s", "3", "--resume")) == 0
    second = _report(out)["training"]
    assert second["planned_steps"] == 100000 and second["steps"] > first["steps"]


def test_bad_input_is_a_clear_error(setup, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"text": 3}\n')
    args = _args(setup, tmp_path / "o", "--eval-k", "")
    args[args.index("--data") + 1] = str(bad)
    args[args.index("--data-cache") + 1] = str(tmp_path / "c.pt")
    assert main(args) == 2
    assert "data" in capsys.readouterr().err
    assert main(_args(setup, tmp_path / "o", "--ttt-steps", "0")) == 2
    assert "ttt_steps" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_path_trains_and_the_engine_accepts(setup):
    """The CUDA path (bf16 autocast, fused AdamW, the engines on the GPU) on the tiny target."""
    base = setup[0]
    out = base / "cuda"
    assert main([*_args(setup, out, "--max-steps", "120", "--eval-k", "3"), "--device", "cuda"]) == 0
    ev = _report(out)["engine_eval"][0]
    assert ev["acceptance_rate"] >= 0.6, ev


def test_init_head_starts_from_a_trained_head(setup, tmp_path, capsys):
    """--init-head: the head keeps the given head's shape, draft vocabulary and weights (0 steps:
    the same head back), and training on from it keeps its acceptance."""
    base, target, _, _ = setup
    start, same, more = base / "init_start", base / "init_same", base / "init_more"
    assert main(_args(setup, start, "--max-steps", "60", "--eval-k", "3", "--num-heads", "2",
                      "--norm-before-fc")) == 0
    assert main(_args(setup, same, "--init-head", str(start), "--max-steps", "0", "--eval-k", "3",
                      "--draft-vocab-size", "40")) == 0
    for name in ("fc.weight", "lm_head.weight", "d2t", "input_norm.weight", "layers.0.self_attn.q_proj.weight"):
        with safe_open(str(start / "model.safetensors"), framework="pt") as a, \
                safe_open(str(same / "model.safetensors"), framework="pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    cfg_a, cfg_b = (json.loads((d / "config.json").read_text()) for d in (start, same))
    assert cfg_b["draft_vocab_size"] == 48 and cfg_b["norm_before_fc"]
    assert cfg_b["transformer_layer_config"]["num_attention_heads"] == 2 == cfg_a["transformer_layer_config"]["num_attention_heads"]
    e0, e1 = _report(start)["engine_eval"][0], _report(same)["engine_eval"][0]
    assert e1["per_position"] == e0["per_position"]
    # what the head started from was trained on counts as used (held-out benchmarks skip its records)
    info = _report(start)
    own = set(info["data"]["records"])
    assert own  # (the given conversations name theirs)
    info["data"]["records"] = [7, 8]  # as if it had been trained on other records
    (start / "training.json").write_text(json.dumps(info))
    assert main(_args(setup, more, "--init-head", str(start), "--max-steps", "30", "--eval-k", "3")) == 0
    assert _report(more)["engine_eval"][0]["acceptance_rate"] >= e0["acceptance_rate"] - 0.1
    assert _report(more)["config"]["init_head"] == str(start)
    assert set(_report(more)["data"]["records"]) == own | {7, 8}
    assert _report(more)["data"]["init_head"]["num_records"] == 2
    assert f"Started from `{start}`" in (more / "TRAINING.md").read_text()
    # bad combinations are one clear error naming the key
    assert main(_args(setup, tmp_path / "x", "--init-head", str(start), "--num-heads", "4")) == 2
    assert "num_heads" in capsys.readouterr().err
    assert main(_args(setup, tmp_path / "y", "--init-head", str(start), "--method", "eagle")) == 2
    err = capsys.readouterr().err
    assert "init_head" in err and "eagle3" in err, err
