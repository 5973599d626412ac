"""The goodput policy on a stand-in for the asynchronous engine (tests/async_sim.py: fixed target streams,
the real n-gram proposer, the engine's step logic, the H200's batch-1 step costs): a verify runs
synchronously at ~1.7 chained decode steps, and leaving or re-entering the chain of decode steps
costs a pipeline restart. The policy must draft in runs where the text repeats (close to drafting
every step, far above plain decoding), and cost nothing where it never does."""

from __future__ import annotations

import random

import pytest

from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.policy import GoodputPolicy
from tandem.spec_decode.policy_cost import ASYNC_PRIOR_RESTART, ASYNC_PRIOR_SIGMA, StepCostModel

from async_sim import H200_BATCH1, AsyncSim, code_like_stream

K = 4


def _policy() -> GoodputPolicy:
    ng = NgramProposer(1, 4, K)
    return GoodputPolicy(K, free=True, shadow=ng.propose_one,
                         cost=StepCostModel(prior_sigma=ASYNC_PRIOR_SIGMA, prior_restart=ASYNC_PRIOR_RESTART, max_k=K))


def _drafting_every_step_and_policy(seed: int, length: int, copy: float) -> tuple[AsyncSim, AsyncSim]:
    stream = code_like_stream(random.Random(seed), length, copy=copy)
    return (AsyncSim(None, [stream], 64, H200_BATCH1).run(), AsyncSim(_policy(), [stream], 64, H200_BATCH1).run())


@pytest.mark.parametrize("seed", range(3))
def test_repetitive_text_drafts_in_runs_close_to_every_step(seed):
    every, sim = _drafting_every_step_and_policy(seed, 2400, copy=0.9)
    plain = H200_BATCH1.decode
    assert sim.seconds_per_token() < plain / 1.3
    assert sim.seconds_per_token() < every.seconds_per_token() / 0.9
    assert sim.steps["verify"] > 5 * sim.steps["restart"]  # runs of verifies, one restart each


@pytest.mark.parametrize("seed", range(2))
def test_text_without_matches_costs_nothing(seed):
    every, sim = _drafting_every_step_and_policy(seed, 1600, copy=0.0)
    plain = H200_BATCH1.decode
    assert every.seconds_per_token() > plain / 0.7  # (drafting every step loses: synchronous steps)
    assert sim.seconds_per_token() < plain / 0.98
    assert sim.steps["chained"] > 0.97 * sum(sim.steps.values())
