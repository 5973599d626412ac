"""LLMEngine: requests in, RequestOutputs out, one ``step()`` at a time.

A step is a pipeline of typed stages (vLLM V1's shape)::

    speculator.drafts_for(running)                  drafts for the next verify (all tokens read)
    sched = scheduler.schedule()                    SchedulerOutput: who runs, which query tokens
    out = executor.execute(sched)                   ModelRunnerOutput: one forward, (rejection) sampling
    scheduler.update_from_output(sched, out)        rollback of rejected drafts by count
    outputs = output_processor.process(sched, out)  detokenize, stops, RequestOutputs
    speculator.observe(record)                      counters, goodput policy
    (speculator.background(), while the device computes a step: finished outputs to the proposer)

Speculation is inside the continuous batch: a request with drafts contributes k + 1 sampled rows,
one without contributes 1, and prefill chunks, decodes and verifies ride in the same forward. An
EAGLE head's drafts may stay on the device until the verify is launched (``executor.start`` feeds
them, ``speculator.resolve_drafts`` reads them, ``executor.finish`` verifies: spec_decode/device_drafts.py).

Asynchronous decode is the same path with tokens left on the device (engine/async_decode.py): a
steady decode step (greedy or sampled on the device) is launched (``executor.launch``) and its requests carry output
placeholders (``scheduler.add_output_placeholders``); while every running request's placeholder
decode qualifies and the speculator says no request will draft, the next step is scheduled by the
same ``schedule()``, launched with the placeholders' ids fed on the device, and only then is the
previous step read — a step() call then reads one step and launches the next. A greedy verify with
a host proposer's drafts (n-gram, suffix) or an EAGLE head's is launched the same way, and the step
after it is drafted before it is read (``speculator.drafts_ahead``: a host proposer from the
assumption that it accepts everything, an EAGLE head on the device from its outcome there) and
launched (a chained verify: engine/async_decode.py). Another verify step (which runs synchronously) has
its tokens applied at once (``output_processor.apply``: stops decided, so
the next step can be proposed and scheduled) and its text decoded by the next step() call once that
call has launched its own step (``output_processor.flush``), so detokenizing overlaps the device's
work; its outputs come one step() call later.

Construction lives in engine/builder.py, request validation in engine/input_processor.py. A
request's failure (prompt too long, bad token ids) is reported for that request only; the engine and
the other requests go on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from tandem.config import EngineConfig
from tandem.config.speculative import SpeculativeConfig
from tandem.engine.async_decode import InflightStep, can_schedule_ahead, launchable
from tandem.engine.builder import build_engine
from tandem.engine.executor import Executor
from tandem.engine.input_processor import InputProcessor
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.stats import PeriodicLogger
from tandem.errors import RequestError
from tandem.kv.block_pool import ResetResult
from tandem.outputs import ModelRunnerOutput, RequestOutput
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.scheduler import SchedulerOutput
from tandem.spec_decode.policy import GoodputPolicy
from tandem.spec_decode.speculator import AnySpeculator, build_speculator
from tandem.spec_decode.step_record import StepKind, StepRecord, StepRows, step_kind

logger = logging.getLogger("tandem")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        p = build_engine(config)
        self.config = config
        self.device, self.dtype, self.arch, self.tokenizer = p.device, p.dtype, p.arch, p.tokenizer
        self.max_model_len, self.eos_token_ids = p.max_model_len, p.eos_token_ids
        self.block_size = config.cache.block_size
        self.generator = p.generator
        self.model, self.runner, self.num_blocks, self.pool = p.model, p.runner, p.num_blocks, p.pool
        self.scheduler, self.stats = p.scheduler, p.stats
        self.proposer = p.proposer  # kept while speculation is switched off (``spec``)
        self.draft_limit = p.draft_limit  # the target runner's (builder.draft_limit)
        # Decode steps may run asynchronously (settable between runs; benchmarks compare both).
        self.async_scheduling = p.async_scheduling
        self.executor = Executor(self.runner, self.generator)
        self.input_processor = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                              self.eos_token_ids)
        self.output_processor = OutputProcessor(p.decoder, self.stats, self._finish)
        self._use(p.speculator)
        self._log = PeriodicLogger() if config.log_stats else None
        self._ids = itertools.count()
        self._inflight: InflightStep | None = None  # a launched step whose tokens are unread
        self._finished: list[Request] = []  # requests finished since the speculator last heard
        self.num_chained_steps = 0  # steps launched before the previous step's tokens were read
        self.num_chained_verifies = 0  # ... of which verifies (drafts proposed before that read)

    # ---- speculation ---------------------------------------------------------------------------
    def _use(self, speculator: AnySpeculator) -> None:
        self.speculator = speculator
        self.executor.synthetic_acceptance_rate = speculator.synthetic_acceptance_rate
        self.output_processor.synthetic = speculator.synthetic_acceptance_rate is not None

    @property
    def spec(self) -> SpeculativeConfig | None:
        return self.speculator.config

    @spec.setter
    def spec(self, config: SpeculativeConfig | None) -> None:
        """Switch speculation between runs (benchmarks): the proposer, KV lookahead and token budget
        built at engine start stay; ``None`` turns speculation off. (The old speculator hands its
        queued finished outputs to the proposer first.)"""
        self.speculator.background(drain=True)
        self._use(build_speculator(config, self.proposer, self.stats.spec, self.device,
                                   asynchronous=self.async_scheduling, draft_limit=self.draft_limit))

    @property
    def policy(self) -> GoodputPolicy | None:
        """The speculator's goodput policy (spec_decode/policy.py), if on."""
        return self.speculator.policy

    # ---- requests ------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def encode(self, prompt: str) -> list[int]:
        return self.input_processor.encode(prompt)

    def add_request(self, request_id: str, prompt: str | Sequence[int] | None, params: SamplingParams,
                    prompt_token_ids: Sequence[int] | None = None) -> None:
        """Queue a request. Raises RequestError (or a subclass) if this request cannot be served."""
        if request_id in self.output_processor.groups:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        new = self.input_processor.process(request_id, prompt, params, prompt_token_ids)
        self.output_processor.add(new)
        for c in new.children:
            self.scheduler.add(c)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their outputs come with the next step."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> ResetResult:
        """Forget every cached block no request holds (prefix caching; thread-safe: the pool locks).

        ``complete`` (vLLM's success) iff no block was in use; otherwise the blocks held by running
        requests keep their hashes and the result says how many.
        """
        result = self.pool.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached free blocks dropped, %d blocks in use (%d still cached)",
                    result.evicted_blocks, result.held_blocks, result.held_cached_blocks)
        return result

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs of the requests it advanced (and of aborted ones).
        With a step in flight: launch the next one if it may run ahead, then read the one in flight;
        otherwise: draft, schedule, then execute (or launch, and continue as with a step in flight)."""
        t0 = time.perf_counter()
        outputs = self.output_processor.take_aborted()
        rows = StepRows() if self.speculator.observes else None  # (its step record; a plain engine builds none)
        prev, self._inflight = self._inflight, None
        # drafts read from the device: a chained proposal's, fed to the verify in flight
        fed = self.speculator.resolve_drafts() if self.speculator.device_drafts is not None else {}
        if prev is not None and prev.finished:
            prev = None  # every request of the step in flight finished or was aborted meanwhile
        chained = prev is not None  # launched by the previous call, ahead of its read
        ahead = False
        kind = StepKind.VERIFY if prev is not None and prev.verifies else StepKind.DECODE
        timed = prev.sched if prev is not None else None  # the step this call reads
        if prev is None:
            self._propose()
            sched = self._schedule()
            kind, timed = step_kind(sched), sched
            if self.async_scheduling and launchable(sched, verifies=self.speculator.chains):
                prev = self._launch(sched)
                outputs += self.output_processor.flush()
            elif not sched.empty:
                self.stats.num_steps += 1
                launched = self.executor.start(sched, self.speculator.device_drafts)
                outputs += self.output_processor.flush()  # the previous verify's text, while this step runs
                self.speculator.resolve_drafts()  # drafts left on the device: read once the verify is queued
                self.speculator.background()  # (host work that may wait, while the step runs)
                out = self.executor.finish(launched)
                self.scheduler.update_from_output(sched, out)
                self._apply(sched, out, rows, kind is StepKind.VERIFY)
            fed = self.speculator.resolve_drafts() or fed  # (a launched verify's; else none left)
        if prev is not None:
            prev = prev.resolved(fed)  # (drafts fed to it on the device: read by now)
            nxt = None
            if prev.verifies and self._can_chain():
                self._propose_ahead(prev)
                nxt = self._schedule()
            elif self._can_schedule_ahead():
                nxt = self._schedule()
            if nxt is not None and not nxt.empty:  # (empty only if every request was preempted)
                self._inflight = self._launch(nxt, feed=prev)
                self.num_chained_steps += 1
                self.num_chained_verifies += self._inflight.verifies
                ahead = True
            outputs += self.output_processor.flush()
            self.speculator.background()
            out = prev.read()  # the host sync
            if prev.verifies:
                self.scheduler.settle_launched(prev.sched, out)
            self._apply(prev.sched, out, rows, prev.verifies)
        if kind is not StepKind.VERIFY or not self.async_scheduling:
            outputs += self.output_processor.flush()  # else: the next step() flushes once it has launched
        finished, self._finished = tuple(self._finished), []
        size = (len(timed.scheduled), timed.num_batched_tokens) if timed is not None else (0, 0)
        # steady: what a plain engine would have run (a pipeline drain or restart is not)
        steady = not self.async_scheduling or not (chained or ahead) or (chained and ahead)
        if rows is not None:
            self.speculator.observe(StepRecord.of(kind, time.perf_counter() - t0, rows, finished, *size,
                                                  steady=steady))
        if self._log is not None:
            self._log.maybe_log(self.stats, self.num_running, self.num_waiting, self.kv_usage)
        return outputs

    def _propose(self) -> None:
        """Drafts for the next step (every token is on the host here)."""
        drafts = self.speculator.drafts_for(self.scheduler.running)
        if drafts:
            for r in self.scheduler.running:
                d = drafts.get(r.request_id)
                if d is not None:
                    r.spec_token_ids, r.spec_probs = list(d.token_ids), d.probs

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        pc = self.scheduler.prefix_cache.stats  # prefix caching: token counts, cumulative
        self.stats.prefix_cache_queries, self.stats.prefix_cache_hits = pc.queries, pc.hits
        return sched

    def _launch(self, sched: SchedulerOutput, feed: InflightStep | None = None) -> InflightStep:
        """Run a decode step, leaving its tokens on the device as placeholders."""
        self.stats.num_steps += 1
        step = self.executor.launch(sched, feed, self.speculator.device_drafts)
        self.scheduler.add_output_placeholders(sched)
        return step

    def _can_chain(self) -> bool:
        """The next step may be scheduled and launched before the verify in flight is read, with
        drafts (a chained verify: the speculator drafts from what that verify would leave if it
        accepted everything and emitted the token the proposer expects) or without. (Not on a
        decode in flight: guessing its token too made most such drafts fail on the H200 —
        HumanEval at batch 1 fell from 1.22x to 1.11x; docs/performance.md §37.)"""
        s = self.scheduler
        return self.speculator.chains and can_schedule_ahead(s.running, s.admission_open())

    def _propose_ahead(self, prev: InflightStep) -> None:
        """Drafts for the step after the verify in flight (``Speculator.drafts_ahead``); none unless
        every running request is greedy (its drafts are checked on the device). No row needs host
        logits processing: the launched verify's rows were checked at their known output positions
        (``launchable``), the chained rows come at those positions or later, and such processing
        (``min_tokens``) only ever ends."""
        running = self.scheduler.running
        drafts = {}
        if all(r.params.greedy for r in running):
            drafts = self.speculator.drafts_ahead(running, prev.chained_from(running))
        for r in running:
            d = drafts.get(r.request_id)
            r.spec_token_ids = list(d.token_ids) if d is not None else []

    def _can_schedule_ahead(self) -> bool:
        """The next step may be scheduled and launched before the step in flight is read."""
        s = self.scheduler
        return (self.async_scheduling and can_schedule_ahead(s.running, s.admission_open())
                and not self.speculator.will_draft(s.running))

    def _apply(self, sched: SchedulerOutput, out: ModelRunnerOutput, rows: StepRows | None, verifies: bool) -> None:
        if rows is not None:
            rows.add(sched.scheduled, out.sampled_token_ids, out.num_accepted, verifies)
        self.output_processor.apply(sched, out)

    def _finish(self, r: Request, status: RequestStatus) -> None:
        self.scheduler.finish(r, status)
        self.stats.request_success[status.value] = self.stats.request_success.get(status.value, 0) + 1
        self._finished.append(r)
