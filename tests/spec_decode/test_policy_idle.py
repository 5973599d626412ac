"""While nobody drafts at batch >= 8, the goodput policy's optional host work — lazy shadow drafts,
re-evaluations of its estimates, a host proposer's periodic full round — is paid from a time credit
(spec_decode/time_credit.py) that the speculator's finished-output queue shares: on a host-bound
engine (SmolLM2 at batch 8–64 on an H100, docs/performance.md §43) every microsecond of it slowed
steps where nobody drafted. While drafting (a verify in the last steps) decisions are due: no
rationing."""

from __future__ import annotations

from tandem.config.speculative import SpeculativeConfig
from tandem.engine.stats import SpecStats
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.base import DraftProposal
from tandem.spec_decode.policy import IDLE_BATCH, Candidate, GoodputPolicy
from tandem.spec_decode.policy_accept import AcceptanceModel
from tandem.spec_decode.proposers import TokenProposerAdapter
from tandem.spec_decode.speculator import ROUND_CALL_MAX, Speculator
from tandem.spec_decode.step_record import NO_DRAFT
from tandem.spec_decode.time_credit import TimeCredit

STEP = 1.4e-3  # a batch-32 step of SmolLM2 on the H100 (§43)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_idle_host_work_stays_within_the_share():
    """Shadows of 200 µs, evaluations of 300 µs and proposal rounds of 320 µs at batch 32, where the
    estimates say nobody would draft: without the credit (shadows every 4th step, a "no" re-checked
    every 4 steps) ~125 µs a 1.4 ms step, 9 %; with it at most the share, the saved credit and one
    overdraft — and evidence still comes."""
    clock = Clock()

    def shadow(tokens, k):
        clock.t += 200e-6
        return [1] * k  # never matches: nobody would draft

    def candidates():
        clock.t += 300e-6
        return [Candidate(rid, 3) for rid in tokens]

    credit = TimeCredit(share=0.01, credit_max=0.004, clock=clock)
    policy = GoodputPolicy(3, free=True, shadow=shadow, shadow_per_step=4, idle=credit,
                           acceptance=AcceptanceModel(3, prior=0.0))
    batch = 32
    tokens = {f"r{i}": [0] * 10 for i in range(batch)}
    policy.on_step(batch, batch, STEP, timed=False)  # (an engine's first step: its budgets)
    host = total = most = 0.0
    for step in range(2000):
        t0 = clock.t
        for toks in tokens.values():
            toks.append(step % 5 + 2)
        if policy.wants_tokens:
            policy.on_step_tokens(list(tokens.items()))
        if policy.wants_any(batch, candidates):  # a periodic round: the speculator's full lookups
            t1 = clock.t
            clock.t += batch * 10e-6
            for rid, toks in tokens.items():
                policy.proposed(rid, len(toks), [1, 1, 1])
            policy.charge(batch, clock.t - t1)
            assert not any(policy.choose(batch, [Candidate(rid, 3, (1, 1, 1)) for rid in tokens]))
        spent = clock.t - t0
        host, most = host + spent, max(most, spent)
        total += STEP + spent
        clock.t += STEP
        policy.on_step(batch, batch, STEP + spent)
    assert host <= 0.01 * total + 0.004 + most and most < 1.5e-3, (host, total, most, credit.credit)
    assert host >= 0.005 * total  # (the share is used, not starved)
    assert policy.stats.num_shadow_drafts >= 20 and policy.acceptance.num_scored >= 20


def test_no_rationing_below_batch_8_or_while_drafting():
    """Below ``IDLE_BATCH`` and within two steps of a verify, the estimates are consulted whatever
    the credit; a plain stretch at batch 32 with the credit spent keeps the last "no" standing."""
    clock = Clock()
    asked: list[int] = []

    def candidates(batch):
        def f():
            asked.append(batch)
            return [Candidate(f"r{i}", 3) for i in range(batch)]
        return f

    policy = GoodputPolicy(3, free=True, stats=SpecStats(), idle=TimeCredit(0.01, 0.004, clock))
    policy.idle.credit = -1.0  # spent
    for _ in range(8):
        policy.on_step(IDLE_BATCH - 1, IDLE_BATCH - 1, STEP)
    assert not policy.rationed(IDLE_BATCH - 1) and policy.rationed(32)
    policy.wants_any(IDLE_BATCH - 1, candidates(IDLE_BATCH - 1))
    assert asked == [IDLE_BATCH - 1]
    policy.wants_any(32, candidates(32))
    assert asked == [IDLE_BATCH - 1]  # rationed, spent: not consulted
    policy.on_step(32, 32 + 8, 2 * STEP)  # a verify: drafting
    assert not policy.rationed(32)
    policy.wants_any(32, candidates(32), drained=True)
    assert asked == [IDLE_BATCH - 1, 32]
    for _ in range(3):
        policy.on_step(32, 32, STEP)
    assert policy.rationed(32)


def test_a_prefill_is_no_verify():
    """A prefill step has more query tokens than requests but drafts nothing: the steps after it are
    not speculation's (still rationed, and not judged by the goodput guard)."""
    policy = GoodputPolicy(3, free=True, stats=SpecStats())
    for _ in range(4):
        policy.on_step(32, 32, STEP)
    assert policy.rationed(32)
    policy.on_step(32, 32 * 200, 40 * STEP, timed=False)  # admitted requests' prompts
    for _ in range(12):
        assert policy.rationed(32)
        policy.on_step(32, 32, 3 * STEP, num_tokens=32)  # slow plain steps (the pipeline restarting)
    assert policy.guard.efficiency(32) is None and policy.guard.num_blocks == 0


def test_a_round_while_nobody_drafts_asks_in_turn_within_its_time():
    """A host proposer's periodic round at batch 32 while nobody drafts: lookups of 0.4 ms each (a
    suffix proposer building request indexes) stop once ``ROUND_CALL_MAX`` is spent; the requests
    not asked get no draft and come first in the next round."""
    clock = Clock()
    asked: list[str] = []

    class Slow:
        drafts_on_host_for_free = False

        def propose(self, inputs):
            clock.t += 4e-4
            asked.extend(i.request_id for i in inputs)
            return DraftProposal([[] for _ in inputs])

        def forget(self, request_id, output):
            pass

    policy = GoodputPolicy(3, free=True, stats=SpecStats(), idle=TimeCredit(0.01, 0.004, clock),
                           acceptance=AcceptanceModel(3, prior=0.0), verify_probe_every=4)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3), TokenProposerAdapter(Slow()),
                      SpecStats(), policy)
    reqs = []
    for i in range(32):
        r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=50), (0,), 64, token_ids=[1, 2, 3, 4, 5])
        r.num_computed_tokens, r.status = 4, RequestStatus.RUNNING
        reqs.append(r)
    per_round = int(ROUND_CALL_MAX / 4e-4) + 1  # (the lookup that crosses the limit finishes)
    for n in range(2):
        for _ in range(4):
            policy.on_step(32, 32, STEP)
        spec._new_tokens.update(r.request_id for r in reqs)  # (they all got tokens: observe)
        assert policy.rationed(32)
        drafts = spec.drafts_for(reqs)
        assert asked == [f"r{i}" for i in range((n + 1) * per_round)]
        assert set(drafts) == {r.request_id for r in reqs} and set(drafts.values()) == {NO_DRAFT}
