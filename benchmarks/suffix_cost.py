"""Host cost of the suffix proposer: the depth-capped trie it had (git ``--old-ref``) vs the suffix
automaton it has now (``tandem/spec_decode/suffix.py`` + ``suffix_index.py``), side by side.

Tokens: tandem's own Python source at ``--old-ref`` (fixed, whatever the working tree holds), split into words / punctuation / line breaks with indentation
and numbered in order of appearance (~200k tokens, code-like statistics, no tokenizer needed).
Workload (seeded): prompts are windows of 300-700 tokens from the last 40 % of the corpus, a
request's "true" output is the 256 tokens that follow its window, and the global cache holds
``--cached`` finished outputs (windows of 256 tokens from the first 60 %) before anything is
timed. A decode step appends to each request the tokens greedy verification would accept (its
drafts while they match the truth, + 1) and asks for k = 4 drafts; the steady-state rows time those
calls (index update + proposal) per request per step (batch 1: 8 requests, one after the other).

Rows: per-token maintenance (a finished output into the full cache, eviction of the oldest
included; a request's index after its prompt, one token at a time), a request's first proposal
(index over the whole prompt + proposal), the steady state at batch 1 and batch 64 (the host time of
a batch-64 decode step adds half a finished output, the rate above), and the structure sizes (trie
nodes vs automaton states). Run: ``python benchmarks/suffix_cost.py [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import io
import random
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from tandem.spec_decode import suffix as new_suffix

ROOT = Path(__file__).resolve().parents[1]
OLD_REF = "f201628"  # the last commit with the suffix trie
K = 4


def corpus(ref: str) -> list[int]:
    """tandem's Python source at ``ref`` (the working tree if git cannot give it), as token ids."""
    texts: list[str] = []
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "tandem"], check=True,
                             capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            for member in sorted(tf.getmembers(), key=lambda m: m.name):
                if member.name.endswith(".py"):
                    f = tf.extractfile(member)
                    assert f is not None
                    texts.append(f.read().decode("utf-8"))
    except (OSError, subprocess.CalledProcessError):
        texts = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "tandem").rglob("*.py"))]
    vocab: dict[str, int] = {}
    out: list[int] = []
    for text in texts:
        for word in re.findall(r"\w+|[^\w\s]|\n[ \t]*", text):
            out.append(vocab.setdefault(word, len(vocab)))
    return out


def load_old(ref: str) -> ModuleType | None:
    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:tandem/spec_decode/suffix.py"],
                             check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"old implementation not available ({exc}); new only")
        return None
    path = Path(tempfile.mkdtemp()) / "suffix_trie_old.py"
    path.write_text(src, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("suffix_trie_old", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


class Workload:
    """Cached outputs come from the first 60 % of the corpus, requests from the rest: what a request
    finds in the cache is the code's own repetition (boilerplate, idioms), not its own text."""

    def __init__(self, toks: list[int], seed: int, cached: int, requests: int) -> None:
        rng = random.Random(seed)
        split = len(toks) * 6 // 10
        self.outputs = []
        for _ in range(cached + 200):
            s = rng.randrange(split - 256)
            self.outputs.append(toks[s : s + 256])
        self.prompts, self.truths = [], []
        for _ in range(requests):
            n, s = rng.randint(300, 700), rng.randrange(split, len(toks) - 1000)
            self.prompts.append(toks[s : s + n])
            self.truths.append(toks[s + n : s + n + 256])
        self.cached = cached


def fill(mod: ModuleType, w: Workload) -> tuple[Any, float]:
    """A proposer whose cache is full; µs per token of the last 200 outputs (insert + evict)."""
    p = mod.SuffixProposer(K, max_cached_requests=w.cached)
    for i, out in enumerate(w.outputs[: w.cached]):
        p.forget(f"c{i}", out)
    t0 = time.perf_counter()
    tail = w.outputs[w.cached :]
    for i, out in enumerate(tail):
        p.forget(f"c{w.cached + i}", out)
    return p, (time.perf_counter() - t0) / sum(map(len, tail)) * 1e6


def append_cost(p: Any, w: Workload) -> float:
    """µs per token to extend a request's index after a 500-token prompt (no proposals)."""
    times = []
    for r in range(4):
        prompt = (w.prompts[r] + w.truths[r])[:500]
        rest = w.truths[r][:256]
        p._sync(f"a{r}", prompt)
        toks = list(prompt)
        t0 = time.perf_counter()
        for t in rest:
            toks.append(t)
            p._sync(f"a{r}", toks)
        times.append((time.perf_counter() - t0) / len(rest) * 1e6)
        p._requests.pop(f"a{r}")
    return statistics.median(times)


def first_proposal(p: Any, w: Workload) -> float:
    """ms for a request's first proposal over a 700-token prompt."""
    times = []
    for r in range(10):
        prompt = (w.prompts[r] + w.truths[r])[:700]
        t0 = time.perf_counter()
        p.propose_for(f"f{r}", prompt, K)
        times.append((time.perf_counter() - t0) * 1e3)
        p._requests.pop(f"f{r}")
    return statistics.median(times)


def steady(p: Any, w: Workload, batch: int, steps: int,
           first: int = 0) -> tuple[float, float, list[float]]:
    """µs per request per step (index update + proposal) and tokens accepted per request-step, over
    ``steps`` steps; meanwhile (untimed) finished outputs of other requests enter the cache at
    ``batch / 128`` per step, as 256-token outputs at ~2 tokens per step would."""
    reqs = list(range(first, first + batch))
    toks = {r: list(w.prompts[r]) for r in reqs}
    done = {r: 0 for r in reqs}
    for r in reqs:  # first proposals (the index over the prompt) are not timed here
        p.propose_for(f"s{r}", toks[r], K)
    spent, calls, accepted, finished = 0.0, 0, 0, 0.0
    alone: list[float] = []
    drafts: dict[int, list[int]] = {r: [] for r in reqs}
    spare = iter(w.outputs)
    for step in range(steps):
        for r in reqs:  # verification against the truth: matching drafts + 1 token
            truth = w.truths[r]
            n = 0
            while n < len(drafts[r]) and done[r] + n < len(truth) and drafts[r][n] == truth[done[r] + n]:
                n += 1
            take = truth[done[r] : done[r] + n + 1]
            toks[r] += take
            done[r] += len(take)
            accepted += len(take)
        finished += batch / 128
        while finished >= 1:  # not timed here: the insert + evict row
            finished -= 1
            p.forget(f"done{batch}-{first}-{step}-{finished}", next(spare))
        t0 = time.perf_counter()
        for r in reqs:
            drafts[r] = p.propose_for(f"s{r}", toks[r], K)
        spent += time.perf_counter() - t0
        calls += batch
        for r in reqs[:8]:  # the proposal alone: asked again, no new tokens
            t1 = time.perf_counter()
            p.propose_for(f"s{r}", toks[r], K)
            alone.append((time.perf_counter() - t1) * 1e6)
    for r in reqs:
        p._requests.pop(f"s{r}")
    return spent / calls * 1e6, accepted / (steps * batch), alone


def size(p: Any) -> str:
    g = p.global_tree
    return f"{g.num_nodes:,} nodes" if hasattr(g, "num_nodes") else f"{g.index.num_states:,} states"


class GcClock:
    """Seconds the cyclic garbage collector ran (the trie's nodes are tracked objects; the
    automaton's int lists and int-to-int dicts are not)."""

    def __init__(self) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-ref", default=OLD_REF)
    ap.add_argument("--cached", type=int, default=1000, help="finished outputs in the global cache")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="100 cached outputs, 12 steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.cached, args.steps = 100, 12
    toks = corpus(args.old_ref)
    w = Workload(toks, args.seed, args.cached, 64)
    gc.collect()
    gc.freeze()  # setup objects out of the collector's way; each implementation's own objects stay in
    impls: dict[str, ModuleType] = {"new": new_suffix}
    old = load_old(args.old_ref)
    if old is not None:
        impls = {"old (trie)": old, **impls}
    rows: dict[str, dict[str, str]] = {}
    clock = GcClock()
    for name, mod in impls.items():
        gc_before, start = clock.seconds, time.perf_counter()
        t0 = time.perf_counter()
        p, per_tok = fill(mod, w)
        build = time.perf_counter() - t0
        r = rows.setdefault
        r("finished output into the full cache (insert + evict), µs/token", {})[name] = f"{per_tok:.1f}"
        r("  per finished 256-token output, ms", {})[name] = f"{per_tok * 256 / 1e3:.2f}"
        r(f"filling the cache ({args.cached + 200} outputs of 256), s", {})[name] = f"{build:.2f}"
        r("request index update after a 500-token prompt, µs/token", {})[name] = f"{append_cost(p, w):.1f}"
        r("first proposal over a 700-token prompt, ms", {})[name] = f"{first_proposal(p, w):.2f}"
        for batch in (1, 64):
            runs = [steady(p, w, batch, args.steps, first) for first in (range(8) if batch == 1 else [0])]
            us = statistics.mean(r_[0] for r_ in runs)
            acc = statistics.mean(r_[1] for r_ in runs)
            alone = [a for r_ in runs for a in r_[2]]
            r(f"steady step at batch {batch}: index update + proposal, µs/request", {})[name] = f"{us:.1f}"
            r(f"  tokens per request-step at batch {batch} (k = {K})", {})[name] = f"{acc:.2f}"
            if batch == 64:
                r("  host time per decode step at batch 64 (+ 0.5 finished outputs), ms", {})[name] = \
                    f"{(us * 64 + 0.5 * 256 * per_tok) / 1e3:.2f}"
                q = statistics.quantiles(alone, n=10)
                r("proposal alone at batch 64 (no new tokens), µs: median / p90", {})[name] = \
                    f"{statistics.median(alone):.1f} / {q[-1]:.1f}"
        total = time.perf_counter() - start
        r("garbage collector's share of this column's run", {})[name] = \
            f"{(clock.seconds - gc_before) / total:.0%} of {total:.1f} s"
        r("global structure size", {})[name] = size(p)
        del p  # the next column runs without this one's objects
        gc.collect()
    names = list(impls)
    width = max(map(len, rows)) + 2
    print(f"suffix proposer host cost (D = 24, k = {K}, {args.cached} cached outputs, corpus "
          f"{len(toks):,} tokens, {time.strftime('%Y-%m-%d %H:%M %Z')}, python {sys.version.split()[0]})")
    print("| " + "metric".ljust(width) + " | " + " | ".join(n.rjust(14) for n in names) + " |")
    print("|" + "-" * (width + 2) + "|" + "|".join("-" * 16 for _ in names) + "|")
    for key, vals in rows.items():
        print("| " + key.ljust(width) + " | " + " | ".join(vals.get(n, "-").rjust(14) for n in names) + " |")


if __name__ == "__main__":
    main()
