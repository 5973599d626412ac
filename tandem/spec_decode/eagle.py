"""EAGLE / EAGLE-3 proposer: a one-layer head drafts from the target's own hidden states.

Data flow per request (head position ``p`` = target feature at ``p`` + token ``p + 1``):

1. Every target forward writes the features of each query row (EAGLE-3: the concatenated aux hidden
   states; EAGLE-1: the final post-norm hidden state) to the row's KV slot in the feature cache
   (``kv/feature_cache.py``), inside the forward: a target step hands nothing to the proposer and
   costs no host work for it, drafting or not.
2. ``propose_requests`` first catches the head up on the positions it has not seen,
   ``[draft_num_computed, num_tokens - 1)``: the head runner reads their features from the cache by
   the step's slot mapping (head position ``p`` sits in the slot of target position ``p``; inside the
   head's graph on CUDA) and their next tokens are accepted tokens; the last row predicts draft 1
   (and gives the hidden state fed back). Then k − 1 single-token steps, each fed the previous draft
   (kept on the device) and the previous feedback — on CUDA the whole proposal in one graph where
   every drafting request takes the same k (``forward_proposal``). All drafts come to the host in one
   read at the end, or stay on the device (``propose_on_device``) and feed the verify step
   (``device_drafts.py``).
3. Only requests granted drafts run. While the policy grants a request nothing its head does not run
   at all; it catches up over the whole gap when it next drafts (the features stay in the cache for
   as long as the request holds its blocks). After a prefix-cache hit or a preemption the scheduler
   sets ``draft_num_computed = 0``: the head reads the features from position 0 (a cached block holds
   the features of its positions too) and rewrites its own KV for them.

Chained proposals (``propose_chained``; engine/async_decode.py): the drafts for the step after a
greedy verify still on the device, launched before that verify is read. The catch-up is packed as if
the verify accepted every draft: its rows for the verify's positions take the verify's row argmaxes
on the device (up to the first rejection they are the accepted drafts, then the emitted token) and
its output row moves back by the rejected count; the chain steps are packed past the assumed tokens
and move back by as much (``HeadChain``, worker/chain.py). So the drafts are those a synchronous
proposal would make once the verify is read. ``draft_num_computed`` is set as if everything was
accepted; the speculator corrects it when the drafts are read (``Speculator.resolve_drafts``).

Drafting is greedy (argmax, as vLLM's EAGLE): the rejection sampler treats drafts as one-hot q, so
sampled outputs stay the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.request import Request
from tandem.spec_decode.base import DraftProposal
from tandem.spec_decode.chain import collect_chain, flatten_chain
from tandem.spec_decode.device_drafts import DeviceDrafts
from tandem.worker.batch import ChainedFrom, HeadChain, SeqChunk
from tandem.worker.head_runner import AnyHeadRunner


class EagleProposer:
    drafts_on_host_for_free = False  # every draft costs a head forward

    def __init__(self, runner: AnyHeadRunner) -> None:
        self.runner = runner
        self.head = runner.head
        # the last proposal's first step: (query rows, requests) — rows past k + 1 per request were
        # a catch-up over positions the head idled through (``Speculator`` does not time them as drafting)
        self.last_catch_up = (0, 0)

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """(Nothing is kept per request: the features live in the request's blocks.)"""

    def propose_requests(self, reqs: Sequence[Request], ks: Sequence[int]) -> DraftProposal:
        """Up to ``ks[i]`` drafts per request (greedy); a request granted 0 runs nothing."""
        drafts: list[list[int]] = [[] for _ in reqs]
        steps = self._steps(reqs, ks)
        if steps:
            collect_chain(steps, drafts)
        return DraftProposal(drafts, None)

    def propose_on_device(self, reqs: Sequence[Request], ks: Sequence[int]) -> DeviceDrafts | None:
        """The same drafts, left on the device (``device_drafts.py``); None if nobody drafts."""
        steps = self._steps(reqs, ks)
        if not steps:
            return None
        ids, where = flatten_chain(steps, len(reqs))
        return DeviceDrafts.launch(ids, {r.request_id: tuple(p) for r, p in zip(reqs, where) if p})

    def propose_chained(self, reqs: Sequence[Request], ks: Sequence[int], verify: ChainedFrom) -> DeviceDrafts | None:
        """``propose_on_device`` for the step after a greedy verify still on the device (``verify``:
        per request of ``reqs``, its rows there and the drafts they check; every request carries that
        verify's k + 1 placeholders): the drafts a proposal would make once it is read."""
        steps = self._steps(reqs, ks, verify)
        if not steps:
            return None
        ids, where = flatten_chain(steps, len(reqs))
        return DeviceDrafts.launch(ids, {r.request_id: tuple(p) for r, p in zip(reqs, where) if p})

    def _steps(self, reqs: Sequence[Request], ks: Sequence[int], verify: ChainedFrom | None = None
               ) -> list[tuple[list[int], torch.Tensor]]:
        """Launch the chain; per step the requests it drafted for and their ids on the device."""
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        active: list[int] = []  # requests that draft, in row order
        t = 0
        for i, r in enumerate(reqs):
            hi = r.num_tokens - 1  # the head runs positions [lo, hi): features known, next tokens accepted
            if ks[i] <= 0 or hi < 1 or hi > r.num_computed_tokens:
                continue
            if verify is None:
                lo = min(r.draft_num_computed, hi - 1)  # at least the last position: it yields draft 1
                tokens = r.token_ids[lo + 1:hi + 1]
            else:  # the verify's positions [hi - k - 1, hi) take its row argmaxes on the device
                first = hi - len(verify.drafts[i]) - 1
                lo = min(r.draft_num_computed, first)
                tokens = [*r.token_ids[lo + 1:first + 1], *[0] * (hi - first)]
            chunks.append(SeqChunk(tokens, lo, r.block_ids))
            t += hi - lo
            r.draft_num_computed = hi
            rows.append(t - 1)
            active.append(i)
        self.last_catch_up = (t, len(chunks))
        if not chunks:
            return []
        k = max(ks[i] for i in active)
        if k > 1 and all(ks[i] == k for i in active):  # the whole proposal in one graph, where one holds it
            toks = self.runner.forward_proposal(chunks, rows, k - 1, chain=_head_chain(verify, active, True))
            if toks is not None:  # (views of the graph's output: flatten_chain / collect_chain copy them)
                return [(active, toks[j]) for j in range(k)]
        # hidden inputs: the target's features
        step = self.runner.forward(chunks, rows, None, chain=_head_chain(verify, active, True))
        # (clone: a CUDA runner's outputs are graph buffers the next step overwrites)
        return self._chain(reqs, ks, active, step.token_ids.clone(), step.feedback, verify)

    def _chain(self, reqs: Sequence[Request], ks: Sequence[int], active: list[int], tok: torch.Tensor,
               feedback: torch.Tensor, verify: ChainedFrom | None) -> list[tuple[list[int], torch.Tensor]]:
        """Draft steps 2..k, single-token rows, no host read in between: in one graph when every
        drafting request takes the same k and the runner holds one (``forward_chain``), else a step
        at a time."""
        steps: list[tuple[list[int], torch.Tensor]] = [(active, tok)]
        k = max(ks[i] for i in active)
        if k > 2 and all(ks[i] == k for i in active):
            chunks = [SeqChunk([0], reqs[i].num_tokens - 1, reqs[i].block_ids) for i in active]
            toks = self.runner.forward_chain(chunks, feedback, tok, k - 1, _head_chain(verify, active, False))
            if toks is not None:  # (views of the graph's outputs: copied before its next replay)
                return steps + [(active, t.clone()) for t in toks]
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
            step = self.runner.forward(chunks, range(len(live)), feedback, token_ids=tok,
                                       chain=_head_chain(verify, live, False))
            feedback = step.feedback
            steps.append((live, step.token_ids.clone()))
            j += 1
        return steps


def _head_chain(verify: ChainedFrom | None, picked: Sequence[int], catch_up: bool) -> HeadChain | None:
    """The ``HeadChain`` of a head step over the requests ``picked`` (indices into ``verify``)."""
    if verify is None:
        return None
    return HeadChain(ChainedFrom(verify.row_tokens, tuple(verify.offsets[i] for i in picked),
                                 tuple(verify.drafts[i] for i in picked)), catch_up)
