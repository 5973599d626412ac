"""A trace-driven stand-in for the asynchronous engine, for the goodput policy: requests whose
target continuations are fixed token streams (greedy decoding of a model that is not there), the
real n-gram proposer drafting from the tokens the host has read, greedy verification against the
streams, and the engine's step logic (engine/llm_engine.py) with a cost per step kind:

- a chained decode step (launched ahead, the previous one read): ``decode`` seconds, steady;
- a drain (``will_draft`` said yes: the step in flight is read, nothing launched): ``decode``, not steady;
- a restart (no drafts after a drained step: launched, then the next launched ahead): ``decode +
  restart``, not steady;
- a synchronous plain step (launched, read at once): ``sync_decode``;
- a verify of n drafts over the batch (synchronous): ``verify(n)``.

The proposer is the n-gram proposer, or a stateful one's ``propose_for`` (suffix decoding).

``policy=None`` is drafting every step (``disable_by_acceptance: false``): every step synchronous.
No weights, no device: the H200's batch-1 regime (a verify cycle ~2 chained decode steps) on CPU.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.policy import Candidate, GoodputPolicy
from tandem.spec_decode.policy_accept import score_draft


@dataclass(frozen=True)
class AsyncCosts:
    decode: float  # a chained decode step of the batch
    restart: float  # what restarting the pipeline adds to a plain step
    sync_decode: float  # a plain step run synchronously
    verify_base: float  # a synchronous verify step ...
    per_draft: float  # ... plus this per draft token in it

    def verify(self, num_drafts: int) -> float:
        return self.verify_base + self.per_draft * num_drafts


# H200, real SmolLM2-135M, batch 1 (docs/performance.md §32: chained 0.522 ms, synchronous 0.751 ms,
# a 4-draft n-gram verify cycle ~1.07 ms before §34's tiles took ~0.15 ms off it)
H200_BATCH1 = AsyncCosts(decode=0.522e-3, restart=0.23e-3, sync_decode=0.751e-3, verify_base=0.80e-3,
                         per_draft=0.04e-3)


def code_like_stream(rng: random.Random, length: int, vocab: int = 200, copy: float = 0.7) -> list[int]:
    """Tokens where spans of earlier text come back (as in code: names, lines, patterns) between
    fresh ones: n-gram matches come and go."""
    toks = [rng.randrange(vocab) for _ in range(16)]
    while len(toks) < length:
        if rng.random() < copy and len(toks) > 24:
            start = rng.randrange(len(toks) - 12)
            toks += toks[start:start + rng.randrange(6, 24)]
        else:
            toks += [rng.randrange(vocab) for _ in range(rng.randrange(2, 10))]
    return toks[:length]


class AsyncSim:
    def __init__(self, policy: GoodputPolicy | None, streams: list[list[int]], prompt_len: int,
                 costs: AsyncCosts, k: int = 4, proposer: NgramProposer | None = None, first_id: int = 0,
                 propose_for: Callable[[str, list[int], int], list[int]] | None = None) -> None:
        self.policy, self.costs, self.k = policy, costs, k
        self.proposer = proposer if proposer is not None else NgramProposer(1, 4, k)
        # a stateful proposer (suffix: its ``propose_for``); else the n-gram proposer, by tokens alone
        self.propose_for = propose_for or (lambda rid, toks, k: self.proposer.propose_one(toks, k))
        self.streams = {f"r{first_id + i}": s for i, s in enumerate(streams)}
        self.tokens = {r: list(s[:prompt_len]) for r, s in self.streams.items()}
        self.inflight = False  # a decode step of the whole batch is in flight (its tokens not read)
        self.seconds = 0.0
        self.emitted = 0
        self.steps = {"chained": 0, "drain": 0, "restart": 0, "sync": 0, "verify": 0}
        self.verified_drafts = 0
        self.accepted = 0

    @property
    def batch(self) -> int:
        return len(self.tokens)

    def _done(self) -> bool:
        return any(len(t) >= len(self.streams[r]) - self.k - 1 for r, t in self.tokens.items())

    def _cands(self) -> Callable[[], list[Candidate]]:
        return lambda: [Candidate(r, self.k) for r in self.tokens]

    def _read(self, extra: dict[str, int] | None = None) -> None:
        """Every request gets its next token (``extra``: plus that many accepted drafts)."""
        for r, toks in self.tokens.items():
            s = self.streams[r]
            n = 1 + (extra or {}).get(r, 0)
            toks += s[len(toks):len(toks) + n]
            self.emitted += n

    def _record(self, kind: str, seconds: float, steady: bool, num_drafts: int = 0, emitted: int = 0) -> None:
        self.steps[kind] += 1
        self.seconds += seconds
        p = self.policy
        if p is not None:
            p.on_step_tokens(list(self.tokens.items()))
            p.on_step(self.batch, self.batch + num_drafts, seconds, steady=steady, num_tokens=emitted)

    def step(self) -> None:
        c, p, b = self.costs, self.policy, self.batch
        before = self.emitted
        if p is not None:
            p.background()  # (the engine: while the device computes a step)
        if self.inflight:
            assert p is not None
            if p.wants_any(b, self._cands(), drained=False):
                self.inflight = False
                self._read()
                self._record("drain", c.decode, False, emitted=self.emitted - before)
            else:
                self._read()
                self._record("chained", c.decode, True, emitted=self.emitted - before)
            return
        drafts: dict[str, list[int]] = {}
        if p is None or (not p.off(b) and p.wants_any(b, self._cands(), drained=True)):
            full = {r: self.propose_for(r, t, self.k) for r, t in self.tokens.items()}
            if p is None:
                drafts = full
            else:
                for r, d in full.items():
                    p.proposed(r, len(self.tokens[r]), d)
                ks = p.choose(b, [Candidate(r, self.k, tuple(full[r])) for r in self.tokens])
                drafts = {r: full[r][:kk] for r, kk in zip(self.tokens, ks)}
        n = sum(len(d) for d in drafts.values())
        if n:
            # greedy verification against the target's stream: the draft's longest matching prefix
            acc = {r: score_draft(d, len(self.tokens[r]), self.streams[r])[0] if d else 0 for r, d in drafts.items()}
            self.verified_drafts += n
            self.accepted += sum(acc.values())
            self._read(acc)
            self._record("verify", c.verify(n), True, n, emitted=self.emitted - before)
        elif p is None:
            self._read()
            self._record("sync", c.sync_decode, True, emitted=self.emitted - before)
        elif not p.wants_any(b, self._cands(), drained=False):  # launched, and the next one ahead
            self.inflight = True
            self._read()
            self._record("restart", c.decode + c.restart, False, emitted=self.emitted - before)
        else:  # launched and read at once
            self._read()
            self._record("sync", c.sync_decode, True, emitted=self.emitted - before)

    def run(self, max_steps: int = 100_000) -> AsyncSim:
        for _ in range(max_steps):
            if self._done():
                break
            self.step()
        if self.policy is not None:
            for r in self.tokens:
                self.policy.forget(r)
        return self

    def seconds_per_token(self) -> float:
        return self.seconds / self.emitted


def run_one_at_a_time(policy: GoodputPolicy | None, traces: list[tuple[int, list[int]]], costs: AsyncCosts,
                      k: int = 4) -> tuple[float, int, dict[str, int]]:
    """Requests (prompt length, prompt + continuation) run alone one after another through one
    engine's policy: (seconds, tokens, step kinds)."""
    seconds, tokens, steps = 0.0, 0, dict.fromkeys(("chained", "drain", "restart", "sync", "verify"), 0)
    for i, (prompt_len, stream) in enumerate(traces):
        sim = AsyncSim(policy, [stream], prompt_len, costs, k, first_id=i).run()
        seconds, tokens = seconds + sim.seconds, tokens + sim.emitted
        for kind, n in sim.steps.items():
            steps[kind] += n
    return seconds, tokens, steps
