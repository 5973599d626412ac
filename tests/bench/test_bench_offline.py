"""``tandem bench latency`` / ``tandem bench throughput``: vLLM's printed lines and JSON fields, on a
tiny random checkpoint (seconds, CPU)."""

from __future__ import annotations

import json

import pytest
from tiny_models import write_tiny_hf_checkpoint

from tandem.bench.offline import dummy_prompts, latency_result, spec_summary
from tandem.cli import main
from tandem.engine.stats import SpecStats

ENGINE = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20),
          "--block-size", "4"]
# drafting every step (the goodput policy, on by default, may skip it on this tiny model)
NGRAM = ["--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "disable_by_acceptance": false}']


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # std 0.2: peaked, repetitive greedy output, so the n-gram proposer finds matches.
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("bench_offline"), "llama", std=0.2)


def test_latency_json_and_report(model_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", str(model_dir), *ENGINE, "--input-len", "8",
               "--output-len", "6", "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "3",
               "--output-json", str(out), "--disable-tqdm"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Avg latency: " in text and "99% percentile latency: " in text
    data = json.loads(out.read_text())
    assert len(data["latencies"]) == 3 and all(x > 0 for x in data["latencies"])
    assert data["avg_latency"] == pytest.approx(sum(data["latencies"]) / 3)
    assert list(data["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(data["latencies"]) <= data["percentiles"]["50"] <= max(data["latencies"])
    assert data["spec_decode"] is None and data["speculative_config"] is None


def test_latency_with_ngram_reports_speculation(model_dir, tmp_path, capsys):
    out = tmp_path / "latency_ngram.json"
    rc = main(["bench", "latency", "--model", str(model_dir), *ENGINE, *NGRAM, "--temperature", "0",
               "--input-len", "16", "--output-len", "24", "--batch-size", "2", "--num-iters-warmup", "0",
               "--num-iters", "2", "--output-json", str(out), "--disable-tqdm"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["speculative_config"]["method"] == "ngram"
    spec = data["spec_decode"]
    assert spec is not None and spec["num_drafts"] > 0
    assert 1.0 <= spec["mean_acceptance_length"] <= 4.0
    assert len(spec["per_position_acceptance_rates"]) <= 3
    assert "Mean acceptance length (tau)" in capsys.readouterr().out


def test_throughput_random_json(model_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    rc = main(["bench", "throughput", "--model", str(model_dir), *ENGINE, "--dataset-name", "random",
               "--input-len", "10", "--output-len", "5", "--num-prompts", "4", "--output-json", str(out),
               "--disable-tqdm"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Throughput: " in text and "requests/s" in text and "output tokens/s" in text
    data = json.loads(out.read_text())
    for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"):
        assert key in data
    assert data["num_requests"] == 4
    assert data["total_output_tokens"] == 4 * 5  # ignore_eos: exactly --output-len each
    # Random prompts are exactly --input-len tokens with the tokenizer's special tokens (none here).
    assert data["total_prompt_tokens"] == 4 * 10
    assert data["total_num_tokens"] == data["total_prompt_tokens"] + data["total_output_tokens"]
    assert data["requests_per_second"] == pytest.approx(4 / data["elapsed_time"])
    assert data["tokens_per_second"] == pytest.approx(data["total_num_tokens"] / data["elapsed_time"])


def test_disable_detokenize_reaches_the_requests(model_dir, tmp_path):
    import argparse

    from tandem.bench.offline import _sampling_params

    args = argparse.Namespace(n=1, temperature=0.0, top_p=1.0, disable_detokenize=True)
    assert _sampling_params(args, 5).detokenize is False
    assert _sampling_params(argparse.Namespace(**{**vars(args), "disable_detokenize": False}), 5).detokenize
    out = tmp_path / "throughput_notext.json"
    assert main(["bench", "throughput", "--model", str(model_dir), *ENGINE, "--dataset-name", "random",
                 "--input-len", "10", "--output-len", "5", "--num-prompts", "4", "--output-json", str(out),
                 "--disable-tqdm", "--disable-detokenize"]) == 0
    assert json.loads(out.read_text())["total_output_tokens"] == 4 * 5


def test_throughput_ngram_spec_stats(model_dir, tmp_path, capsys):
    out = tmp_path / "throughput_ngram.json"
    rc = main(["bench", "throughput", "--model", str(model_dir), *ENGINE, *NGRAM, "--temperature", "0",
               "--dataset-name", "random", "--input-len", "12", "--output-len", "24", "--num-prompts", "3",
               "--output-json", str(out), "--disable-tqdm"])
    assert rc == 0
    data = json.loads(out.read_text())
    spec = data["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert "Per-position acceptance rate" in capsys.readouterr().out


def test_bad_flag_is_a_clean_error(model_dir, capsys):
    rc = main(["bench", "latency", "--model", str(model_dir), *ENGINE, "--batch-size", "0"])
    assert rc == 2
    assert "--batch-size" in capsys.readouterr().err


def test_helpers():
    prompts = dummy_prompts(2, 5, vocab_size=50, seed=0)
    assert [len(p["prompt_token_ids"]) for p in prompts] == [5, 5]
    assert all(0 <= t < 50 for p in prompts for t in p["prompt_token_ids"])
    assert prompts == dummy_prompts(2, 5, vocab_size=50, seed=0)
    res = latency_result([1.0, 2.0, 3.0])
    assert res["avg_latency"] == 2.0 and res["percentiles"]["50"] == 2.0
    before, after = SpecStats(), SpecStats()
    assert spec_summary(before, after) is None
    before.record(2, 1)
    after.record(2, 1)
    after.record(3, 3)
    after.record(3, 0)
    s = spec_summary(before, after)
    assert s["num_drafts"] == 2 and s["num_draft_tokens"] == 6 and s["num_accepted_tokens"] == 3
    assert s["per_position_acceptance_rates"] == [0.5, 0.5, 0.5]
    assert s["mean_acceptance_length"] == 2.5


def test_dataset_length_flags_route_to_each_loader():
    import argparse

    from tandem.bench.offline import _dataset_options

    base = {"dataset_path": None, "input_len": None, "output_len": None, "random_input_len": 1024,
            "random_output_len": 128, "random_range_ratio": 0.0, "random_prefix_len": 0,
            "prefix_repetition_prefix_len": 256, "prefix_repetition_suffix_len": 256,
            "prefix_repetition_num_prefixes": 10}
    ns = argparse.Namespace(dataset_name="random", **{**base, "input_len": 32, "output_len": 7})
    assert _dataset_options(ns)["input_len"] == 32 and _dataset_options(ns)["output_len"] == 7
    ns = argparse.Namespace(dataset_name="humaneval", **base)
    assert _dataset_options(ns)["output_len"] == 128
    ns = argparse.Namespace(dataset_name="sharegpt", **{**base, "output_len": 9})
    assert _dataset_options(ns)["output_len"] == 9
    ns = argparse.Namespace(dataset_name="sharegpt", **base)
    assert _dataset_options(ns)["output_len"] is None  # the reply's own length
