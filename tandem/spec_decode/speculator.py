"""Speculator: everything the engine needs to know about speculation, behind one small interface.

It owns the proposer (what drafts), the goodput policy (how many drafts each request verifies this
step, 0..k: ``policy.py``) and the engine-wide speculation counters (``SpecStats``; a request's own
drafted / accepted counts are settled by the scheduler with the rollback). The engine calls it at
three points:

1. ``drafts_for(running)``, before scheduling a step while every token is on the host: drafts for the
   requests that got tokens since their last proposal and are in the decode phase. A request's k is
   at most ``min(k, room)``, the room keeping the drafts and the bonus token within ``max_tokens`` and
   ``max_model_len`` (and within ``speculative_config.max_model_len`` where set: a request longer than
   that is not speculated for, as in vLLM — a draft model built for that length could not run it);
   the policy chooses within it. Host proposers (n-gram, suffix) are asked for the
   full k first and their drafts truncated to the policy's choice (the rest is scored in the shadow);
   no proposal at all is made while the policy's ``wants_any`` says nobody would draft (as when
   asynchronous decode chains steps); model-based proposers draft only what the policy grants (a
   round where it grants nothing runs no forward at all). An empty draft is always allowed. A
   request with structured output gets its drafts cut at the first token its grammar refuses. A
   proposer that can (EAGLE: ``propose_on_device``) leaves its drafts on the device when no
   drafting request has a grammar: the requests get ``PENDING`` placeholders, the executor feeds the
   real ids to the verify, and ``resolve_drafts`` reads them once the verify is queued
   (``device_drafts.py``; the policy hears of the proposal then).
2. ``will_draft(requests)``: whether any of these requests may draft in its next step. Drafts are
   proposed from read tokens, so the engine schedules a decode step before the previous step's tokens
   are read (asynchronous decode) only when none will. It is asked with a step in flight, so a "yes"
   drains the pipeline (the policy's ``wants_any(drained=False)``); ``drafts_for`` asks with every
   token read (``drained=True``: going on after a verify costs the verify alone).
3. ``observe(StepRecord)`` (``step_record.py``; an engine without speculation builds none), after
   every step: per request that got tokens, its drafted / accepted
   counts (the counters) and its new tokens (``policy.on_step_tokens``: pending proposals scored,
   a budget of lazy shadows; skipped while the policy has nothing to score); the requests that
   finished (``forget``: the policy drops them, their outputs queue for the proposer); the
   step's kind, size, tokens, steadiness and wall time — this bookkeeping included — (``on_step``:
   the policy's step-cost model and goodput guard).

Chained verifies (engine/async_decode.py): with a proposer that drafts ahead (``chains``) a greedy
verify stays on the device and ``drafts_ahead(running, verify)`` proposes the next step's drafts
before it is read. A host proposer (n-gram, suffix) drafts from the assumption that the verify
accepts every draft and emits the token the proposer expects next; ``observe`` checks the assumption
once the verify is read (held: the policy hears of the proposal; failed: the request's next step
drafts nothing). An EAGLE head drafts on the device from the verify's real outcome there
(``propose_chained``): nothing is assumed, its drafts stay on the device and are read as above.

Host work that may wait runs in ``background()``, which the engine calls while the device computes
a step (after launching it, before reading it): the policy's latest shadows (the suffix proposer's
lookups) are drafted and finished outputs go to the proposer there, paid from a time credit of 2 %
of each step's wall time (``finished_queue.py``: the suffix proposer caches each output in its
global tree, ~3-4 µs per token, and a host-bound step pays that whether anyone drafts or not).

``disable_by_acceptance: false`` turns the policy off: every request drafts up to k every step, as
vLLM does (the policy is on by default). Without speculation the engine holds a ``NoSpeculation``: no drafts, never in the way of
asynchronous decode, nothing to observe.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from tandem.config.speculative import SpeculativeConfig
from tandem.engine.stats import SpecStats
from tandem.request import Request
from tandem.spec_decode.device_drafts import PENDING, DeviceDrafts, pending
from tandem.spec_decode.finished_queue import FinishedQueue
from tandem.spec_decode.policy import Candidate, GoodputPolicy
from tandem.spec_decode.policy_cost import ASYNC_PRIOR_RESTART, ASYNC_PRIOR_SIGMA, PRIOR_SIGMA, StepCostModel
from tandem.spec_decode.proposers import EngineProposer, TokenProposerAdapter, propose_in_turn
from tandem.spec_decode.step_record import NO_DRAFT, Draft, StepKind, StepRecord
from tandem.worker.batch import ChainedFrom


# A host proposer's round while nobody drafts at batch >= 8 stops asking after this (seconds; the
# lookup it started finishes), the others come first next time: a suffix proposer's first lookup
# builds a request's index (a batch-32 round had stalled a step 29 ms on the H200, performance.md §44)
ROUND_CALL_MAX = 0.001
# Where the policy is on without ``disable_by_acceptance``: everywhere. (On the 2-core CPU, drafting
# every step ran at 0.62-0.89x of plain decoding on chat and at concurrency 8, docs/performance.md §15.)
POLICY_BY_DEFAULT_ON: tuple[str, ...] = ("cuda", "cpu", "mps", "xpu")


class Speculator:
    observes = True  # the engine hands it a StepRecord after every step

    def __init__(self, config: SpeculativeConfig, proposer: EngineProposer, stats: SpecStats,
                 policy: GoodputPolicy | None = None, k: int | None = None) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = stats
        self.policy = policy
        self.k = config.num_speculative_tokens if k is None else k  # drafts per request per step at most
        self._new_tokens: set[str] = set()  # requests that got tokens since their last proposal
        self._draft_seconds, self._draft_steps = 0.0, 0  # model drafting in the step being timed
        # drafts on the device for the next step, and per drafter (request, tokens when proposed;
        # chained: None and the head's position count as proposed, corrected when read)
        self._pending: tuple[DeviceDrafts, list[tuple[Request, int | None, int]]] | None = None
        # (request id, output) for the proposer, paid from the policy's time credit (which it earns)
        self.finished = FinishedQueue(credit=policy.idle if policy is not None else None)
        # chained verifies (``drafts_ahead``): per request drafting in the step just launched, the
        # tokens its drafts assume the verify in flight emits (request, from index, tokens, full draft)
        self._assumed: dict[str, tuple[Request, int, tuple[int, ...], tuple[int, ...]]] = {}
        self._unsound: set[str] = set()  # requests whose drafts in flight rest on a failed assumption
        self._round_turn = 0  # where the next bounded proposal round starts (``propose_in_turn``)

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
        due = [r.request_id for r in reqs]
        policy = self.policy
        if policy is None and self._capped(len(requests)):
            return dict.fromkeys(due, NO_DRAFT)
        if policy is not None and (policy.off(len(requests)) or not policy.wants_any(
                len(requests), lambda: [Candidate(r.request_id, self._room(r)) for r in reqs], drained=True)):
            # no proposal costs while nobody may draft, nor while the estimates say nobody would
            # (the question asynchronous decode asks: ``will_draft``); evidence keeps coming from
            # the lazy shadows and the rounds ``wants_any`` forces
            policy.stats.record_nothing_drafted(len(reqs), self.k)
            return dict.fromkeys(due, NO_DRAFT)
        rooms = [self._room(r) for r in reqs]
        if policy is None:
            if self._on_device(reqs, rooms):
                return self._propose_on_device(reqs, rooms, time.perf_counter())
            proposal, ks = self.proposer.propose_requests(reqs, rooms), rooms
        elif policy.free:  # host lookups: the full drafts first, then the choice
            t0 = policy.idle.clock()
            if policy.rationed(len(requests)):  # (while nobody drafts: the idle share, a bounded round)
                order, proposal = propose_in_turn(self.proposer, reqs, rooms, self._round_turn, policy.idle.clock,
                                                  t0 + ROUND_CALL_MAX)
                self._round_turn += len(order)
                reqs, rooms = [reqs[i] for i in order], [rooms[i] for i in order]
            else:
                proposal = self.proposer.propose_requests(reqs, rooms)
            for r, toks in zip(reqs, proposal.token_ids):
                policy.proposed(r.request_id, len(r.token_ids), toks)
            policy.charge(len(requests), policy.idle.clock() - t0)
            ks = policy.choose(len(requests), [Candidate(r.request_id, room, tuple(toks))
                                               for r, room, toks in zip(reqs, rooms, proposal.token_ids)])
        else:  # drafting costs forwards: choose first, draft what was granted
            ks = policy.choose(len(requests), [Candidate(r.request_id, room) for r, room in zip(reqs, rooms)])
            if not any(ks):  # no forward for nobody's drafts
                return dict.fromkeys(due, NO_DRAFT)
            t0 = time.perf_counter()
            if self._on_device(reqs, ks):
                return self._propose_on_device(reqs, ks, t0)
            proposal = self.proposer.propose_requests(reqs, ks)
            self._timed_drafts(t0, ks)
            for r, toks, k in zip(reqs, proposal.token_ids, ks):
                if k:  # (an empty draft nobody asked for says nothing about how far drafts reach)
                    policy.proposed(r.request_id, len(r.token_ids), toks)
        drafts: dict[str, Draft] = dict.fromkeys(due, NO_DRAFT)  # (a bounded round asks only some)
        off = 0
        for r, toks, k in zip(reqs, proposal.token_ids, ks):
            n = min(len(toks), k)
            probs = proposal.probs[off:off + n] if proposal.probs is not None and n else None
            off += len(toks)
            toks = list(toks[:n])
            if r.grammar is not None and toks:  # structured output: cut at the first token the grammar refuses
                toks = r.grammar.validate(toks, keep_refused=probs is not None)
                probs = probs[:len(toks)] if probs is not None and toks else None
            drafts[r.request_id] = Draft(tuple(toks), probs)
        return drafts

    # ---- drafts left on the device (device_drafts.py) ------------------------------------------
    def _on_device(self, reqs: Sequence[Request], ks: Sequence[int]) -> bool:
        """The proposer can leave its drafts on the device and no drafting request needs them
        before scheduling (a grammar cuts drafts at its first refused token)."""
        return (hasattr(self.proposer, "propose_on_device")
                and not any(k and r.grammar is not None for r, k in zip(reqs, ks)))

    def _propose_on_device(self, reqs: Sequence[Request], ks: Sequence[int], t0: float) -> dict[str, Draft]:
        dd = self.proposer.propose_on_device(reqs, ks)  # type: ignore[attr-defined]
        self._timed_drafts(t0, ks)
        index = dd.index if dd is not None else {}
        if dd is not None:
            self._pending = (dd, [(r, len(r.token_ids), 0) for r in reqs if r.request_id in index])
        return {r.request_id: Draft(pending(len(index.get(r.request_id, ())))) for r in reqs}

    @property
    def device_drafts(self) -> DeviceDrafts | None:
        """Drafts proposed for the next step that are still on the device (the executor feeds them)."""
        return self._pending[0] if self._pending is not None else None

    def resolve_drafts(self) -> dict[str, list[int]]:
        """Read the drafts left on the device (after the verify step is launched) and put them in
        place of their requests' placeholders (those not scheduled yet); the policy hears of them as
        of any proposal. Returns them (request id → drafts). A chained proposal's (``drafts_ahead``)
        is read once the verify it followed was: the request's tokens then end where its drafts
        start, and the head's count of positions seen (set as if that verify accepted everything)
        comes back to them."""
        if self._pending is None:
            return {}
        (dd, reqs), self._pending = self._pending, None
        host = dd.read()
        for r, at, assumed in reqs:
            if r.status.finished:
                continue
            if at is None:
                at = len(r.token_ids)
                if r.draft_num_computed == assumed:  # (else reset meanwhile: a preemption)
                    r.draft_num_computed = at - 1
            toks = host[r.request_id]
            if self.policy is not None:
                self.policy.proposed(r.request_id, at, toks)
            n = len(r.spec_token_ids)  # (a budget cut shortens it; a preemption empties it)
            if n and r.spec_token_ids[0] == PENDING:
                r.spec_token_ids = toks[:n]
        return host

    # ---- chained verifies (engine/async_decode.py) ----------------------------------------------
    @property
    def chains(self) -> bool:
        """Drafts for the step after a launched verify may be proposed before that verify is read
        (``drafts_ahead``): a host proposer that answers ``propose_ahead`` (n-gram, suffix: their
        state never takes the assumed tokens), or an EAGLE head (``propose_chained``: it drafts on
        the device from the verify's outcome there)."""
        if self.synthetic_acceptance_rate is not None:
            return False
        if isinstance(self.proposer, TokenProposerAdapter):
            return self.proposer.drafts_ahead
        return hasattr(self.proposer, "propose_chained")

    def drafts_ahead(self, requests: Sequence[Request], verify: ChainedFrom) -> dict[str, Draft]:
        """Drafts for the step after a launched verify, proposed before it is read (``verify``: per
        request, its rows there and the drafts they check). An EAGLE head drafts on the device from
        the verify's outcome (``propose_chained``): its drafts are those of a proposal made after
        the read, left on the device like ``drafts_for``'s. A host proposer drafts on the
        assumption that the verify accepts every draft and emits the token the proposer expects
        next: it gives that token and the request's room of drafts after it (``propose_ahead``).
        Where the assumption fails (known when the verify is read:
        ``observe``) those drafts are verified all the same — the verify decides, the output stays
        the target's — and mostly rejected, and the request's next step drafts nothing (its drafts
        would rest on the failed ones). The policy chooses as in ``drafts_for``, each request's
        drafts weighed by the chance that its assumption holds (``assumption_holds``), and hears of
        a proposal once its assumption has held. (Drafting such a request ahead all the same, on the
        proposer's continuation of the tokens read, cut the steps by 4 % but was no faster on the
        H200: the guess held a third of the time, and a verify of junk costs more than a decode;
        docs/performance.md §38.)"""
        unsound, self._unsound = self._unsound, set()
        batch = len(requests)
        policy = self.policy
        if (policy is None and self._capped(batch)) or (policy is not None and policy.off(batch)):
            return {}
        picked = [i for i, r in enumerate(requests) if r.request_id not in unsound]
        reqs = [requests[i] for i in picked]
        if not reqs:
            return {}
        if policy is not None and not policy.wants_any(
                batch, lambda: [Candidate(r.request_id, self._room(r)) for r in reqs], drained=True):
            policy.stats.record_nothing_drafted(len(reqs), self.k)
            return {}
        rooms = [self._room(r) for r in reqs]
        if not isinstance(self.proposer, TokenProposerAdapter):
            return self._propose_chained(batch, reqs, rooms, verify)
        assumed = [verify.drafts[i] for i in picked]
        assert isinstance(self.proposer, TokenProposerAdapter)
        proposal = self.proposer.propose_ahead(reqs, assumed, rooms)
        drafts = [tuple(t[1:]) for t in proposal]
        if policy is None:
            ks = rooms
        else:
            # drafts on an assumption are worth what it is likely to hold
            ks = policy.choose(batch, [Candidate(r.request_id, room, d, policy.assumption_holds(r.request_id, len(a)))
                                       for r, room, d, a in zip(reqs, rooms, drafts, assumed)])
        out: dict[str, Draft] = {}
        for r, toks, d, a, k in zip(reqs, proposal, drafts, assumed, ks):
            if k and d:
                out[r.request_id] = Draft(d[:k])
                self._assumed[r.request_id] = (r, len(r.token_ids), a + (int(toks[0]),), d)
        return out

    def _propose_chained(self, batch: int, reqs: Sequence[Request], rooms: Sequence[int], verify: ChainedFrom
                         ) -> dict[str, Draft]:
        """``drafts_ahead`` for an EAGLE head: the policy grants, the head drafts on the device."""
        ks = list(rooms) if self.policy is None else self.policy.choose(
            batch, [Candidate(r.request_id, room) for r, room in zip(reqs, rooms)])
        if not any(ks):
            return {}
        t0 = time.perf_counter()
        dd = self.proposer.propose_chained(reqs, ks, verify)  # type: ignore[attr-defined]
        self._timed_drafts(t0, ks)
        if dd is None:
            return {}
        self._pending = (dd, [(r, None, r.draft_num_computed) for r in reqs if r.request_id in dd.index])
        return {rid: Draft(pending(len(pos))) for rid, pos in dd.index.items()}

    def _timed_drafts(self, t0: float, ks: Sequence[int]) -> None:
        """A model proposal's time comes off the step's (the verify's cost) and counts as ``max(ks)``
        draft steps — unless an EAGLE head first caught up over positions it had idled through (> k + 1
        rows per request): counted, that had priced a head step at 1.9-3.8 decodes on the H200 (§39)."""
        self._draft_seconds, self._draft_steps = time.perf_counter() - t0, max(ks, default=0)
        rows, n = getattr(self.proposer, "last_catch_up", (0, 0))
        if rows > (self.k + 1) * n:
            self._draft_steps = 0

    def _settle_assumptions(self) -> None:
        """After the verify the last ``drafts_ahead`` assumed about was read: a request whose tokens
        came out as assumed has a proposal like any other (the policy scores it), the others' drafts
        in flight rest on nothing."""
        for rid, (r, at, tokens, draft) in self._assumed.items():
            if r.status.finished:
                continue
            if tuple(r.token_ids[at:at + len(tokens)]) == tokens:
                self.stats.num_assumed_held += 1
                if self.policy is not None:
                    self.policy.proposed(rid, at + len(tokens), draft)
            else:
                self.stats.num_assumed_failed += 1
                self._unsound.add(rid)
        self._assumed.clear()

    def will_draft(self, requests: Sequence[Request]) -> bool:
        """Whether any request may draft in its next step (its tokens, placeholders included, so far).
        Without the policy a proposer may find drafts for anyone: true below ``disable_by_batch_size``."""
        if self.policy is None:
            return not self._capped(len(requests))
        return self.policy.wants_any(len(requests), lambda: [Candidate(r.request_id, self._room(r)) for r in requests],
                                     drained=False)

    def observe(self, record: StepRecord) -> None:
        """The step's evidence, then its timing — which includes this bookkeeping (host work the
        speculator adds to every step, paid for by the steps that speculate). A plain step where
        nobody has a proposal pending costs one pass over its requests (who got tokens)."""
        t0 = time.perf_counter()
        got = record.requests
        if record.kind is StepKind.VERIFY:  # (only a verify has drafts to count)
            stats = self.stats
            for d, a in zip(record.drafted, record.accepted):
                if d:
                    stats.record(d, a)
        self._new_tokens.update([r.request_id for r in got])  # (finished ones: forgotten below)
        policy = self.policy
        if policy is not None and policy.wants_tokens:
            tokens = [(r.request_id, r.token_ids) for r in got if not r.status.finished]
            if tokens:
                policy.on_step_tokens(tokens)
        if self._assumed:
            self._settle_assumptions()
        for r in record.finished:
            self.forget(r)
        self.on_step(record, time.perf_counter() - t0)

    # ---- what observe() is made of -------------------------------------------------------------
    def on_step(self, record: StepRecord, bookkeeping: float = 0.0) -> None:
        if self.policy is None:
            self.finished.earn(record.seconds)  # (else the policy earns the credit they share)
        else:
            self.policy.on_step(record.num_requests, record.num_query_tokens, record.seconds + bookkeeping,
                                self._draft_seconds, self._draft_steps,
                                timed=record.kind is not StepKind.OTHER and record.num_requests > 0,
                                steady=record.steady, num_tokens=record.num_tokens)
        self._draft_seconds, self._draft_steps = 0.0, 0

    def forget(self, request: Request) -> None:
        """A finished request: the policy drops it; its output queues for the proposer (the suffix
        proposer caches it), handed over by ``background``."""
        rid = request.request_id
        self._new_tokens.discard(rid)
        self._unsound.discard(rid)
        self.finished.push(rid, request.output_token_ids)
        if self.policy is not None:
            self.policy.forget(rid)

    def background(self, drain: bool = False) -> None:
        """Host work that may wait, done while the device computes a step: the policy's latest
        shadows, then queued finished outputs to the proposer while the steps' time credit lasts
        (all with ``drain``; finished_queue.py). Until then a proposal does not see them."""
        if self.policy is not None:
            self.policy.background()  # its latest shadows (a stateful proposer's lookups)
        self.finished.hand_over(self.proposer.forget, drain)

    def _capped(self, batch: int) -> bool:
        """``disable_by_batch_size`` without the policy (the policy applies it itself)."""
        cap = self.config.disable_by_batch_size
        return cap is not None and batch >= cap

    def _room(self, r: Request) -> int:
        cap = self.config.max_model_len  # (speculative_config's: no drafts past it)
        limit = r.max_model_len if cap is None else min(r.max_model_len, cap)
        room = min(r.max_output_tokens - r.num_output_tokens - 1, limit - r.num_tokens - 1)
        return max(0, min(self.k, room))


class NoSpeculation:
    """The speculator of an engine without speculation."""

    config: SpeculativeConfig | None = None
    proposer: EngineProposer | None = None
    policy: GoodputPolicy | None = None
    synthetic_acceptance_rate: float | None = None
    device_drafts: DeviceDrafts | None = None
    chains = False
    observes = False  # (the engine builds no step records for it)
    k = 0

    def drafts_ahead(self, requests: Sequence[Request], verify: ChainedFrom) -> dict[str, Draft]:
        return {}

    def drafts_for(self, requests: Sequence[Request]) -> dict[str, Draft]:
        return {}

    def resolve_drafts(self) -> dict[str, list[int]]:
        return {}

    def will_draft(self, requests: Sequence[Request]) -> bool:
        return False

    def observe(self, record: StepRecord) -> None:
        pass

    def background(self, drain: bool = False) -> None:
        pass


AnySpeculator = Speculator | NoSpeculation


def build_speculator(config: SpeculativeConfig | None, proposer: EngineProposer | None, stats: SpecStats,
                     device: torch.device, asynchronous: bool = False, draft_limit: int | None = None
                     ) -> AnySpeculator:
    """The engine's speculator. The goodput policy is on where ``disable_by_acceptance`` says so
    (None: on for the device types in ``POLICY_BY_DEFAULT_ON``). Host proposers (the token-only ones) draft at no device cost; the stateless ones
    (``drafts_on_host_for_free``: n-gram) also give the policy lazy shadow drafts. A proposer may
    declare ``draft_step_cost`` (one draft step in target decode steps); otherwise a model-based
    proposer's is measured. On an ``asynchronous`` engine a verify step runs synchronously while
    plain decode steps overlap the host's work, so the policy starts from a verify costing twice a
    decode step (``ASYNC_PRIOR_SIGMA``, measured: H200, SmolLM2, batch 1) until it has measured its own.
    ``draft_limit`` (the target runner's, engine/builder.py): drafts per request per step at most,
    below ``num_speculative_tokens`` where a longer verify would leave the runner's fast path."""
    if config is None:
        return NoSpeculation()
    if proposer is None:
        raise RuntimeError(f"speculative method {config.method!r} needs its proposer built at engine start")
    k = config.num_speculative_tokens if draft_limit is None else min(config.num_speculative_tokens, draft_limit)
    on = config.disable_by_acceptance
    if on is False or (on is None and device.type not in POLICY_BY_DEFAULT_ON):
        return Speculator(config, proposer, stats, None, k)
    declared = getattr(proposer, "draft_step_cost", None)
    free = declared == 0 if declared is not None else isinstance(proposer, TokenProposerAdapter)
    shadow = proposer.propose_one if proposer.drafts_on_host_for_free else None  # type: ignore[attr-defined]
    latest = proposer.propose_for if free and isinstance(proposer, TokenProposerAdapter) else None
    policy = GoodputPolicy(k, free=free, shadow=shadow, stats=stats,
                           disable_by_batch_size=config.disable_by_batch_size,
                           draft_cost=None if free else declared, latest_shadow=latest,
                           cost=StepCostModel(prior_sigma=ASYNC_PRIOR_SIGMA if asynchronous else PRIOR_SIGMA,
                                              prior_restart=ASYNC_PRIOR_RESTART if asynchronous else 0.0,
                                              max_k=k, asynchronous=asynchronous))
    return Speculator(config, proposer, stats, policy, k)
