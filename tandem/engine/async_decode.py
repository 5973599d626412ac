"""Asynchronous decode and chained verifies: the next step is scheduled and launched before this
step's tokens are read.

In a steady decode step every running request decodes one token and nothing has to happen on the
host between the forward and the token: a greedy argmax, or a sample from the temperature / top-k /
top-p / min-p distribution drawn on the device (``sample/sampler.py``: the parameters are uploaded
without a host sync, a seeded row uses its per-position uniform). Such a step is *launched*: its
tokens stay on the device (with a pinned host copy and an event, ``InflightStep``) and each request
carries an output placeholder (``Scheduler.add_output_placeholders``) — a token counted in
``num_tokens`` whose id the host does not know yet. The next ``scheduler.schedule()`` then schedules each placeholder's decode
like any other token (same budget, KV allocation and preemption rules) and the executor feeds the
ids on the device (``ModelRunner.forward_logits(token_ids=...)``). Only then does the engine read
the previous step's tokens (the one host sync), so reading tokens, detokenizing, stop checks,
packing the next inputs and launching its CUDA graph overlap the GPU's forward instead of following
it (vLLM's async scheduling).

Outputs are the same tokens in the same order as the synchronous engine's (for a sampled request
with a seed too: its draw is keyed by output position, placeholders counted; unseeded requests share
the engine's generator, whose draws follow the step composition, so they match in law). A request
that stops (EOS, stop string, ``max_tokens``) at step n has had step n + 1 computed for it already:
that token is discarded (the KV it wrote is the stop token's, correct and never read by the
finished request). That step
still has the finished request's row, so the other requests' tokens of that one step come from a
batch one larger than the synchronous engine's; in bf16 that can round differently where the batch
size changes the layer kernels (worker/cuda_kernels.default_skinny_rows), as any change of batch does.

When (``can_schedule_ahead``): the step in flight holds every running request, none is waiting that
the next step would admit (a waiting request needs a free seat: with ``max_num_seqs`` running, the
next step could not take it anyway, so a full batch keeps chaining while a queue waits; nor while
admission waits for a group of free seats, ``Scheduler.admission_open``), and each
continues with a steady decode — its pending token not at ``max_model_len`` (the next one would have
no KV slot; a ``max_tokens`` finish is discarded like a stop), a token with no host-side logits
processing or reading (penalties, logit bias, logprobs, a grammar mask, ``min_tokens`` not yet
reached) and no drafts (the speculator's ``will_draft``). Otherwise the step in flight is read first
and the engine takes the ordinary path. A step is launched at all (``launchable``) only when it is
itself such a decode, after the request's first token.

Chained verifies. With a host proposer that drafts ahead (n-gram, suffix: ``Speculator.chains``) a
verify whose every row is a plain argmax is launched too (``launchable(sched, verifies=True)``): its
row argmaxes stay on the device (``InflightStep.verifies``) and each request counts k + 1
placeholders, as if it accepted every draft. The next step's drafts are proposed from that assumption
(``Speculator.drafts_ahead``), it is scheduled past the assumed tokens and launched with the verify's
rows (``chained_from``): the device counts the accepted drafts, writes the emitted token as the
step's first id and moves its rows back by the rejected count (worker/chain.py). Reading the verify
gives the same tokens on the host (``accept_matching``), and ``Scheduler.settle_launched`` takes
back the rejected placeholders. Drafts whose assumption failed are verified like any others — the
output is the target's either way. On the H200 a chained verify step of SmolLM2 at batch 1 cost
0.65–0.68 ms against 1.03–1.08 ms synchronously (docs/performance.md §37).

An EAGLE head chains too, without assuming anything: its proposal is launched on the device behind
the verify in flight, reads that verify's outcome there (spec_decode/eagle.py, ``propose_chained``)
and leaves its drafts on the device (``PENDING`` placeholders, fed to the chained verify:
``DeviceDrafts``). The host reads those drafts at the start of the next ``step()``, before the
verify they feed is looked at (``InflightStep.resolved``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from tandem.outputs import ModelRunnerOutput
from tandem.request import Request
from tandem.sample.logits import processes_logits
from tandem.sample.rejection import accept_matching
from tandem.scheduler import ScheduledRequest, SchedulerOutput
from tandem.spec_decode.device_drafts import PENDING
from tandem.worker.batch import ChainedFrom
from tandem.worker.host_copy import HostCopy


@dataclass(frozen=True)
class InflightStep:
    """A launched step whose sampled tokens have not been read: a decode step (one token per
    request) or a greedy verify (every row's argmax: its drafts are checked when read, and on the
    device by a step chained on it, ``chained_from``)."""

    sched: SchedulerOutput
    token_ids: torch.Tensor  # decode: [n] each request's token; verify: [Σ(k_i + 1)] each row's argmax
    copy: HostCopy  # the same on its way to the host
    verifies: bool = False

    @staticmethod
    def launch(sched: SchedulerOutput, token_ids: torch.Tensor, verifies: bool = False) -> InflightStep:
        """The step's tokens (queued on the device) and their copy to the host, read later
        (``HostCopy``: reading it waits for this step only, not for the next step queued meanwhile)."""
        return InflightStep(sched, token_ids, HostCopy.queue(token_ids), verifies)

    def resolved(self, drafts: Mapping[str, Sequence[int]]) -> InflightStep:
        """This step with the drafts it was fed on the device (``PENDING`` when it was scheduled)
        in place, once the speculator has read them (``resolve_drafts``: request id → drafts)."""
        def fed(s: ScheduledRequest) -> bool:
            return bool(s.spec_token_ids) and s.spec_token_ids[0] == PENDING and s.request.request_id in drafts

        if not drafts or not any(fed(s) for s in self.sched.scheduled):
            return self
        scheduled = tuple(replace(s, spec_token_ids=tuple(drafts[s.request.request_id][:len(s.spec_token_ids)]))
                          if fed(s) else s for s in self.sched.scheduled)
        return replace(self, sched=replace(self.sched, scheduled=scheduled))

    @property
    def requests(self) -> list[Request]:
        return [s.request for s in self.sched.scheduled]

    @property
    def finished(self) -> bool:
        """Every request of the step finished (or was aborted) meanwhile: nothing left to read."""
        return all(s.request.status.finished for s in self.sched.scheduled)

    def device_ids(self, requests: Sequence[Request]) -> torch.Tensor:
        """[len(requests)] device tokens this decode step sampled for ``requests`` (each one of its own)."""
        assert not self.verifies
        mine = self.requests
        if len(requests) == len(mine) and all(a is b for a, b in zip(requests, mine)):
            return self.token_ids
        row = {id(r): i for i, r in enumerate(mine)}
        keep = torch.tensor([row[id(r)] for r in requests], device=self.token_ids.device)
        return self.token_ids.index_select(0, keep)

    def chained_from(self, requests: Sequence[Request]) -> ChainedFrom:
        """Where a step chained on this verify finds, per request of ``requests`` (each one of its
        own), the rows that decide its first token and how far it moves back (worker/chain.py)."""
        assert self.verifies
        where: dict[int, tuple[int, tuple[int, ...]]] = {}
        off = 0
        for s in self.sched.scheduled:
            where[id(s.request)] = (off, s.spec_token_ids)
            off += len(s.spec_token_ids) + 1
        picked = [where[id(r)] for r in requests]
        return ChainedFrom(self.token_ids, tuple(o for o, _ in picked), tuple(d for _, d in picked))

    def read(self) -> ModelRunnerOutput:
        """The host sync: the step's tokens as an ordinary output (no logprobs)."""
        n = len(self.sched.scheduled)
        if not self.verifies:
            return ModelRunnerOutput(tuple((t,) for t in self.copy.tolist()), (0,) * n, (None,) * n, (None,) * n)
        res = accept_matching(self.copy.tolist(), [s.spec_token_ids for s in self.sched.scheduled])
        return ModelRunnerOutput(tuple(tuple(t) for t in res.token_ids), tuple(res.num_accepted), (None,) * n,
                                 (None,) * n)


def device_sampled(r: Request, num_prior_outputs: int) -> bool:
    """True when r's next token (after ``num_prior_outputs`` outputs) is drawn from its raw logits
    with the parameters alone (temperature, top-k/p, min-p, seed): nothing the host must apply
    first (penalties, bias, ``min_tokens``, a grammar) or read afterwards (logprobs)."""
    p = r.params
    return p.logprobs is None and p.prompt_logprobs is None and not processes_logits(p, num_prior_outputs)


def device_greedy(r: Request, num_prior_outputs: int) -> bool:
    """``device_sampled`` and greedy: the next token is the plain argmax of r's logits."""
    return r.params.greedy and device_sampled(r, num_prior_outputs)


def launchable(sched: SchedulerOutput, verifies: bool = False) -> bool:
    """A scheduled step that may leave its tokens on the device: one-token decodes sampled on the
    device only, each after the request's first token (placeholders count as outputs). With
    ``verifies``, also a step with drafts whose every row is a plain argmax (greedy, on the device):
    its drafts are checked there (a chained verify). Drafts still on the device (``PENDING``) are fed
    to it there."""
    drafts = False
    for s in sched.scheduled:
        r = s.request
        k = len(s.spec_token_ids)
        if (s.num_new_tokens != 1 + k or not s.samples or r.num_output_tokens < 1
                or not device_sampled(r, r.num_output_tokens)):
            return False
        drafts = drafts or k > 0
    if drafts:
        return verifies and all(
            all(device_greedy(s.request, s.request.num_output_tokens + j) for j in range(len(s.spec_token_ids) + 1))
            for s in sched.scheduled)
    return bool(sched.scheduled)


def can_schedule_ahead(running: Sequence[Request], admission_open: bool) -> bool:
    """The next step may be scheduled before the step in flight is read: every running request
    carries a placeholder from it, the next step admits no waiting request (``admission_open``
    false: none waits, ``max_num_seqs`` are running, or admission waits for a group), and each
    one's placeholder decode is steady (the pending token not at ``max_model_len``, a token sampled
    on the device next). Drafting is the speculator's question (``will_draft``)."""
    if not running or admission_open:
        return False
    for r in running:
        if (not r.num_output_placeholders or r.num_tokens >= r.max_model_len
                or not device_sampled(r, r.num_output_tokens)):
            return False
    return True
