"""The finished-output queue: hand-over paid from a share of the steps' time, newest outputs kept."""

from __future__ import annotations

from tandem.spec_decode.finished_queue import FinishedQueue
from tandem.spec_decode.time_credit import TimeCredit


class Forgetter:
    """A proposer's ``forget`` that takes ``per_token`` seconds of a fake clock per token."""

    def __init__(self, per_token: float) -> None:
        self.now = 0.0
        self.per_token = per_token
        self.told: list[str] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, request_id: str, output: list[int]) -> None:
        self.told.append(request_id)
        self.now += self.per_token * len(output)


def test_host_time_spent_handing_over_stays_within_the_share_of_step_time():
    """64 requests of 256 tokens finish together every 256 steps of 2 ms (batch 64), at 1 µs per
    token: handing every output over would take 64 µs a step (3.2 %); with a 2 % share the time spent
    stays within 2 % of the steps' time (+ the saved credit and one output's overdraft), no call
    spends much more than ``call_max``, and what does not fit the queue is dropped oldest first."""
    f = Forgetter(per_token=1e-6)  # 0.26 ms an output
    q = FinishedQueue(TimeCredit(0.02, 0.004, f.clock), max_tokens=4096, call_max=0.0005)
    step = 0.002
    longest = 0.0
    for wave in range(8):
        for i in range(64):
            q.push(f"w{wave}.{i}", [7] * 256)
            assert q.num_tokens <= 4096
        for _ in range(256):
            q.earn(step)
            t0 = f.now
            q.hand_over(f)
            longest = max(longest, f.now - t0)
    assert longest <= 0.0005 + 1e-6 * 256  # a wave is spread: no call past call_max + one output
    spent = f.now
    assert spent <= 0.02 * step * 8 * 256 + 0.004 + 1e-6 * 256
    # the queue holds 4096 tokens: each wave's newest 15 outputs (257 tokens each with the +1) are kept
    # and all of them go over before the next wave; the rest are dropped unseen
    assert len(q) == 0 and q.num_dropped == 8 * 49 and len(f.told) == 8 * 15
    assert f.told == [f"w{w}.{i}" for w in range(8) for i in range(49, 64)]  # in finishing order


def test_a_lone_output_goes_over_at_once_and_drain_hands_over_everything():
    """At batch 1 an output finishes every few hundred steps: the saved credit passes it at the next
    call, whatever its length. ``drain`` passes everything and charges nothing."""
    f = Forgetter(per_token=4e-6)
    q = FinishedQueue(TimeCredit(0.02, 0.004, f.clock), max_tokens=4096)
    q.push("a", [1] * 2000)  # 8 ms: more than the whole credit
    q.hand_over(f)
    assert f.told == ["a"] and q.credit < 0
    q.push("b", [1] * 10)
    q.hand_over(f)  # in debt: waits
    assert f.told == ["a"]
    for _ in range(50):  # 50 steps of 2 ms earn 2 ms: the credit is −4 + 2 ms
        q.earn(0.002)
    q.hand_over(f)
    assert f.told == ["a"]
    for _ in range(60):
        q.earn(0.002)
    q.hand_over(f)
    assert f.told == ["a", "b"]
    q.push("c", [1] * 10)
    q.push("d", [1] * 10)
    q.credit = -1.0
    q.hand_over(f, drain=True)
    assert f.told == ["a", "b", "c", "d"] and q.credit == -1.0 and len(q) == 0 and q.num_tokens == 0


def test_the_credit_is_capped_and_the_queue_drops_its_oldest_outputs():
    q = FinishedQueue(TimeCredit(0.5, 0.01), max_tokens=30)
    for _ in range(10):
        q.earn(1.0)
    assert q.credit == 0.01
    q.earn(-5.0)  # (a negative step time earns nothing)
    assert q.credit == 0.01
    for i in range(5):
        q.push(f"r{i}", [1] * 9)  # 10 tokens each with the +1
    assert len(q) == 3 and q.num_dropped == 2 and q.num_tokens == 30
    q.push("long", [1] * 100)  # longer than the cap alone: kept (the newest output always is)
    assert len(q) == 1 and q.num_dropped == 5
    told: list[str] = []
    q.hand_over(lambda rid, out: told.append(rid))
    assert told == ["long"]


def test_the_share_binds_when_outputs_finish_faster_than_it_pays_for():
    """At 4 µs per token (1 ms an output), a batch of 64 finishing every 256 steps of 2 ms would need
    12.5 % of the steps' time: the hand-over spends its 2 % share, no more, and the backlog stays
    queued (bounded by ``max_tokens``)."""
    f = Forgetter(per_token=4e-6)
    q = FinishedQueue(TimeCredit(0.02, 0.004, f.clock), max_tokens=10**6, call_max=0.0005)
    for wave in range(8):
        for i in range(64):
            q.push(f"w{wave}.{i}", [7] * 256)
        for _ in range(256):
            q.earn(0.002)
            q.hand_over(f)
    budget = 0.02 * 0.002 * 8 * 256
    assert 0.9 * budget <= f.now <= budget + 0.004 + 4e-6 * 256
    assert len(f.told) + len(q) == 8 * 64 and q.num_dropped == 0
