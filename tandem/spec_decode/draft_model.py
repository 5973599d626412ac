"""Draft-model proposer: a small model with its own paged KV cache proposes k tokens per request.

The draft's KV tensors have as many blocks as the target's and use the *same* block tables, so the
scheduler's one allocation (with ``lookahead = k`` spare slots) covers both. Per request the draft
keeps ``draft_num_computed``; each proposal first catches up on tokens it has not seen (the prompt
on the first call, then the tokens accepted last step), which yields draft token 1, then runs k − 1
single-token steps. Rollback after verification is by count, like the target's:
``draft_num_computed = min(draft_num_computed, num_tokens - 1)`` — positions holding accepted
drafts are valid because those tokens are now part of the sequence.

Greedy drafting (default) proposes argmax tokens (one-hot q); its k steps run without a host read in
between (each argmax is fed to the next step on the device). ``probabilistic`` samples each draft
token from the draft's distribution under the request's own sampling parameters and returns q, so
the rejection sampler can use min(1, p/q).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.request import Request
from tandem.sample.logits import probs_from_logits, process_logits
from tandem.sample.rows import SamplingRow
from tandem.sample.sampler import sample
from tandem.sample.seeded import DRAFT
from tandem.spec_decode.base import DraftProposal
from tandem.spec_decode.chain import collect_chain
from tandem.worker.batch import SeqChunk
from tandem.worker.runner import ModelRunner


class DraftModelProposer:
    drafts_on_host_for_free = False  # every draft costs forwards of the draft model

    def __init__(self, runner: ModelRunner, probabilistic: bool, default_generator: torch.Generator) -> None:
        self.runner = runner
        self.probabilistic = probabilistic
        self.default_generator = default_generator

    def forget(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """Its per-request state (draft KV position) lives on the Request: nothing to forget."""

    def rollback(self, req: Request) -> None:
        req.draft_num_computed = min(req.draft_num_computed, req.num_tokens - 1)

    def propose_requests(self, reqs: Sequence[Request], ks: Sequence[int]) -> DraftProposal:
        active = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        if not active:
            return DraftProposal(drafts, None)
        # Step 1: catch up on unseen tokens; the last row predicts draft token 1.
        chunks = []
        rows = []
        t = 0
        for i in active:
            r = reqs[i]
            self.rollback(r)
            toks = r.token_ids[r.draft_num_computed:]
            chunks.append(SeqChunk(toks, r.draft_num_computed, r.block_ids))
            t += len(toks)
            rows.append(t - 1)
        for i in active:
            reqs[i].draft_num_computed = reqs[i].num_tokens
        if not self.probabilistic:
            self._greedy_steps(reqs, ks, active, self.runner.forward_ids(chunks, rows), drafts)
            return DraftProposal(drafts, None)
        self._pick(reqs, active, self.runner.forward_logits(chunks, rows), drafts, qs)
        # Steps 2..k: one token at a time for the requests that still want more.
        step = 1
        while True:
            live = [i for i in active if ks[i] > step]
            if not live:
                break
            chunks = [SeqChunk([drafts[i][-1]], reqs[i].num_tokens + step - 1, reqs[i].block_ids) for i in live]
            logits = self.runner.forward_logits(chunks, range(len(live)))
            self._pick(reqs, live, logits, drafts, qs)
            for i in live:
                reqs[i].draft_num_computed = reqs[i].num_tokens + step
            step += 1
        probs = None
        if self.probabilistic:
            flat = [q for i in range(len(reqs)) for q in qs[i]]
            probs = torch.stack(flat) if flat else None
        return DraftProposal(drafts, probs)

    def _greedy_steps(self, reqs: Sequence[Request], ks: Sequence[int], active: list[int],
                      first: torch.Tensor, drafts: list[list[int]]) -> None:
        """Greedy drafting, steps 2..k, with no host read between steps: each step's argmax stays on
        the device and is fed to the next forward as its input token (``token_ids``); all drafts
        come to the host in one read at the end. Which requests take part in each step is known
        up front (``ks``); when that set shrinks the tokens are read once to re-index them. ``first``:
        step 1's drafts (on the device)."""
        steps: list[tuple[list[int], torch.Tensor]] = [(active, first)]
        step = 1
        while True:
            prev, tok = steps[-1]
            live = [i for i in active if ks[i] > step]
            if not live:
                break
            if live != prev:  # some requests stopped drafting (max_tokens / max_model_len near)
                keep = torch.tensor([prev.index(i) for i in live], device=tok.device)
                tok = tok.index_select(0, keep)
            chunks = [SeqChunk([0], reqs[i].num_tokens + step - 1, reqs[i].block_ids) for i in live]
            steps.append((live, self.runner.forward_ids(chunks, range(len(live)), token_ids=tok)))
            for i in live:
                reqs[i].draft_num_computed = reqs[i].num_tokens + step
            step += 1
        collect_chain(steps, drafts)

    def _pick(self, reqs: Sequence[Request], idx: list[int], logits: torch.Tensor,
              drafts: list[list[int]], qs: list[list[torch.Tensor]]) -> None:
        """Probabilistic drafting: sample each request's next draft token from the draft's
        distribution under its sampling parameters; keep q for the rejection sampler."""
        rows = [
            SamplingRow(
                params=reqs[i].params,
                prompt_token_ids=reqs[i].prompt_token_ids,
                output_token_ids=reqs[i].output_token_ids + drafts[i],
                eos_token_ids=reqs[i].eos_token_ids,
                generator=reqs[i].generator,
            )
            for i in idx
        ]
        probs = probs_from_logits(process_logits(logits, rows), rows)
        toks = sample(probs, rows, self.default_generator, DRAFT).tolist()
        for j, i in enumerate(idx):
            drafts[i].append(toks[j])
            qs[i].append(probs[j])
