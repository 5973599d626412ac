"""EAGLE / EAGLE-3 proposer: a one-layer head drafts from the target's own hidden states.

Data flow per request (head position ``p`` = target feature at ``p`` + token ``p + 1``):

1. Every target forward returns features for each query row (EAGLE-3: the concatenated aux hidden
   states; EAGLE-1: the final post-norm hidden state). The executor hands them here
   (``record_features``) with the step's schedule; ``FeatureStore`` (``eagle_features.py``) keeps
   them per request as one contiguous segment of positions — consecutive plain decode steps of one
   batch as one tensor per step, with no per-request work. A later record starting at position
   ``s`` drops what the earlier one had from ``s`` on: rejected drafts' rows are overwritten that
   way, a recompute after preemption replaces everything.
2. ``propose_requests`` first catches the head up on the positions it has not seen:
   ``[draft_num_computed, num_tokens - 1)``, whose features are known and whose next tokens are
   accepted tokens; the last row predicts draft 1 (and gives the hidden state fed back). Then k − 1
   single-token steps, each fed the previous draft (kept on the device) and the previous feedback.
   All drafts come to the host in one read at the end. Requests asked for 0 drafts still catch up
   (so features never pile up) but sample nothing.
3. Where features start after the head's counter (a prefix-cache hit: the target skipped the
   cached prefix), the head starts there too, reading the KV the cached blocks hold.
4. While nobody drafts (the policy grants no drafts or is off, ``disable_by_batch_size``,
   asynchronous plain steps) the speculator runs no head forward, and the features of every step
   still arrive. ``catch_up_due`` tells the speculator (after each step) when a request holds more
   than ``BACKLOG_ROWS`` positions the head has not seen; it then has the head ``catch_up`` on the
   positions whose next token the host knows — a step in flight is not waited for, so an
   asynchronous pipeline keeps running — and the features kept stay bounded in memory and the
   head's KV current.

Drafting is greedy (argmax, as vLLM's EAGLE): the rejection sampler treats drafts as one-hot q, so
sampled outputs stay the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.request import Request
from tandem.scheduler import SchedulerOutput
from tandem.spec_decode.base import DraftProposal
from tandem.spec_decode.chain import collect_chain
from tandem.spec_decode.eagle_features import FeatureStore
from tandem.worker.batch import SeqChunk
from tandem.worker.head_runner import AnyHeadRunner


class EagleProposer:
    drafts_on_host_for_free = False  # every draft costs a head forward
    # Feature rows a request may hold before the head must catch up on them: one head forward per
    # this many plain steps (no pipeline drain: ``catch_up`` reads no token in flight); an EAGLE-3
    # row of an 8B target is 24 KiB: 3 MiB per request.
    BACKLOG_ROWS = 128

    def __init__(self, runner: AnyHeadRunner) -> None:
        self.runner = runner
        self.head = runner.head
        self.features = FeatureStore(self.BACKLOG_ROWS)

    # ---- features from the target ---------------------------------------------------------------
    def record_features(self, sched: SchedulerOutput, features: torch.Tensor) -> None:
        """Keep the features of every query row of a target step ([T, F], rows in schedule order)."""
        self.features.record(sched, features)

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self.features.forget(request_id)

    @property
    def catch_up_due(self) -> bool:
        """A request in its decode phase holds more than ``BACKLOG_ROWS`` feature rows the head has
        not read (O(1): asked after every step)."""
        return self.features.due

    def catch_up(self, reqs: Sequence[Request]) -> None:
        """The head reads the features of ``reqs`` up to their last token the host knows, drafting
        nothing. Needs no token in flight: it may run while an asynchronous step computes (the
        pipeline is not drained)."""
        self._advance(reqs, [0] * len(reqs), known_only=True)

    # ---- drafting -------------------------------------------------------------------------------
    def propose_requests(self, reqs: Sequence[Request], ks: Sequence[int]) -> DraftProposal:
        return self._advance(reqs, ks, known_only=False)

    def _advance(self, reqs: Sequence[Request], ks: Sequence[int], known_only: bool) -> DraftProposal:
        """Catch the head up on each request's features (to ``num_tokens - 1``, or with
        ``known_only`` to its last token on the host), then draft ``ks[i]`` tokens per request."""
        drafts: list[list[int]] = [[] for _ in reqs]
        chunks: list[SeqChunk] = []
        hidden: list[torch.Tensor] = []
        rows: list[int] = []
        active: list[int] = []  # requests that draft, in row order
        t = 0
        for i, r in enumerate(reqs):
            hi = (len(r.token_ids) if known_only else r.num_tokens) - 1
            span = self._catch_up_span(r, hi)
            if span is None:  # nothing new, or rows the head cannot reach: only rows from hi - 1 on may serve
                self.features.consumed(r.request_id, hi - 1)
                continue
            lo, feats = span
            chunks.append(SeqChunk(r.token_ids[lo + 1:hi + 1], lo, r.block_ids))
            hidden.append(feats)
            t += hi - lo
            r.draft_num_computed = hi
            self.features.consumed(r.request_id, hi - 1)  # keep the last row: a repeated ask recomputes it
            if ks[i] > 0:
                rows.append(t - 1)
                active.append(i)
        if not chunks:
            return DraftProposal(drafts, None)
        step = self.runner.forward(chunks, rows, self.head_inputs(torch.cat(hidden)))
        if active:  # (clone: a CUDA runner's outputs are graph buffers the next step overwrites)
            self._chain(reqs, ks, active, step.token_ids.clone(), step.feedback, drafts)
        return DraftProposal(drafts, None)

    def head_inputs(self, features: torch.Tensor) -> torch.Tensor:
        """Target features → the head's hidden input at step 0 (EAGLE-3: ``fc`` over the aux concat)."""
        if self.head.cfg.kind == "eagle3":
            with torch.inference_mode():
                return self.head.fuse(features.to(self.head.fc.weight.dtype))
        return features

    def _catch_up_span(self, r: Request, hi: int) -> tuple[int, torch.Tensor] | None:
        """(first head position to run, the features of positions [lo, hi)) or None when the
        features needed are not here (nothing recorded yet)."""
        f = self.features.segment(r.request_id)
        if f is None or hi < 1:
            return None
        lo = min(r.draft_num_computed, hi - 1)  # at least the last position: it yields draft 1
        lo = max(lo, f.start)  # features start later (prefix-cache hit): start there
        if lo >= hi or f.end < hi:
            return None
        return lo, f.rows[lo - f.start:hi - f.start]

    def _chain(self, reqs: Sequence[Request], ks: Sequence[int], active: list[int], tok: torch.Tensor,
               feedback: torch.Tensor, drafts: list[list[int]]) -> None:
        """Draft steps 2..k, single-token rows, no host read in between."""
        steps: list[tuple[list[int], torch.Tensor]] = [(active, tok)]
        j = 1
        while True:
            prev, tok = steps[-1]
            live = [i for i in active if ks[i] > j]
            if not live:
                break
            if live != prev:
                keep = torch.tensor([prev.index(i) for i in live], device=tok.device)
                tok, feedback = tok.index_select(0, keep), feedback.index_select(0, keep)
            chunks = [SeqChunk([0], reqs[i].num_tokens - 2 + j, reqs[i].block_ids) for i in live]
            step = self.runner.forward(chunks, range(len(live)), feedback, token_ids=tok)
            feedback = step.feedback
            steps.append((live, step.token_ids.clone()))
            j += 1
        collect_chain(steps, drafts)
