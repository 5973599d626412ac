"""The goodput policy on a stand-in for the asynchronous engine (tests/async_sim.py: fixed target streams,
the real n-gram or suffix proposer, the engine's step logic, the H200's batch-1 step costs): a verify
runs synchronously at ~1.7 chained decode steps, and leaving or re-entering the chain of decode steps
costs a pipeline restart. The policy must draft in runs where the text repeats (close to drafting
every step, far above plain decoding), and cost nothing where it never does; with suffix decoding
likewise on a task asked again (its global tree holds the first answer)."""

from __future__ import annotations

import random

import pytest

from tandem.spec_decode.base import ProposalInput
from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.policy import GoodputPolicy
from tandem.spec_decode.policy_cost import ASYNC_PRIOR_RESTART, ASYNC_PRIOR_SIGMA, StepCostModel
from tandem.spec_decode.suffix import SuffixProposer

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


SUFFIX_K = 7  # the CUDA graphs' limit (engine/builder.draft_limit)


def _suffix_run(policy_on: bool, first: list[int], again: list[int]) -> AsyncSim:
    """``first`` answered, then ``again`` (the same task with small changes) through one suffix proposer
    (and one policy): the second request's run."""
    suffix = SuffixProposer(SUFFIX_K)

    def propose_for(rid: str, tokens: list[int], k: int) -> list[int]:
        return suffix.propose([ProposalInput(rid, tokens, k)]).token_ids[0]

    policy = (GoodputPolicy(SUFFIX_K, free=True, latest_shadow=propose_for,
                            cost=StepCostModel(prior_sigma=ASYNC_PRIOR_SIGMA, prior_restart=ASYNC_PRIOR_RESTART,
                                               max_k=SUFFIX_K)) if policy_on else None)
    sims = []
    for i, stream in enumerate((first, again)):
        sims.append(AsyncSim(policy, [stream], 32, H200_BATCH1, SUFFIX_K, first_id=i, propose_for=propose_for).run())
        suffix.forget(f"r{i}", stream[32:])
        if policy is not None:
            policy.forget(f"r{i}")
    return sims[1]


@pytest.mark.parametrize("seed", range(3))
def test_suffix_drafts_a_task_asked_again(seed):
    rng = random.Random(seed)
    first = code_like_stream(rng, 1200, copy=0.0)  # nothing repeats within an answer ...
    again = [t if rng.random() > 0.02 else rng.randrange(200) for t in first]  # ... but the answer comes back
    every, sim = _suffix_run(False, first, again), _suffix_run(True, first, again)
    plain = H200_BATCH1.decode
    assert every.seconds_per_token() < plain / 1.5
    assert sim.seconds_per_token() < plain / 1.5
    assert sim.seconds_per_token() < every.seconds_per_token() / 0.9
    assert sim.steps["verify"] > 5 * sim.steps["restart"]


@pytest.mark.parametrize("seed", range(2))
def test_suffix_without_matches_costs_nothing(seed):
    rng = random.Random(seed)
    first, other = code_like_stream(rng, 1200, copy=0.0), code_like_stream(rng, 1200, copy=0.0)
    sim = _suffix_run(True, first, other)
    assert sim.seconds_per_token() < H200_BATCH1.decode / 0.98
    assert sim.steps["chained"] > 0.95 * sum(sim.steps.values())
