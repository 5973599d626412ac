"""The goodput policy: how many draft tokens each request verifies this step (0..k), for every method.

Each step it maximises expected tokens per second over the batch,

    G(k_1..k_B) = Σ_i (1 + Σ_{j<k_i} s[i, j]) / T(B, Σ_i k_i)

with ``s[i, j]`` the survival (expected acceptance) of request i's draft slot j
(``policy_accept.py``) and T the step time (``policy_cost.py``, in units of a decode step of B
requests, plus a model-based proposer's drafting: ``policy_draft.py``, fixed plus per draft step). Because survival never
increases along a draft, the optimum takes the N best slots over the whole batch for some N: the
policy sorts the slots, evaluates G at every N (N = 0 — plain decoding — included) and keeps N* only
if it beats plain decoding by ``margin`` (5%: estimation error must not make speculation slower;
the search: ``policy_slots.py``).
So at batch 1 with repetitive text every request verifies k, and as the batch grows (each draft
token costs more of a step) or acceptance falls, k shrinks per request until nobody drafts.

Where drafts come from:

- Host proposers (n-gram, suffix; drafting free): the speculator asks for the full k for every
  request first, then the policy chooses from the *actual* drafts and the speculator truncates them.
  The whole proposal is scored against the tokens the target produced afterwards (``score_draft``:
  its longest prefix equal to the real continuation, exactly what greedy verification would have
  accepted, and the same in distribution when sampling), so a request learns its acceptance while
  it does not draft — the acceptance gate's *shadow drafts*, now part of the policy.
- Stateless host proposers (``shadow``: n-gram's ``propose_one(tokens, k)``): while decode steps run
  asynchronously (no proposal), the policy also drafts lazily from earlier prefixes, position after
  position, as the gate did, so evidence keeps coming without giving up asynchronous decode.
  Stateful host proposers (``latest_shadow``: suffix's ``propose_for(request_id, tokens, k)``) draft
  from a request's latest tokens instead (at batch >= 8 in ``background``, while the device
  computes a step). Shadows cost host time on every step, so a step gets at most
  ``shadow_per_step`` of them, ``SHADOW_RATE`` per step on average and ``SHADOW_BATCH / batch``
  at large batch (round robin over the batch), none while the guard blocks. A request never
  proposed for gets its first shadow from its latest tokens (the chain goes on from there). (The
  scoring and the shadows: ``policy_evidence.py``.)
- While nobody drafts at batch >= ``IDLE_BATCH`` (no verify nor drafting round in the last
  ``TRANSITION_SPAN`` steps: ``rationed``), that optional host work — shadows, a re-evaluation of
  the estimates after a "no", a host proposer's periodic full round — runs only while a time credit
  lasts (``time_credit.py``: 1 % of each step's wall time, shared with the speculator's hand-over of
  finished outputs) and is charged what it took. On the H200 (SmolLM2 at batch 32–64, host-bound
  steps) a suffix engine drafting next to nothing had run at 0.91–0.93× of plain decoding, n-gram
  at 0.95–0.97× (docs/performance.md §44).
- A proposal round happens only when ``wants_any`` says someone would likely draft (or a periodic
  round is due): a synchronous engine, which could propose every step, skips the proposal (the
  full lookups for the whole batch and their scoring) like an asynchronous one that chains decode
  steps — at T = 0.8 on the H200 the every-step proposals had cost 0.69–0.84× at concurrency 8–64
  with nobody drafting (docs/performance.md §32). On an asynchronous engine the question comes in
  two states: with a decode step in flight (a yes drains the pipeline, and the run of verifies it
  starts ends with a restart: ρ per run, spread over the runs' measured length) and drained, right
  after a verify (going on costs the verify alone). A host proposer's *live* draft — a pending
  proposal or shadow whose tokens the request has followed so far — stands for a match now; the
  others are weighed by how often their proposals found one. (Charging the restart to every
  verify, and the policy's own host work on each synchronous round, had held the policy at
  1.16× on HumanEval at batch 1 where drafting every step gained 1.5×; docs/performance.md §35.)
- Model-based proposers: the policy chooses k from the estimates first (the drafting costs
  forwards), and the granted drafts are scored the same way. They learn only from the rounds they
  are granted, so their estimates are optimistic where evidence is thin (``policy_accept.py``) and,
  at batch 1, a step shape with little evidence is priced at the bound below it
  (``policy_slots.py``): on the 2-core CPU the policy had kept 0.97–1.14× of an EAGLE head that
  gained 1.12–1.37× drafting every step (docs/performance.md §40).
- Drafts proposed ahead of a verify in flight (chained verifies, ``Speculator.drafts_ahead``) rest
  on its accepting every draft and emitting the token the proposer expects: their survival is
  scaled by that chance (``Candidate.weight``, from ``assumption_holds``: the request's survival
  one position past the verify's drafts), so long drafts on a shaky context are cut.

The decision uses only the estimates as they stand: outcomes may arrive one step late (asynchronous
steps) without changing anything but the freshness of the estimates. The outcome is checked as well:
the goodput guard (``policy_guard.py``) compares what the steps speculation touched delivered with
what plain decoding would have in the same time, and blocks drafting at a batch size where it lost.
A model proposer's exploration rounds are not judged: they are no choice of the estimates (their
cost is bounded by the doubling schedule), and judging them let cold first verifies block drafting
the estimates later chose.

Safety valves: ``disable_by_batch_size`` (vLLM's key: no drafts once the batch reaches it); while
no proposal is made (asynchronous decode), a proposal round is forced every ``probe_every`` steps for
host proposers without lazy shadows; a model proposer, which has no shadow drafts to learn from (a
round in which it drafts nothing tells it nothing, so none is forced: each would drain an
asynchronous pipeline), drafts the full k for up to ``EXPLORE_REQUESTS`` requests (in turn) in its
first proposal round and again once no round has drafted the full k for ``probe_every`` steps, each
time for ``EXPLORE_ROUNDS`` consecutive rounds (exploration: otherwise estimates that say "does not
pay" — or grant only a draft of 1, which teaches nothing about the later positions — could never be
corrected; a run, because the first verify after plain steps runs alone and after the head's
catch-up, and only the later ones show what drafting on costs), the interval doubling after each
exploration up to ``MAX_EXPLORE_EVERY`` and back to ``probe_every`` once the estimates alone choose
to draft the full k (a head that never pays then costs an exploration round every few thousand steps,
not every 64: with the 64-step rounds and their pipeline drains an idle EAGLE-3 head ran at 0.87× of
plain decoding on the H200, docs/performance.md §23) — past ``UNSURE_EXPLORE_EVERY`` only where the
estimates raised by ``EXPLORE_OPTIMISM`` standard errors (and charged a run's restart) say no as
well: a few explorations' outcomes are noisy, and a head whose first ones came out ~2σ low (α 0.65,
where drafting pays ~1.28×) had stayed idle for thousands of steps (§53, §54);
likewise a host proposer verifies its whole drafts once per ``verify_probe_every`` steps without a
verify when its acceptance would pay under the prior cost model (the measured cost may be an outlier
that nobody re-measures; measurements also fade with age); and when a batch-size
bucket has not timed a plain decode step for ``decode_probe_every`` steps (everyone drafting),
``decode_probe_steps`` plain steps re-measure the baseline (~1% of the steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.engine.stats import SpecStats
from tandem.spec_decode.policy_accept import MODEL_BLEND_WEIGHT, MODEL_IDLE_FORGET, MODEL_OPTIMISM, AcceptanceModel
from tandem.spec_decode.policy_cost import TRANSITION_SPAN, StepCostModel, bucket_of
from tandem.spec_decode.policy_draft import DraftCost
from tandem.spec_decode.policy_evidence import LatestShadowDraft, PendingDraft, PolicyEvidence, ShadowDraft
from tandem.spec_decode.policy_guard import GoodputGuard
from tandem.spec_decode.policy_slots import best_slots
from tandem.spec_decode.time_credit import TimeCredit

MARGIN = 0.05
PROBE_EVERY = 64
MAX_EXPLORE_EVERY = 4096  # a model proposer's exploration interval doubles up to this while it never pays
EXPLORE_REQUESTS = 4  # ... and an exploration drafts the full k for this many requests at most, in turn
EXPLORE_ROUNDS = 4  # ... in this many consecutive proposal rounds (its later verifies are steady ones)
UNSURE_EXPLORE_EVERY = 512  # ... up to this while drafting may still pay (the estimates, raised ...
EXPLORE_OPTIMISM = 3.0  # ... by this many standard errors of the engine-wide rates, say yes)
DECODE_PROBE_EVERY = 256
VERIFY_PROBE_EVERY = 256
DECODE_PROBE_STEPS = 4  # on an asynchronous engine the first one restarts the pipeline (not steady)
SHADOW_PER_STEP = 2  # lazy shadow drafts in one step, at most (each costs a host proposal and a score)
SHADOW_RATE = 0.5  # ... and per step on average at most this (one every other step at batch 1: a
#                    shadow, lookup + score, took ~0.09 ms of the H200 host's time, a ~1 ms sampled step)
SHADOW_BATCH = 8  # ... and SHADOW_BATCH / batch below that (batch 64: one every 8 steps)
WANTS_RECHECK = 4  # steps a host proposer's "nobody would draft" answer stands (batch >= 8: at least, B / 8 at
#                   batch B, new evidence or not; below 8: at most 2, until new evidence)
MODEL_RECHECK = 16  # steps a model proposer's "nobody would draft" stands without new evidence (its requests'
#                   evidence fades meanwhile: policy_accept.py's idle_forget)
# While nobody drafts at batch >= IDLE_BATCH, the policy's optional host work (shadow drafts, a
# re-evaluation of the estimates, a host proposer's periodic full round) is paid from a time credit
# (time_credit.py: a share of each step's wall time; the speculator's finished outputs share it)
IDLE_BATCH = 8
PRIOR_DRAFT_COST = 0.1  # a model-based proposer's draft step, in target decode steps, until measured

@dataclass(frozen=True)
class Candidate:
    request_id: str
    max_tokens: int  # k within the request's room (max_tokens / max_model_len)
    draft: tuple[int, ...] | None = None  # the proposal when known before choosing (host proposers)
    # the chance that the draft's context is the request's (drafts proposed ahead of a verify in
    # flight rest on the assumption that it accepts everything: ``assumption_holds``)
    weight: float = 1.0


class GoodputPolicy(PolicyEvidence):
    def __init__(self, k: int, *, free: bool, shadow: ShadowDraft | None = None, stats: SpecStats | None = None,
                 margin: float = MARGIN, disable_by_batch_size: int | None = None,
                 probe_every: int = PROBE_EVERY, decode_probe_every: int = DECODE_PROBE_EVERY,
                 decode_probe_steps: int = DECODE_PROBE_STEPS, verify_probe_every: int = VERIFY_PROBE_EVERY,
                 draft_cost: float | None = None, cost: StepCostModel | None = None,
                 acceptance: AcceptanceModel | None = None, guard: GoodputGuard | None = None,
                 shadow_per_step: int = SHADOW_PER_STEP, latest_shadow: LatestShadowDraft | None = None,
                 idle: TimeCredit | None = None) -> None:
        self.k = k
        self.free = free  # drafts are host lookups: propose the full k, then choose
        self.shadow = shadow
        # a stateful host proposer (suffix) drafts from a request's latest tokens only (its state has
        # seen them): shadows from the current position, within the same budget
        self.latest_shadow = latest_shadow if shadow is None else None
        self.stats = stats if stats is not None else SpecStats()
        self.margin = margin
        self.disable_by_batch_size = disable_by_batch_size
        self.probe_every, self.decode_probe_steps = probe_every, decode_probe_steps
        self.decode_probe_every, self.verify_probe_every = decode_probe_every, verify_probe_every
        self.cost = cost if cost is not None else StepCostModel(max_k=k)
        self.acceptance = acceptance if acceptance is not None else AcceptanceModel(k) if free else AcceptanceModel(
            k, warm_start=True, optimism=MODEL_OPTIMISM, blend_weight=MODEL_BLEND_WEIGHT, idle_forget=MODEL_IDLE_FORGET)
        self.guard = guard if guard is not None else GoodputGuard()
        self.shadow_per_step = shadow_per_step
        self.idle = idle if idle is not None else TimeCredit()  # (earned in ``on_step``)
        self._rationing = False  # this step's optional host work is paid from ``idle`` (``rationed``)
        self._shadows_left = shadow_per_step  # this step's lazy shadow budget
        self._rotation = 0  # where this step's lazy shadows start in the batch (round robin)
        self._shadow_credit = 0.0
        self._step = 0  # engine steps seen
        # wants_any's cached "no": until which step, for which bucket, with which evidence (drafts
        # scored, drafts proposed), asked drained or not
        self._no_until, self._no_batch, self._no_evidence, self._no_drained = 0, 0, (0, 0), False
        self._no_holds = False  # ... and whether new evidence leaves it standing (batch >= 8)
        self._num_proposals = 0  # drafts proposed, real and shadow (cumulative)
        self._steps_since_event = TRANSITION_SPAN + 1  # steps since a round that drafted, or a verify
        self._steps_since_round = TRANSITION_SPAN + 1  # steps since any proposal round
        # a model proposer's drafting, in decode steps (measured unless declared)
        self.draft = DraftCost(0.0 if free else (PRIOR_DRAFT_COST if draft_cost is None else draft_cost),
                               measured=draft_cost is None and not free)
        self._pending: dict[str, PendingDraft] = {}
        self._shadow_at: dict[str, int] = {}  # lazy shadows: the next position to draft from
        self._shadow_due: list[tuple[str, Sequence[int]]] = []  # latest shadows for ``background`` (id, tokens)
        self._decode_probe = 0  # plain steps left to re-measure the decode time
        self._steps_since_proposal = 0
        # model proposers: steps since any request drafted; the first round explores (full k)
        self._steps_since_draft = probe_every
        self._steps_since_full = probe_every  # ... and since a round drafted the full k for someone
        self._explore_every = probe_every  # doubles after each exploration while the estimates say no
        self._explore_turn = 0  # where the next exploration's candidates start (``_exploration``)
        self._explore_ids: frozenset[str] = frozenset()  # the exploration run under way: its requests ...
        self._explore_left = 0  # ... and its proposal rounds still to come
        # the last proposal round was an exploration (not the estimates' choice): its steps are no
        # trial of the policy, so the guard does not judge them (its cost is bounded by the schedule)
        self._exploring = False

    # ---- decisions ------------------------------------------------------------------------------
    def choose(self, batch: int, candidates: Sequence[Candidate]) -> list[int]:
        """k per candidate for a step of ``batch`` running requests (a proposal round)."""
        self._steps_since_proposal = 0
        self._steps_since_round = -1  # this step is speculation's (a round, drafted or not)
        ks = [0] * len(candidates)
        if self._off(batch):
            self._count(ks)
            return ks
        if self.cost.decode_is_stale(batch, self.decode_probe_every):
            self.cost.probing(batch)
            self._decode_probe = self.decode_probe_steps
            self._count(ks)
            return ks
        ks = self._optimise(batch, candidates)
        self._exploring = False
        full = any(x and x == c.max_tokens for x, c in zip(ks, candidates))
        if full:  # drafting pays on the estimates: explore at the base rate
            self._explore_every, self._steps_since_full, self._explore_left = self.probe_every, 0, 0
        if not self.free and not full and self._steps_since_full >= self._explore_every:
            # a model proposer has no shadow drafts: its estimates learn a position only from drafts
            # that reach it, and grants short of k (the estimates' own, where they are low) had kept
            # the later positions unexplored — after unlucky first requests an EAGLE head on the
            # packed CPU target drafted 1 token now and then for three requests (§48)
            explore = self._exploration(candidates)
            ks = [max(a, b) for a, b in zip(ks, explore)]
            self._explore_ids = frozenset(c.request_id for c, x in zip(candidates, explore) if x)
            self._explore_left = EXPLORE_ROUNDS - 1
            unsure = any(self._optimise(batch, candidates, restart=self._restart_share(batch),
                                        optimism=EXPLORE_OPTIMISM))
            self._explore_every = min(UNSURE_EXPLORE_EVERY if unsure else MAX_EXPLORE_EVERY, 2 * self._explore_every)
            self._steps_since_full = 0
            self._exploring = True
        elif self._explore_left > 0 and not full:
            # the run goes on for its requests: a verify after plain steps runs alone on an
            # asynchronous engine (the pipeline drained; the head first caught up over the gap), so
            # a one-round exploration had measured only that — the H100's fit priced a 3-draft verify
            # at 2.4-4.6 decode steps where a chained one cost 1.2, and a head that paid drafting
            # every step stayed idle (docs/performance.md §51)
            self._explore_left -= 1
            more = [c.max_tokens if c.request_id in self._explore_ids else 0 for c in candidates]
            ks = [max(a, b) for a, b in zip(ks, more)]
            self._exploring = any(more)
        elif (self.free and self._steps_since_draft >= self.probe_every
              and self.cost.verify_is_stale(batch, self.verify_probe_every)
              and any(self._optimise(batch, candidates, cost=self.cost.prior_overhead()))):
            # the measured cost says no, but it is old and the prior cost says yes: verify the
            # whole drafts once (long verifies beside short ones separate σ from β in the fit)
            ks = [min(c.max_tokens, len(c.draft or ())) for c in candidates]
        if any(ks):
            self._steps_since_draft = 0
            self._steps_since_event = -1
        self._count(ks)
        return ks

    def _exploration(self, candidates: Sequence[Candidate]) -> list[int]:
        """The full k for ``EXPLORE_REQUESTS`` candidates, the next ones in turn: an exploration's verify
        rows and the head's catch-up over the positions each request idled through grow with every
        request explored, and the engine-wide rates it informs need few outcomes."""
        n = len(candidates)
        start, m = self._explore_turn % max(n, 1), min(n, EXPLORE_REQUESTS)
        self._explore_turn = start + m
        return [c.max_tokens if (i - start) % n < m else 0 for i, c in enumerate(candidates)]

    def wants_any(self, batch: int, candidates: Sequence[Candidate] | Callable[[], Sequence[Candidate]],
                  drained: bool = False) -> bool:
        """Whether a proposal round now would likely draft for anyone (drafts unknown yet: expected
        draft lengths from the requests' history, except where a host proposer's pending draft is
        *live* — proposed from tokens the request has followed so far: a match now). False keeps
        decode steps asynchronous, and spares a synchronous step the proposal (a host proposer's
        full lookups for the whole batch, their scoring, ``choose``). ``drained``: no step is in
        flight (every token read: the engine is about to schedule), so a verify now costs σ + β n /
        B; else a round also drains the pipeline and restarts it after the run it starts (ρ,
        ``cost.restart_ratio``, spread over the run's expected verifies, ``cost.run_length``).
        Asked every step: a host proposer's "no" is kept ``max(WANTS_RECHECK, B / 8)`` steps at
        batch B ≥ 8 and, below, until new evidence (a scored or a new draft) for at most 2; a model
        proposer's until new evidence, for at most ``probe_every``; and a "no" with a step in
        flight does not answer a drained question (``candidates`` may be a function, called only
        when the estimates are consulted)."""
        if self._off(batch):
            return False
        rationed = self.rationed(batch)
        if rationed and not self.idle.available:
            return False  # the idle share is spent: the last "no" stands
        if self.free:
            if self.shadow is None and self.latest_shadow is None and self._steps_since_proposal >= self.probe_every:
                return True  # no shadows: refresh the estimates now and then
            if self._steps_since_proposal >= self.verify_probe_every:
                return True  # a real round now and then: ``choose`` may re-verify under the prior cost
        elif self._steps_since_full >= self._explore_every:
            return True  # a model proposer's exploration round is due
        elif self._explore_left > 0:  # ... or its run goes on while one of its requests does
            cands = candidates() if callable(candidates) else candidates
            if any(c.request_id in self._explore_ids for c in cands):
                return True
            self._explore_left = 0
        evidence = (self.acceptance.num_scored, self._num_proposals)
        if (self._no_until > self._step and self._no_batch == bucket_of(batch)
                and (self._no_evidence == evidence or self._no_holds) and (self._no_drained or not drained)):
            return False
        t0 = self.idle.clock()
        cands = candidates() if callable(candidates) else candidates
        if self.free and self._pending:  # live drafts: the match they came from holds so far
            pending = self._pending
            cands = [Candidate(c.request_id, c.max_tokens, p.draft)
                     if (p := pending.get(c.request_id)) is not None and p.draft else c for c in cands]
        yes = any(self._optimise(batch, cands, restart=0.0 if drained else self._restart_share(batch)))
        if rationed:
            self.idle.charge(self.idle.clock() - t0)
        if yes:
            return True
        # The estimates cost O(batch) (~0.1 ms at batch 64 on this CPU, where the lazy shadows bring
        # new evidence every few steps). A host proposer's "no" stands WANTS_RECHECK steps at batch
        # >= 8, B / 8 at batch B, so the estimates cost O(1) per step (a round starting a few steps
        # late costs little where each request's drafts are a small part of the step); below batch 8
        # (where a missed verify costs more) until new evidence, for at most 2 steps. A model
        # proposer learns only from its own drafts, so its "no" stands until a draft is scored or
        # for MODEL_RECHECK steps (its requests' evidence fades meanwhile, and the step-cost fit ages).
        hold = self.free and batch >= 8
        recheck = (max(WANTS_RECHECK, batch // 8) if hold else 2) if self.free else MODEL_RECHECK
        self._no_until, self._no_batch = self._step + recheck, bucket_of(batch)
        self._no_evidence, self._no_drained, self._no_holds = evidence, drained, hold
        return False

    def _restart_share(self, batch: int) -> float:
        """What starting a run costs per verify of it: ρ (the restart and the runs' entry) over the
        runs' expected length."""
        return self.cost.restart_ratio(batch) / self.cost.run_length(batch)

    def rationed(self, batch: int) -> bool:
        """Optional host work is paid from the idle credit: batch >= IDLE_BATCH and no verify nor
        drafting round in the last ``TRANSITION_SPAN`` steps (while drafting, decisions are due)."""
        return batch >= IDLE_BATCH and self._steps_since_event > TRANSITION_SPAN

    def charge(self, batch: int, seconds: float) -> None:
        """Host work of ``seconds`` done for the policy (a proposal round, an evaluation, a shadow):
        charged to the idle credit where it is rationed."""
        if self.rationed(batch):
            self.idle.charge(seconds)

    def off(self, batch: int) -> bool:
        """Nobody drafts at this batch size now (``disable_by_batch_size``, a decode probe, the guard):
        the speculator need not even propose. Counts the round as all-zero decisions."""
        if not self._off(batch):
            return False
        self._steps_since_proposal = 0
        return True

    def _off(self, batch: int) -> bool:
        return self._capped(batch) or self._decode_probe > 0 or not self.guard.allows(batch)

    def _capped(self, batch: int) -> bool:  # ``disable_by_batch_size``
        return self.disable_by_batch_size is not None and batch >= self.disable_by_batch_size

    def _optimise(self, batch: int, candidates: Sequence[Candidate], restart: float = 0.0,
                  cost: tuple[float, float] | None = None, optimism: float = 1.0) -> list[int]:
        """k per candidate; a candidate without a known draft is weighed with its expected reach.
        ``restart``: a pipeline restart's share per verify (ρ / run length), where the decision
        starts a run of verifies."""
        batch = max(batch, 1)
        sigma, beta = cost or self.cost.overhead(batch)  # ratio(batch, n) = 1 + max(0, sigma + beta n / batch)
        sigma += restart
        # measured steps of exactly this shape: what the line misses (the CPU's int4 kernel in 4-row blocks)
        residuals = {} if cost else self.cost.residuals(batch)
        # (policy_slots.py; at batch 1 only: a batch of B has up to B·k shapes, each tried twice when bounded)
        shape_weights = self.cost.shape_weights(batch) if residuals and not self.free and batch == 1 else None
        lengths = [min(c.max_tokens, self.k if c.draft is None else len(c.draft)) for c in candidates]
        scale = optimism / batch  # (of the acceptance model's upper-confidence bonus)
        if shape_weights is None and not self._may_pay(batch, candidates, lengths,
                                                       sigma + min([0.0, *residuals.values()]), beta, scale):
            return [0] * len(candidates)
        # (reach is a host proposer's; a model proposer's drafts are as long as granted: weighing by
        # that had made each grant below k shrink the next, and EAGLE's k-th draft was never granted)
        surv = self.acceptance.survival_matrix([c.request_id for c in candidates],
                                               [self.free and c.draft is None for c in candidates], scale)
        for row, c in zip(surv, candidates):
            if c.weight != 1.0:
                row[:] = [v * c.weight for v in row]
        return best_slots(batch, surv, lengths, sigma, beta, residuals, shape_weights, self.draft, self.margin)

    def _may_pay(self, batch: int, candidates: Sequence[Candidate], lengths: Sequence[int], sigma: float,
                 beta: float, scale: float) -> bool:
        """A cheap bound: with every slot as good as the best one (survival ≤ s_max), G(N) ≤
        (B + N s_max) / (1 + σ + β N / B), monotone in N, so its largest value over N ≥ 1 is at N = 1
        or at N = all slots. If neither beats plain decoding by the margin, nothing can. (``sigma``
        already holds the most negative per-shape correction, so the bound stays one.)"""
        total = sum(lengths)
        if total == 0:
            return False
        s_max = max((self.acceptance.first_survival(c.request_id, self.free and c.draft is None, scale) * c.weight
                     for c, n in zip(candidates, lengths) if n), default=0.0)
        need = (1.0 + self.margin) * batch
        for n in (1, total):
            ratio = 1.0 + max(0.0, sigma + beta * n / batch)
            if (batch + n * s_max) / (ratio + self.draft.of(1 if n == 1 else max(lengths))) >= need:
                return True
        return False

    def assumption_holds(self, request_id: str, num_drafts: int) -> float:
        """The chance that a verify of ``num_drafts`` drafts of this request accepts them all and
        emits the token its proposer expects next (what drafts proposed ahead of it assume): the
        survival through position ``num_drafts``, a position past k taken at the last one's rate."""
        rates = self.acceptance.rates(request_id)  # (k >= 1 rates)
        p = 1.0
        for j in range(num_drafts + 1):
            p *= rates[min(j, len(rates) - 1)]
        return p

    def _count(self, ks: Sequence[int]) -> None:
        self.stats.record_choices(ks, self.k)

    def on_step(self, batch: int, num_query_tokens: int, seconds: float, draft_seconds: float = 0.0,
                draft_steps: int = 0, timed: bool = True, steady: bool = True,
                num_tokens: int | None = None) -> None:
        """One engine step: ``batch`` requests, ``num_query_tokens`` query tokens, its wall time (of
        which ``draft_seconds`` drafting ``draft_steps`` tokens deep); ``timed`` False for steps the
        cost model must not learn from (prefill, mixed); ``steady`` False for a plain step that
        drained or restarted an asynchronous pipeline; ``num_tokens`` the tokens it emitted (the
        guard's evidence; None: not known)."""
        self._steps_since_proposal += 1
        self._steps_since_draft += 1
        self._steps_since_full += 1
        if self._decode_probe:
            self._decode_probe -= 1  # a probe lasts its steps, timed or not
        self._step += 1
        self.guard.tick()
        self.acceptance.tick()
        self.idle.earn(seconds)
        self._rationing = self.rationed(batch)
        if self.shadow is not None or self.latest_shadow is not None:
            # lazy shadows: a budget per step (fewer at large batch, where one costs more of a step
            # than it tells: engine-wide rates need few samples), none while the guard blocks this
            # batch size or ``disable_by_batch_size`` switches it off (nobody drafts: host work for
            # nothing), nor while the idle share is spent (``rationed``)
            rate = min(float(self.shadow_per_step), SHADOW_RATE, SHADOW_BATCH / max(batch, 1))
            self._shadow_credit = min(float(self.shadow_per_step), self._shadow_credit + rate)
            allowed = (self.guard.allows(batch) and not self._capped(batch)
                       and (not self._rationing or self.idle.available))
            self._shadows_left = int(self._shadow_credit) if allowed else 0
            self._shadow_credit -= self._shadows_left
        verify = timed and num_query_tokens > batch  # (a prefill's tokens are no drafts)
        self._steps_since_event = 0 if verify else self._steps_since_event + 1
        self._steps_since_round += 1
        if not timed:
            return
        verify_seconds = seconds - (draft_seconds if not self.free else 0.0)
        self.cost.observe(batch, num_query_tokens, verify_seconds, steady)
        # the guard's evidence: every step speculation touched — verifies, rounds that drafted, the
        # steps after them, and a round that drafted nothing where it drained an asynchronous
        # pipeline (its steps are then not steady). On a synchronous engine such a round is a plain
        # step: judging it would let timing noise around E = 1 block drafting.
        touched = (self._steps_since_event <= TRANSITION_SPAN
                   or (not steady and self._steps_since_round <= TRANSITION_SPAN))
        if num_tokens is not None and touched and not self._exploring:
            self.guard.observe(batch, num_tokens, seconds, self.cost.decode_seconds(batch))
        if draft_steps > 0 and draft_seconds > 0:
            d = self.cost.decode_seconds(batch)
            if d:
                self.draft.observe(draft_steps, draft_seconds / d)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        if self._shadow_due:
            self._shadow_due = [d for d in self._shadow_due if d[0] != request_id]
        self._shadow_at.pop(request_id, None)
        self.acceptance.forget_request(request_id)
