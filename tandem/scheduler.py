"""Token-budget scheduler: no prefill/decode phases, one rule for everything.

Each step every scheduled request gets ``num_new_tokens`` query tokens so that its
``num_computed_tokens`` catches up with ``num_tokens_with_spec`` (prompt + output + drafts), under
a per-step token budget (``max_num_batched_tokens``) and ``max_num_seqs``. That single rule covers
chunked prefill (a long prompt takes several steps), decode (1 token), verification of k drafts
(k + 1 tokens), and recompute after preemption (num_computed_tokens reset to 0).

Order: running requests first (FCFS by admission), then waiting ones, FCFS. When KV blocks run out,
the most recently admitted running request is preempted (blocks freed, recompute later) and put at
the front of the waiting queue — nothing is lost, nothing crashes. ``lookahead`` extra slots per
request are reserved for a draft model's KV writes of the next proposal.

Results come back through ``update_from_output`` (a step whose tokens are on the host:
``num_computed_tokens = start + num_new - rejected``, drafts consumed) or, for a step launched with
its tokens left on the device (asynchronous decode), ``add_output_placeholders``: its query tokens
count as computed and each sampling request carries one output placeholder — a token of
``num_tokens`` whose id the host does not know yet. The next ``schedule()`` then schedules that
placeholder's decode like any other token (same budget, KV allocation and preemption rules); the
executor feeds its id on the device. A preempted request keeps its placeholder until it is read.

Admission in groups (``admission_group`` G > 1; ``SchedulerConfig.admission_group``): while some
requests run and more wait than there are free seats, waiting requests are admitted only once G
seats are free (or after G steps of waiting with a free seat). A step that admits carries prefill
tokens, which on CUDA runs eagerly and breaks the asynchronous decode chain; admitting G at once
leaves the steps between as chained graph replays. A queue that fits in the free seats is admitted
at once, so nothing waits for company that is not coming.

Prefix caching (``kv/prefix_cache.py`` has the rules): at the start of every ``schedule()`` — and
before any request's blocks are released — the blocks that the last step filled with computed KV
are registered in the cache. A waiting request (new or preempted) is admitted with the longest
chain of cached full blocks for its tokens: ``num_computed_tokens`` starts at the hit length (at
most ``num_tokens - 1``, block-aligned) and only the rest is scheduled. Freed blocks stay cached
(evictable) until their memory is needed, so a preempted request usually gets its own blocks back.

Pure Python over Request objects and a BlockPool: testable without weights.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.kv.block_pool import BlockPool
from tandem.kv.prefix_cache import PrefixCache
from tandem.outputs import ModelRunnerOutput
from tandem.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # query tokens this step (includes scheduled drafts)
    start: int  # num_computed_tokens before the step = position of the first query token
    spec_token_ids: tuple[int, ...]  # drafts included among the query tokens (trailing)
    samples: bool  # the step reaches the end of the request's tokens (+ drafts), so it samples


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...]
    num_batched_tokens: int

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, lookahead: int = 0,
                 enable_prefix_caching: bool = False, admission_group: int = 1) -> None:
        self.pool = pool
        self.prefix_cache = PrefixCache(pool, block_size, enable_prefix_caching and pool.enable_caching)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.lookahead = lookahead
        self.admission_group = admission_group
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._deferred_steps = 0  # steps a waiting request could have been admitted but was not (groups)

    # ---- queue management ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished, drop from the queues and free its KV blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._free(req, finished=True)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def admission_open(self) -> bool:
        """The next ``schedule()`` admits waiting requests (if the KV blocks and the token budget allow):
        a seat is free, and nothing runs, or the queue fits in the free seats, or ``admission_group``
        seats are free, or admission has been deferred for ``admission_group`` steps."""
        free = self.max_num_seqs - len(self.running)
        if not self.waiting or free <= 0:
            return False
        return (not self.running or free >= min(self.admission_group, len(self.waiting))
                or self._deferred_steps >= self.admission_group)

    def _free(self, req: Request, finished: bool) -> None:
        if req.block_ids:
            self.prefix_cache.register(req)  # blocks completed by the last step stay reusable
            self.pool.free(req.block_ids)
            req.block_ids = []
        self.prefix_cache.released(req, finished)

    def _num_blocks_for(self, num_tokens: int) -> int:
        total = min(num_tokens, self.max_model_len + self.lookahead)
        return -(-total // self.block_size)

    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, self._num_blocks_for(num_tokens) - len(req.block_ids))

    def _try_allocate(self, req: Request, num_tokens: int) -> bool:
        need = self._blocks_needed(req, num_tokens)
        if need == 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        # A placeholder stays: its token is valid (computed from this request's KV before the
        # blocks were freed) and is appended when read; the recompute then covers it.
        self.running.remove(req)
        self._free(req, finished=False)
        req.num_computed_tokens = 0
        req.draft_num_computed = 0
        req.spec_token_ids = []
        req.spec_probs = None
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        for req in self.running:
            self.prefix_cache.register(req)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            lookahead = self.lookahead if req.num_computed_tokens + num_new >= req.num_tokens else 0
            while not self._try_allocate(req, req.num_computed_tokens + num_new + lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                continue  # it was the victim; `i` now points past the end or at the next one
            scheduled.append(self._make(req, num_new))
            budget -= num_new
            i += 1

        admit = not preempted and self.admission_open()
        if self.waiting and len(self.running) < self.max_num_seqs:
            self._deferred_steps = 0 if admit else self._deferred_steps + 1
        if admit:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hits = self.prefix_cache.lookup(req)
                num_computed = len(hits) * self.block_size  # <= num_tokens - 1: something to compute
                num_new = min(req.num_tokens - num_computed, budget)
                lookahead = self.lookahead if num_computed + num_new >= req.num_tokens else 0
                need = self._num_blocks_for(num_computed + num_new + lookahead) - len(hits)
                blocks = self.pool.take(hits, need)
                if blocks is None:
                    break
                req.block_ids = blocks
                req.num_computed_tokens = num_computed
                if hits:
                    # The draft model has no KV for the prefix: it recomputes it (rewriting identical
                    # values into the shared blocks; see kv/prefix_cache.py).
                    req.draft_num_computed = 0
                self.prefix_cache.admitted(req, hits)
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append(self._make(req, num_new))
                budget -= num_new

        return SchedulerOutput(
            scheduled=tuple(scheduled),
            preempted=tuple(preempted),
            num_batched_tokens=self.max_num_batched_tokens - budget,
        )

    def _make(self, req: Request, num_new: int) -> ScheduledRequest:
        # Drafts are the trailing query tokens; a budget cut drops the tail drafts.
        end = req.num_computed_tokens + num_new
        num_spec = max(0, end - req.num_tokens)
        if num_spec < len(req.spec_token_ids):
            req.spec_token_ids = req.spec_token_ids[:num_spec]
            if req.spec_probs is not None:
                req.spec_probs = req.spec_probs[:num_spec]
        return ScheduledRequest(req, num_new, req.num_computed_tokens, tuple(req.spec_token_ids),
                                samples=end == req.num_tokens_with_spec)

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """A step's tokens are on the host: each request's query tokens are computed, except its
        rejected drafts, which roll back by count (their KV slots are overwritten later); drafts are
        consumed. Appending the sampled tokens (with stop checks) is the output processor's job."""
        for s, accepted in zip(sched.scheduled, out.num_accepted):
            r = s.request
            num_spec = len(s.spec_token_ids)
            r.num_computed_tokens = s.start + s.num_new_tokens - (num_spec - accepted)
            if s.samples:
                r.spec_token_ids = []
                r.spec_probs = None
            if num_spec:
                r.num_drafts += 1
                r.num_draft_tokens += num_spec
                r.num_accepted_tokens += accepted

    def add_output_placeholders(self, sched: SchedulerOutput) -> None:
        """A step was launched with its sampled tokens left on the device: its query tokens count
        as computed now, and each request that samples carries output placeholders until its
        tokens are read (``Request.append_token``), so the next step can be scheduled before that —
        one, and for a verify of k drafts k + 1, as if it accepted them all (``settle_launched``
        takes back what it rejected); its drafts are consumed."""
        for s in sched.scheduled:
            r = s.request
            r.num_computed_tokens = s.start + s.num_new_tokens
            if s.samples:
                r.num_output_placeholders += 1 + len(s.spec_token_ids)
                if s.spec_token_ids:
                    r.spec_token_ids = []
                    r.spec_probs = None

    def settle_launched(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """A launched verify was read: each request's rejected drafts are taken back — placeholders
        and computed positions, by count (a step chained meanwhile was packed past them and moved
        back on the device by as much) — before its tokens are appended. A preempted request keeps
        its reset count; a finished one is left alone."""
        for s, accepted in zip(sched.scheduled, out.num_accepted):
            num_spec = len(s.spec_token_ids)
            if not num_spec:
                continue
            r = s.request
            r.num_drafts += 1
            r.num_draft_tokens += num_spec
            r.num_accepted_tokens += accepted
            if r.status.finished:
                continue
            rejected = num_spec - accepted
            r.num_output_placeholders -= rejected
            if r.status is RequestStatus.RUNNING:
                r.num_computed_tokens -= rejected

    def running_requests(self) -> Iterable[Request]:
        return iter(self.running)
