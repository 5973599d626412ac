"""``tandem bench sweep``: the workload table (methods x workloads x concurrency) offline on a tiny
checkpoint, its rows / speedups / table / plot, the method configs, and the task datasets (edit,
repeated_task)."""

from __future__ import annotations

import json
import sys

import pytest
from tiny_models import write_tiny_hf_checkpoint

from tandem.bench.datasets import sample_requests
from tandem.bench.sweep import method_presets, parse_config, parse_int_list
from tandem.bench.sweep_spec import CellResult
from tandem.bench.sweep_output import format_table, speedup_rows, write_plot
from tandem.bench.tasks import load_humaneval_functions
from tandem.cli import main
from tandem.errors import ConfigError

ENGINE = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--block-size", "4"]


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]


def _cell(method: str, workload: str, conc: int, tput: float, tpot: float,
          runs: tuple[float, ...] = ()) -> CellResult:
    return CellResult(workload, conc, method, 4, 100, 1.0, tput, tpot, tpot, 10.0,
                      None if method == "base" else 0.5, None if method == "base" else 2.0,
                      None if method == "base" else 0.25, run_throughputs=runs)


def test_rows_speedups_and_table():
    cells = [_cell("base", "code", 1, 100, 10), _cell("base", "code", 8, 400, 20),
             _cell("ngram", "code", 1, 150, 6), _cell("ngram", "code", 8, 380, 21)]
    rows = speedup_rows(cells, "base")
    by = {(r["method"], r["concurrency"]): r for r in rows}
    assert by[("base", 1)]["speedup"] == 1.0
    assert by[("ngram", 1)]["speedup"] == pytest.approx(1.5)
    assert by[("ngram", 1)]["tpot_speedup"] == pytest.approx(10 / 6)
    assert by[("ngram", 8)]["speedup"] == pytest.approx(0.95)
    table = format_table(rows, ["code"], [1, 8], ["base", "ngram"])
    assert "| code | 1.50× / 1.67× | **0.95×** / 0.95× |" in table  # throughput below 0.98: bold
    assert "| code | 1 | ngram | 6.00 | 6.00 | 150.0 | 1.500× | 0.50 | 2.00 | 25% |" in table
    # several timed runs: each run's ratio to the baseline's run beside it, their range in the table
    cells = [_cell("base", "code", 1, 100, 10, (100, 80, 90)), _cell("ngram", "code", 1, 150, 6, (130, 120, 150))]
    rows = speedup_rows(cells, "base")
    assert rows[0]["run_speedups"] is None and rows[1]["run_speedups"] == pytest.approx([1.3, 1.5, 150 / 90])
    table = format_table(rows, ["code"], [1], ["base", "ngram"])
    assert "| 150.0 | 1.500× (1.30–1.67) |" in table and "| 100.0 | 1.000× |" in table
    assert rows[1]["median_run_speedup"] == pytest.approx(1.5) and rows[0]["median_run_speedup"] is None
    assert "| code | 1.50× (median 1.50×) / 1.67× |" in table  # three runs or more: their median too
    uneven = speedup_rows([cells[0], _cell("ngram", "code", 1, 150, 6, (150,))], "base")
    assert uneven[1]["run_speedups"] is None


def test_plot_written_or_skipped(tmp_path, monkeypatch):
    rows = speedup_rows([_cell("base", "code", 1, 100, 10), _cell("ngram", "code", 1, 150, 6)], "base")
    path = write_plot(rows, ["code"], tmp_path / "p.png")
    assert path is not None and path.stat().st_size > 1000
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert write_plot(rows, ["code"], tmp_path / "q.png") is None and not (tmp_path / "q.png").exists()


def test_methods_and_configs(tmp_path):
    ms = method_presets(["baseline", "ngram", "suffix"], 3, "on")
    assert ms[0].speculative_config is None
    assert ms[1].speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "disable_by_acceptance": True}
    assert ms[2].speculative_config == {"method": "suffix", "disable_by_acceptance": True}
    assert method_presets(["ngram"], 4, "default")[0].speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(ConfigError) as e:
        method_presets(["eagle"], 4, "on")
    assert e.value.key == "--methods"
    m = parse_config('{"name": "ng2", "method": "ngram", "num_speculative_tokens": 2}', "off")
    assert m.name == "ng2" and m.speculative_config == {"method": "ngram", "num_speculative_tokens": 2,
                                                        "disable_by_acceptance": False}
    f = tmp_path / "c.json"
    f.write_text('{"name": "plain", "speculative_config": null}')
    assert parse_config(str(f), "on").speculative_config is None
    for bad, key in (('{"method": "ngram"}', "--config"), ("nope", "--config"),
                     ('{"name": "x", "method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "bogus")):
        with pytest.raises(ConfigError) as e:
            parse_config(bad, "on")
        assert e.value.key == key
    assert parse_int_list("--concurrency", "1,8") == [1, 8]
    with pytest.raises(ConfigError):
        parse_int_list("--concurrency", "0,2")


def test_repeated_task_dataset_asks_tasks_again_with_small_changes():
    tok = WordTokenizer()
    reqs = sample_requests("repeated-task", tok, 9, seed=3, repeats=3, output_len=64)
    assert len(reqs) == 9 and all(r.expected_output_len == 64 for r in reqs)
    assert reqs == sample_requests("repeated_task", tok, 9, seed=3, repeats=3, output_len=64)  # deterministic
    funcs = dict(load_humaneval_functions())
    for task in range(3):  # rounds: tasks 0,1,2 then again 0,1,2 (renamed, reworded) ...
        first, again = reqs[task].prompt, reqs[task + 3].prompt
        name = next(n for n in funcs if f"def {n}(" in first)
        assert f"def {name}_v1(" in again and first != again
        shared = sum(1 for a, b in zip(first.splitlines(), again.splitlines()) if a == b)
        assert shared >= len(first.splitlines()) // 2  # a small change, not a new task
    edit = sample_requests("edit", tok, 2, seed=0)
    assert edit[0].prompt.startswith("Rewrite this function") and "```python\ndef " in edit[0].prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("bench_sweep"), "llama", std=0.2)


def test_sweep_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "res"
    rc = main(["bench", "sweep", "--model", str(model_dir), *ENGINE, "--workloads", "code,repeated",
               "--concurrency", "1,2", "--methods", "baseline,ngram", "--policy", "on", "--num-prompts", "2",
               "--output-len", "6", "--num-speculative-tokens", "3", "--warmup", "1", "--result-dir", str(out),
               "--config", '{"name": "ngram_every_step", "method": "ngram", "num_speculative_tokens": 3, '
                           '"disable_by_acceptance": false}'])
    assert rc == 0
    text = capsys.readouterr().out
    assert "speedup of ngram over baseline" in text and "speedup of ngram_every_step over baseline" in text
    data = json.loads((out / "sweep.json").read_text())
    rows = data["rows"]
    assert len(rows) == 3 * 2 * 2
    assert {(r["method"], r["workload"], r["concurrency"]) for r in rows} == {
        (m, w, c) for m in ("baseline", "ngram", "ngram_every_step") for w in ("code", "repeated") for c in (1, 2)}
    for r in rows:
        assert r["output_tokens"] == 2 * 6 and r["num_errors"] == 0 and r["output_throughput"] > 0
        assert r["mean_tpot_ms"] > 0 and r["speedup"] > 0
        if r["method"] == "baseline":
            assert r["speedup"] == 1.0 and r["acceptance_rate"] is None and r["drafting_share"] is None
        elif r["method"] == "ngram":
            assert r["drafting_share"] is not None  # the policy decided
        else:
            assert r["drafting_share"] is None and r["acceptance_rate"] is not None  # drafts every step
    assert data["meta"]["methods"]["ngram"]["disable_by_acceptance"] is True and data["meta"]["interleave"]
    assert data["meta"]["temperatures"] == {"code": 0.0, "repeated": 0.0}
    assert (out / "sweep.png").stat().st_size > 1000
    # one engine at a time: the same rows
    rc = main(["bench", "sweep", "--model", str(model_dir), *ENGINE, "--workloads", "code", "--concurrency", "1",
               "--methods", "baseline,ngram", "--no-interleave", "--num-prompts", "1", "--output-len", "4",
               "--result-dir", str(out / "seq")])
    data = json.loads((out / "seq" / "sweep.json").read_text())
    assert rc == 0 and not data["meta"]["interleave"]
    assert [(r["method"], r["output_tokens"]) for r in data["rows"]] == [("baseline", 4), ("ngram", 4)]


def _serve(llm, name: str):  # a real tandem server on a free port, in a thread
    import socket
    import threading
    import time

    import uvicorn

    from tandem.server.api import build_app
    from tandem.server.async_engine import AsyncEngine

    ae = AsyncEngine(llm.engine, name)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(ae, [name], None), log_level="critical"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, ae


def test_sweep_against_running_servers(model_dir, tmp_path, capsys):
    from engine_utils import make_llm

    servers = []
    try:
        for name, spec in (("base", None), ("ng", {"method": "ngram", "num_speculative_tokens": 3,
                                                   "disable_by_acceptance": True})):
            servers.append((name, *_serve(make_llm(model_dir, speculative_config=spec), name)))
        out = tmp_path / "srv"
        rc = main(["bench", "sweep", "--workloads", "code,edit", "--concurrency", "1,2", "--num-prompts", "2",
                   "--output-len", "5", "--tokenizer", str(model_dir), "--result-dir", str(out),
                   "--max-prompt-len", "200",
                   *[a for name, url, _, _ in servers for a in ("--server", f"{name}={url}")]])
        assert rc == 0
        rows = json.loads((out / "sweep.json").read_text())["rows"]
        assert {(r["method"], r["workload"], r["concurrency"]) for r in rows} == {
            (m, w, c) for m in ("base", "ng") for w in ("code", "edit") for c in (1, 2)}
        assert all(r["output_tokens"] == 10 and r["num_errors"] == 0 for r in rows)
        assert all(r["speedup"] == 1.0 for r in rows if r["method"] == "base")
        assert "speedup of ng over base" in capsys.readouterr().out
    finally:
        for _, _, server, ae in servers:
            server.should_exit = True
            ae.shutdown()


def test_each_timed_run_starts_with_fresh_speculation(model_dir):
    """Best-of-N runs repeat the same prompts: the suffix proposer's global cache (and the policy)
    must start empty each run, or the second run would draft the first run's answers."""
    from tandem import LLM
    from tandem.bench import sweep
    from tandem.bench.sweep_spec import WORKLOADS

    llm = LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20,
              speculative_config={"method": "suffix", "num_speculative_tokens": 3, "disable_by_acceptance": False})
    eng = llm.engine
    seen: list[int] = []
    drive = sweep.drive

    def spy(engine, prompts, params, concurrency):
        if len(prompts) == 2:  # the timed runs (the warm-up sends its own batch)
            seen.append(len(engine.proposer.proposer.global_tree))
        return drive(engine, prompts, params, concurrency)

    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    orig, sweep.drive = sweep.drive, spy
    try:
        cell = sweep.run_cell(eng, WORKLOADS["code"], "suffix", prompts, 1, 8, runs=3, warmup=0)
    finally:
        sweep.drive = orig
    assert seen == [0, 0, 0] and cell.output_tokens == 16


def test_each_timed_run_keeps_the_policys_step_costs_only(model_dir):
    """A run starts with a fresh policy (acceptance, guard) but the step-cost model it measured
    before: step costs are the machine's, not the run's."""
    from tandem import LLM
    from tandem.bench import sweep
    from tandem.bench.sweep_spec import WORKLOADS

    llm = LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_acceptance": True})
    eng = llm.engine
    seen: list[tuple[object, object, object]] = []  # the objects themselves: ids of freed ones recur
    drive = sweep.drive

    def spy(engine, prompts, params, concurrency):
        if len(prompts) == 2:
            p = engine.policy
            seen.append((p, p.cost, p.acceptance))
        return drive(engine, prompts, params, concurrency)

    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    orig, sweep.drive = sweep.drive, spy
    try:
        sweep.run_cell(eng, WORKLOADS["code"], "ngram", prompts, 1, 8, runs=3, warmup=1)
    finally:
        sweep.drive = orig
    assert len({id(s[0]) for s in seen}) == 3 and len({id(s[2]) for s in seen}) == 3  # fresh policies
    assert len({id(s[1]) for s in seen}) == 1 and (seen[0][1].decode_seconds(1) or 0) > 0  # one, measured


def test_timed_runs_alternate_between_methods(model_dir):
    """A cell's timed runs go A B A B (not A A B B): drift of the machine weighs on both alike."""
    from tandem import LLM
    from tandem.bench import sweep
    from tandem.bench.sweep_spec import WORKLOADS

    kw = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20)
    a = LLM(str(model_dir), **kw).engine
    b = LLM(str(model_dir), **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3}).engine
    order: list[str] = []
    drive = sweep.drive

    def spy(engine, prompts, params, concurrency):
        if len(prompts) == 3:  # timed runs only (the warm-up sends min(concurrency, 8) = 2)
            order.append("a" if engine is a else "b")
        return drive(engine, prompts, params, concurrency)

    orig, sweep.drive = sweep.drive, spy
    try:
        cells = sweep.run_cells([a, b], WORKLOADS["code"], ["base", "ngram"],
                                [[5, 6, 7] * 4, [8, 9] * 5, [4, 3] * 6], 2, 6, runs=2, warmup=1)
    finally:
        sweep.drive = orig
    assert order == ["a", "b", "a", "b"]
    assert [c.method for c in cells] == ["base", "ngram"] and all(c.output_tokens == 18 for c in cells)
    assert all(len(c.run_throughputs) == 2 and c.output_throughput == max(c.run_throughputs) for c in cells)


def test_a_cell_reports_how_often_chained_drafts_held(model_dir):
    """An asynchronous n-gram engine chains its verifies: the cell says which share of the drafts
    proposed ahead rested on an assumption that held; an engine that never chains says None."""
    from tandem import LLM
    from tandem.bench import sweep
    from tandem.bench.sweep_spec import WORKLOADS

    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_acceptance": False}
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20, speculative_config=spec)
    chained, plain = LLM(str(model_dir), **kw, async_scheduling=True).engine, LLM(str(model_dir), **kw).engine
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]
    cells = sweep.run_cells([chained, plain], WORKLOADS["code"], ["chained", "sync"], prompts, 2, 24, runs=1,
                            warmup=0)
    spec_stats = chained.stats.spec
    assert spec_stats.num_assumed_held + spec_stats.num_assumed_failed > 0
    assert cells[0].assumptions_held is not None and 0.0 <= cells[0].assumptions_held <= 1.0
    assert cells[1].assumptions_held is None


def test_interleaved_engines_share_the_gpus_memory(monkeypatch):
    """Every engine of an interleaved sweep lives in one process: with ``gpu_memory_utilization``
    alone the first engine's KV cache took the whole share and the second found none (on an H100:
    "KV cache of 0.0 KiB (gpu_memory_utilization) holds 0 blocks"). Each engine now fills the process
    up to its part of the share; an explicit ``kv_cache_memory_bytes`` is each engine's."""
    import torch

    from tandem.bench.sweep import shared_memory
    from tandem.kv.kv_cache import kv_budget_bytes

    total, weights = 80 << 30, 300 << 20
    used = [0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - used[0], total))

    def build(kws: list[dict]) -> list[int]:  # engines built one after another, as the sweep does
        used[0] = 0
        budgets = []
        for kw in kws:
            used[0] += weights
            budget, _ = kv_budget_bytes(torch.device("cuda"), kw.get("gpu_memory_utilization", 0.92), None)
            used[0] += budget
            budgets.append(budget)
        return budgets

    assert build([{}, {}, {}])[1:] == [0, 0]  # each engine alone: the first takes everything
    budgets = build([shared_memory({}, i, 3) for i in range(3)])
    for b in budgets:
        assert b == pytest.approx(0.92 * total / 3 - weights, rel=1e-6)
    assert used[0] <= 0.92 * total
    assert build([shared_memory({"gpu_memory_utilization": 0.5}, i, 2) for i in range(2)]) == [
        pytest.approx(0.25 * total - weights, rel=1e-6)] * 2
    assert shared_memory({"kv_cache_memory_bytes": 1 << 30}, 1, 3) == {"kv_cache_memory_bytes": 1 << 30}
    assert shared_memory({}, 0, 1) == {}
