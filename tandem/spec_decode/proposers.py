"""Build the engine's proposer from a SpeculativeConfig.

The speculator asks every proposer the same question, ``propose_requests(requests, ks)``: for each
request in the decode phase, up to ``ks[i]`` draft tokens, and tells it when a request finishes
(``forget(request_id, output_token_ids)``). Token-only proposers (n-gram, suffix) implement the
weight-free ``Proposer`` protocol over ``ProposalInput``; the adapter here hands them just the
accepted tokens (and the request id: the suffix proposer keeps a trie per request). Model-based proposers (draft model, EAGLE) need the
requests' block tables and counters, so they take Request objects directly.

Every engine proposer declares ``drafts_on_host_for_free`` (see ``base.py``); those that do also
answer ``propose_one(tokens, k)``, the single-sequence question the acceptance gate's shadow drafts
ask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tandem.config.speculative import EAGLE_METHODS, SpeculativeConfig
from tandem.request import Request
from tandem.spec_decode.base import DraftProposal, ProposalInput, Proposer
from tandem.spec_decode.draft_model import DraftModelProposer
from tandem.spec_decode.eagle import EagleProposer
from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.suffix import SuffixProposer
from tandem.worker.head_runner import AnyHeadRunner
from tandem.worker.runner import ModelRunner


class EngineProposer(Protocol):
    drafts_on_host_for_free: bool

    def propose_requests(self, reqs: Sequence[Request], ks: Sequence[int]) -> DraftProposal: ...

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None: ...


class TokenProposerAdapter:
    """Feeds a token-only Proposer from engine Requests."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.drafts_on_host_for_free = proposer.drafts_on_host_for_free

    def propose_requests(self, reqs: Sequence[Request], ks: Sequence[int]) -> DraftProposal:
        return self.proposer.propose(
            [ProposalInput(r.request_id, r.token_ids, k) for r, k in zip(reqs, ks)]
        )

    @property
    def drafts_ahead(self) -> bool:
        """The proposer answers ``propose_ahead`` (``base.py``): its verifies may be chained."""
        return hasattr(self.proposer, "propose_ahead")

    def propose_ahead(self, reqs: Sequence[Request], assumed: Sequence[Sequence[int]],
                      ks: Sequence[int]) -> list[list[int]]:
        """Per request, the token expected after its accepted tokens + ``assumed``, then up to
        ``ks[i]`` drafts (``base.py``)."""
        ahead = self.proposer.propose_ahead  # type: ignore[attr-defined]
        return [ahead(r.request_id, r.token_ids, a, k) if k else [] for r, a, k in zip(reqs, assumed, ks)]

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self.proposer.forget(request_id, output_token_ids)

    def propose_one(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Drafts of at most ``num_tokens`` tokens for one sequence of accepted tokens."""
        return self.proposer.propose([ProposalInput("", token_ids, num_tokens)]).token_ids[0]

    def propose_for(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Drafts for one request from all its accepted tokens (a stateful proposer keeps its state)."""
        return self.proposer.propose([ProposalInput(request_id, token_ids, num_tokens)]).token_ids[0]


def propose_in_turn(proposer: EngineProposer, reqs: Sequence[Request], ks: Sequence[int], start: int,
                    clock: Callable[[], float], deadline: float) -> tuple[list[int], DraftProposal]:
    """One lookup per request, from index ``start`` (mod the count) on in turn, until ``clock()``
    passes ``deadline`` (the lookup it started finishes): the indices asked, in order, and their drafts
    (a bounded proposal round: ``Speculator.drafts_for`` while nobody drafts)."""
    n = len(reqs)
    order: list[int] = []
    drafts: list[list[int]] = []
    for i in range(n):
        j = (start + i) % n
        order.append(j)
        drafts.append(proposer.propose_requests([reqs[j]], [ks[j]]).token_ids[0])
        if clock() >= deadline:
            break
    return order, DraftProposal(drafts)


def build_proposer(cfg: SpeculativeConfig | None, draft_runner: ModelRunner | None,
                   generator: torch.Generator, head_runner: AnyHeadRunner | None = None) -> EngineProposer | None:
    if cfg is None:
        return None
    if cfg.method == "ngram":
        return TokenProposerAdapter(NgramProposer.from_config(cfg))
    if cfg.method == "suffix":
        return TokenProposerAdapter(SuffixProposer.from_config(cfg))
    if cfg.method == "draft_model":
        if draft_runner is None:
            raise RuntimeError("draft_model speculation needs a loaded draft model")
        return DraftModelProposer(draft_runner, cfg.draft_sample_method == "probabilistic", generator)
    if cfg.method in EAGLE_METHODS:
        if head_runner is None:
            raise RuntimeError(f"{cfg.method} speculation needs a loaded head")
        return EagleProposer(head_runner)
    raise NotImplementedError(f"speculative method {cfg.method!r}")
