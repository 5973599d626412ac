"""Asynchronous decode steps: the next forward is queued before this step's tokens are read.

In a steady decode step every running request decodes one token greedily and nothing has to happen
on the host between the forward and the argmax. Such a step keeps its sampled tokens on the device;
the engine launches the next step with those tokens fed on the device
(``ModelRunner.forward_logits(token_ids=...)``) and only then reads the previous step's tokens (the one
host sync), so the host's work per step — reading tokens, detokenizing, stop checks, packing the next
inputs and launching its CUDA graph — overlaps the GPU's forward instead of following it (vLLM's
async scheduling). Outputs are the same tokens in the same order: a request that stops (EOS, stop
string) at step n has had step n + 1 computed for it already; that token is discarded, and its KV
write landed in a slot no computed token owns (stream order puts any reuse of the block after it).
That step still has the finished request's row, so the other requests' tokens of that one step come
from a batch one larger than the synchronous engine's; in bf16 that can round differently where the
batch size changes the layer body (fused_forward.default_gemv_rows), as any change of batch does.

Chaining stops — the step in flight is read and the engine takes the ordinary path — whenever the
next step is not a steady decode: a request waiting for admission, a request that finishes by
length, sampling that needs the host (temperature, penalties, logit bias, logprobs, ``min_tokens``
not yet reached), speculation (drafts are proposed from read tokens), or no free KV block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.request import Request
from tandem.sample.argmax import greedy_ids
from tandem.sample.logits import processes_logits
from tandem.scheduler import SchedulerOutput


@dataclass(frozen=True)
class InflightDecode:
    """A launched decode step whose tokens have not been read."""

    requests: tuple[Request, ...]
    starts: tuple[int, ...]  # position of each request's query token
    token_ids: torch.Tensor  # [len(requests)] int64 on the model's device: the argmax of each row
    host_ids: torch.Tensor  # the same tokens on the host (pinned; valid once ``ready`` has passed)
    ready: torch.cuda.Event | None  # recorded after the device → host copy (None on CPU)

    @staticmethod
    def launch(requests: Sequence[Request], starts: Sequence[int], logits: torch.Tensor) -> InflightDecode:
        """Argmax of each row and its copy to the host, queued now and read later. The copy is queued
        before any later step, so reading it waits for this step only (a plain ``.tolist()`` would
        wait for everything queued after it, the next step included)."""
        ids = greedy_ids(logits)
        if ids.device.type != "cuda":
            return InflightDecode(tuple(requests), tuple(starts), ids, ids, None)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return InflightDecode(tuple(requests), tuple(starts), ids, host, ready)

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_ids.tolist()


def device_greedy(r: Request, num_prior_outputs: int) -> bool:
    """True when r's next token (after ``num_prior_outputs`` outputs) is the plain argmax of its
    logits: nothing the host must apply first or read afterwards."""
    p = r.params
    return (p.greedy and p.logprobs is None and p.prompt_logprobs is None
            and not processes_logits(p, num_prior_outputs))


def launchable(sched: SchedulerOutput) -> bool:
    """A scheduled step that can run asynchronously: one-token greedy decodes only."""
    for s in sched.scheduled:
        r = s.request
        if (s.num_new_tokens != 1 or s.spec_token_ids or not s.samples or r.num_output_tokens < 1
                or not device_greedy(r, r.num_output_tokens)):
            return False
    return bool(sched.scheduled)


def chain_requests(pending: InflightDecode, running: Sequence[Request], num_waiting: int,
                   max_model_len: int) -> list[Request] | None:
    """The requests of the step after ``pending`` if it can be launched before ``pending`` is read
    (every running request continues with a steady decode), else None."""
    live = [r for r in pending.requests if not r.status.finished]
    if not live or num_waiting or len(running) != len(live) or {id(r) for r in running} != {id(r) for r in live}:
        return None
    for r in live:
        n_out = r.num_output_tokens + 1  # the pending token included
        if n_out >= r.max_output_tokens or r.num_tokens + 1 >= max_model_len or not device_greedy(r, n_out):
            return None
    return live
