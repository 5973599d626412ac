"""Speculator: everything the engine needs to know about speculation, behind one small interface.

It owns the proposer (what drafts), the acceptance policy (whether a request drafts at all: the
acceptance gate, ``gate.py``) and the engine-wide speculation counters (``SpecStats``; a request's own
drafted / accepted counts are settled by the scheduler with the rollback). The engine calls it at
three points:

1. ``drafts_for(running)``, before scheduling a step while every token is on the host: drafts for the
   requests that got tokens since their last proposal and are in the decode phase. k is chosen per
   request: ``min(k, room)`` where the room keeps the drafts and the bonus token within
   ``max_tokens`` and ``max_model_len``, and 0 while the gate says speculation does not pay for the
   request (it is then shadowed). An empty draft is always allowed: the request just decodes. A
   request with structured output gets its drafts cut at the first token its grammar refuses.
2. ``will_draft(requests)``: whether any of these requests may draft in its next step. Drafts are
   proposed from read tokens, so the engine schedules a decode step before the previous step's tokens
   are read (asynchronous decode) only when none will.
3. ``observe(StepRecord)``, after every step: per request that got tokens, its drafted / accepted
   counts (``on_verified``) and its new tokens (``on_tokens``: shadow scoring while it does not
   draft, and a proposal next time); the requests that finished (``forget``: the gate drops them, the
   proposer gets their output, which the suffix proposer caches); the step's kind and wall time
   (``on_step``: the gate's verify / decode cost ratio).

Without speculation the engine holds a ``NoSpeculation``: no drafts, never in the way of
asynchronous decode, nothing to observe.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.config.speculative import SpeculativeConfig
from tandem.engine.stats import SpecStats
from tandem.request import Request
from tandem.scheduler import SchedulerOutput
from tandem.spec_decode.gate import AcceptanceGate
from tandem.spec_decode.proposers import EngineProposer


class StepKind(enum.Enum):
    VERIFY = "verify"  # some request verified drafts
    DECODE = "decode"  # every request decoded one token
    OTHER = "other"  # prefill chunks, mixed steps, nothing scheduled: not timed


def step_kind(sched: SchedulerOutput) -> StepKind:
    if any(s.spec_token_ids for s in sched.scheduled):
        return StepKind.VERIFY
    if sched.scheduled and all(s.num_new_tokens == 1 and s.samples for s in sched.scheduled):
        return StepKind.DECODE
    return StepKind.OTHER


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]  # target token ids, at most the k chosen for the request (0 allowed)
    probs: torch.Tensor | None = None  # [len(token_ids), V] draft q when the proposer sampled


@dataclass(frozen=True)
class SampledTokens:
    """A request that got tokens in a step: ``num_drafted`` drafts verified, ``num_accepted`` kept."""

    request: Request
    num_drafted: int
    num_accepted: int


@dataclass(frozen=True)
class StepRecord:
    kind: StepKind
    seconds: float  # wall time of the engine step
    sampled: tuple[SampledTokens, ...]
    finished: tuple[str, ...]  # request ids finished (stopped, length, aborted) since the last record


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: EngineProposer, stats: SpecStats,
                 gate: AcceptanceGate | None = None) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = stats
        self.gate = gate
        self.k = config.num_speculative_tokens
        self._new_tokens: set[str] = set()  # requests that got tokens since their last proposal
        self._requests: dict[str, Request] = {}  # requests that got tokens, until forgotten

    @property
    def synthetic_acceptance_rate(self) -> float | None:
        """Benchmark mode (drafts accepted at a fixed rate, output not the target's); None: lossless."""
        return self.config.synthetic_acceptance_rate if self.config.is_synthetic else None

    # ---- the engine's three questions ------------------------------------------------------------
    def drafts_for(self, requests: Sequence[Request]) -> dict[str, Draft]:
        """Drafts for the requests among ``requests`` due a proposal (see the module docstring)."""
        reqs = [r for r in requests if r.request_id in self._new_tokens and r.is_decoding]
        self._new_tokens.clear()
        if not reqs:
            return {}
        proposal = self.proposer.propose_requests(reqs, [self._num_drafts(r) for r in reqs])
        drafts: dict[str, Draft] = {}
        off = 0
        for r, toks in zip(reqs, proposal.token_ids):
            probs = proposal.probs[off:off + len(toks)] if proposal.probs is not None and toks else None
            off += len(toks)
            if r.grammar is not None and toks:  # structured output: cut at the first token the grammar refuses
                toks = r.grammar.validate(toks, keep_refused=probs is not None)
                probs = probs[:len(toks)] if probs is not None and toks else None
            drafts[r.request_id] = Draft(tuple(toks), probs)
        return drafts

    def will_draft(self, requests: Sequence[Request]) -> bool:
        """Whether any request may draft in its next step (its tokens, placeholders included, so far).
        Without the gate a proposer may find drafts for anyone: always true."""
        if self.gate is None:
            return True
        return any(self.gate.wants(r.request_id, r.num_tokens) for r in requests)

    def observe(self, record: StepRecord) -> None:
        for s in record.sampled:
            self.on_verified(s.request, s.num_drafted, s.num_accepted)
            self.on_tokens(s.request)
        for rid in record.finished:
            self.forget(rid)
        self.on_step(record.kind, record.seconds)

    # ---- what observe() is made of -------------------------------------------------------------
    def on_verified(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.stats.record(num_drafted, num_accepted)
        if self.gate is not None:
            self.gate.record_verify(request.request_id, num_drafted, num_accepted)

    def on_tokens(self, request: Request) -> None:
        self._requests[request.request_id] = request  # its output goes to the proposer at forget
        if request.status.finished:
            return
        self._new_tokens.add(request.request_id)
        if self.gate is not None:
            self.gate.observe(request.request_id, request.token_ids, self.k)

    def on_step(self, kind: StepKind, seconds: float) -> None:
        if self.gate is not None and kind is not StepKind.OTHER:
            self.gate.record_step(seconds, verified=kind is StepKind.VERIFY)

    def forget(self, request_id: str) -> None:
        self._new_tokens.discard(request_id)
        request = self._requests.pop(request_id, None)
        self.proposer.forget(request_id, request.output_token_ids if request is not None else ())
        if self.gate is not None:
            self.gate.forget(request_id)

    def _num_drafts(self, r: Request) -> int:
        room = min(r.max_output_tokens - r.num_output_tokens - 1, r.max_model_len - r.num_tokens - 1)
        k = max(0, min(self.k, room))
        if k and self.gate is not None and not self.gate.wants(r.request_id, r.num_tokens):
            return 0  # not paying for this request now: shadow drafts only
        return k


class NoSpeculation:
    """The speculator of an engine without speculation."""

    config: SpeculativeConfig | None = None
    proposer: EngineProposer | None = None
    gate: AcceptanceGate | None = None
    synthetic_acceptance_rate: float | None = None

    def drafts_for(self, requests: Sequence[Request]) -> dict[str, Draft]:
        return {}

    def will_draft(self, requests: Sequence[Request]) -> bool:
        return False

    def observe(self, record: StepRecord) -> None:
        pass


AnySpeculator = Speculator | NoSpeculation


def build_speculator(config: SpeculativeConfig | None, proposer: EngineProposer | None, stats: SpecStats,
                     device: torch.device) -> AnySpeculator:
    """The engine's speculator. The acceptance gate is on where ``disable_by_acceptance`` says so
    (None: on for CUDA targets) and the proposer drafts on the host for free (its shadow drafts must
    cost nothing)."""
    if config is None:
        return NoSpeculation()
    if proposer is None:
        raise RuntimeError(f"speculative method {config.method!r} needs its proposer built at engine start")
    gate_on = config.disable_by_acceptance
    if gate_on is None:
        gate_on = device.type == "cuda"
    gate = None
    if gate_on and proposer.drafts_on_host_for_free:
        gate = AcceptanceGate(proposer.propose_one)  # type: ignore[attr-defined]
    return Speculator(config, proposer, stats, gate)
