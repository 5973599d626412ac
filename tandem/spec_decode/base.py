"""The proposer protocol: what every draft source (n-gram, suffix, draft model, EAGLE) implements.

A proposer is asked, once per step, for up to ``num_tokens`` draft tokens for each of a batch of
requests; it answers with a :class:`DraftProposal`. Invariants:

- Answers come back in the order asked, one list per request, each no longer than that request's
  ``num_tokens``. An empty list is always a valid answer ("no drafts this step"): the scheduler then
  runs an ordinary decode for that request (k = 0), so proposers never pad.
- Token ids are the target's ids. A proposer with its own vocabulary translates before answering.
- ``probs`` carries the draft distributions q only when the proposer sampled from one (a draft model
  with ``draft_sample_method="probabilistic"``). Proposers without probabilities (n-gram, suffix,
  greedy drafts) leave it ``None`` and the rejection sampler treats each draft token as one-hot q.

Capabilities are declared, never inferred from the class: ``drafts_on_host_for_free`` is true for a
proposer whose drafts cost a host-side lookup and no forward, asked statelessly as ``(tokens, k)``
(n-gram). The speculator's goodput policy (``spec_decode/policy.py``) drafts with such a proposer in
the shadow, from earlier prefixes, while decode steps run ahead. The suffix proposer's drafts are
host lookups too, but come from per-request state that already holds tokens those shadow drafts
must not see, so it declares false.

A proposer may keep per-request state (suffix: a trie per request and one over finished outputs):
``forget(request_id, output_token_ids)`` tells it that a request finished (or was aborted) with that
output. Stateless proposers ignore it.

A host proposer may also answer ``propose_ahead(request_id, token_ids, assumed, num_tokens)`` (n-gram,
suffix): the token it expects after the accepted ``token_ids`` followed by ``assumed`` (a verify's
drafts still on the device, assumed accepted), then up to ``num_tokens`` drafts after it — so up to
``num_tokens + 1`` tokens, however ``num_speculative_tokens`` caps ``propose``. Its state must not take
the assumed tokens (the verify may reject them). The speculator then chains verifies
(``Speculator.drafts_ahead``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ProposalInput:
    """One request's share of a proposal call."""

    request_id: str
    # Prompt + output so far: every accepted token, never the drafts of an earlier step. A numpy
    # int array is accepted as is (no copy), which is the cheap path for long contexts.
    token_ids: Sequence[int]
    # The most draft tokens wanted this step: k, possibly reduced near max_tokens / max_model_len,
    # possibly 0 (adaptive speculation turned drafting off for this request).
    num_tokens: int


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens for a batch of requests, in the order they were asked."""

    token_ids: list[list[int]]  # per request; len(token_ids[i]) <= requests[i].num_tokens (0 ok)
    # [sum(len(t) for t in token_ids), vocab] draft distributions q, rows in the same order as the
    # flattened token_ids; None when the proposer has no probabilities (one-hot q).
    probs: torch.Tensor | None = None

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @staticmethod
    def empty(num_requests: int) -> DraftProposal:
        """No drafts for any of ``num_requests`` requests."""
        return DraftProposal(token_ids=[[] for _ in range(num_requests)])


@runtime_checkable
class Proposer(Protocol):
    """Anything that turns accepted tokens into draft tokens."""

    drafts_on_host_for_free: bool  # a draft costs a host-side lookup, no forward

    def propose(self, requests: Sequence[ProposalInput]) -> DraftProposal: ...

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None: ...
