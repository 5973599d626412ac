"""The goodput policy's evidence: how it learns each request's acceptance (``policy.py``'s base).

Every proposal a request gets — a real one (``proposed``) or a *shadow* the policy drafts itself
while nobody drafts — is kept pending and scored against the tokens the target produced afterwards
(``on_tokens`` → ``score_draft``: the longest prefix equal to the real continuation, what greedy
verification would have accepted). Shadows come from a stateless host proposer (n-gram's
``propose_one``: lazily from earlier prefixes, position after position) or a stateful one (suffix's
``propose_for``: from a request's latest tokens, at batch >= ``DEFER_SHADOWS_BATCH`` drafted in
``background`` while the device computes a step), within a per-step budget (``_shadows_left``, set
by the policy's ``on_step``) and, while nobody drafts at batch >= 8, the idle time credit
(``time_credit.py``: each shadow is charged what it took).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.engine.stats import SpecStats
from tandem.spec_decode.policy_accept import AcceptanceModel, score_draft
from tandem.spec_decode.time_credit import TimeCredit

DEFER_SHADOWS_BATCH = 8  # from this batch on, latest shadows are drafted in ``background``

ShadowDraft = Callable[[Sequence[int], int], list[int]]
LatestShadowDraft = Callable[[str, Sequence[int], int], list[int]]  # (request id, tokens, k): a stateful proposer


@dataclass(frozen=True)
class PendingDraft:
    at: int  # proposed from token_ids[:at]
    draft: tuple[int, ...]


class PolicyEvidence:
    # set by GoodputPolicy.__init__ (and its on_step: the shadow budget, the rationing)
    k: int
    shadow: ShadowDraft | None
    latest_shadow: LatestShadowDraft | None
    acceptance: AcceptanceModel
    stats: SpecStats
    idle: TimeCredit
    _rationing: bool
    _pending: dict[str, PendingDraft]
    _shadow_at: dict[str, int]  # lazy shadows: the next position to draft from
    _shadow_due: list[tuple[str, Sequence[int]]]  # latest shadows for ``background`` (id, tokens)
    _shadows_left: int  # this step's lazy shadow budget
    _rotation: int  # where this step's lazy shadows start in the batch (round robin)
    _num_proposals: int  # drafts proposed, real and shadow (cumulative)

    def proposed(self, request_id: str, at: int, draft: Sequence[int]) -> None:
        """A proposal from the request's first ``at`` tokens (the full draft, before truncation)."""
        self._shadow_at.pop(request_id, None)
        old = self._pending.pop(request_id, None)
        if old is not None and old.draft and at > old.at:
            # superseded undecided: every token produced since matched (else on_tokens decided it)
            self.acceptance.record(request_id, len(old.draft), min(at - old.at, len(old.draft)), decided=False)
        self._pending[request_id] = PendingDraft(at, tuple(int(t) for t in draft))
        self._num_proposals += 1

    @property
    def wants_tokens(self) -> bool:
        """Whether ``on_step_tokens`` has anything to do: a proposal to score, or a shadow budget."""
        return bool(self._pending) or ((self.shadow is not None or self.latest_shadow is not None)
                                       and self._shadows_left > 0)

    def on_step_tokens(self, requests: Sequence[tuple[str, Sequence[int]]]) -> None:
        """One step's new tokens, per request (id, tokens so far): pending proposals are scored; lazy
        shadows start for at most the step's budget of the others, round robin over the batch (the
        per-request work of a step where nobody drafts stays a dictionary lookup)."""
        pending = self._pending
        for rid, toks in requests:
            if rid in pending:
                self.on_tokens(rid, toks)
        n = len(requests)
        if (self.shadow is None and self.latest_shadow is None) or self._shadows_left <= 0 or not n:
            return
        start = self._rotation % n
        for i in range(n):
            if self._shadows_left <= 0:
                break
            rid, toks = requests[(start + i) % n]
            if rid in pending:
                continue
            if self.latest_shadow is not None:
                if n < DEFER_SHADOWS_BATCH:  # fresh evidence first where a missed verify costs most
                    self._latest(rid, toks)
                    self._shadows_left -= 1
                elif all(rid != due for due, _ in self._shadow_due):
                    self._shadow_due.append((rid, toks))  # drafted by ``background``
                    self._shadows_left -= 1
                self._rotation = start + i + 1
            elif self._shadow_at.get(rid, len(toks)) < len(toks):
                self.on_tokens(rid, toks)
                self._rotation = start + i + 1
            elif rid not in self._shadow_at:  # never proposed for: a first shadow from its latest tokens
                self._shadow(rid, len(toks), toks)
                self._rotation = start + i + 1

    def background(self) -> None:
        """The latest shadows due (``on_step_tokens``, batch >= ``DEFER_SHADOWS_BATCH``), drafted
        now: the engine calls this while the device computes a step. A stateful proposer's lookup
        first brings its per-request index up to date — the whole prompt and output at a request's
        first one (~0.6 ms for 550 tokens on the 2-core CPU) — host work that may wait a step where
        a request's drafts are a small part of the step."""
        due, self._shadow_due = self._shadow_due, []
        for rid, toks in due:
            if rid not in self._pending:  # (else proposed for meanwhile)
                self._latest(rid, toks)

    def _latest(self, request_id: str, token_ids: Sequence[int]) -> None:
        assert self.latest_shadow is not None
        t0 = self.idle.clock()
        self._pending[request_id] = PendingDraft(len(token_ids), tuple(self.latest_shadow(request_id, token_ids, self.k)))
        self._shadow_drafted(t0)

    def on_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """New tokens of a request: score its pending proposal, then (lazy shadows) propose and score
        from each earlier prefix the tokens have gone past."""
        n = len(token_ids)
        p = self._pending.get(request_id)
        if p is None and self.shadow is not None and self._shadow_at.get(request_id, n) < n:
            if self._shadows_left <= 0:
                return  # over this step's budget: its shadow waits and later skips ahead
            # a shadow that fell behind (budget) restarts from the latest prefix a draft can be scored on
            p = self._shadow(request_id, max(self._shadow_at.pop(request_id), n - self.k - 1), token_ids)
        while p is not None:
            r = score_draft(p.draft, p.at, token_ids)
            if r is None:
                return
            acc, decided = r
            if not decided:
                return
            self.acceptance.record(request_id, len(p.draft), acc)
            del self._pending[request_id]
            at = p.at + acc + 1  # where a verify of this draft would have left the request
            p = None
            if self.shadow is not None:
                if at < n and self._shadows_left > 0:
                    p = self._shadow(request_id, at, token_ids)
                else:
                    self._shadow_at[request_id] = at

    def _shadow(self, request_id: str, at: int, token_ids: Sequence[int]) -> PendingDraft:
        assert self.shadow is not None
        t0 = self.idle.clock()
        p = self._pending[request_id] = PendingDraft(at, tuple(self.shadow(token_ids[:at], self.k)))
        self._shadow_drafted(t0)
        self._shadows_left -= 1
        return p

    def _shadow_drafted(self, t0: float) -> None:
        self.stats.num_shadow_drafts += 1
        self._num_proposals += 1
        if self._rationing:
            self.idle.charge(self.idle.clock() - t0)
