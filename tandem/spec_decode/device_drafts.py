"""Drafts left on the device: an EAGLE head's chain feeds the verify step without a host read.

A synchronous speculative round used to read the head's drafts on the host (waiting for the head),
then schedule, pack and launch the verify while the device idled. With ``DeviceDrafts`` the round
goes: the head's steps are launched and their drafts stay on the device (a copy to pinned host
memory is queued behind them); each drafting request carries ``PENDING`` placeholders as its
``spec_token_ids`` (their number is known: the policy chose it), so the scheduler budgets, allocates
and truncates them like any drafts; the executor packs the verify with the placeholders and the
runner writes the real ids into its input rows on the device (``FedTokens``); only after the
verify is launched does the host read the drafts (``read``: it waits for the head, not the verify)
and put them in place of the placeholders, before anything looks at their values (sampling,
rejection, the policy's scoring). The host's scheduling and packing overlap the head's steps.

Used when every drafting request's drafts may stay unread until then: no grammar (structured output
cuts drafts at the first token its grammar refuses, before scheduling). Sampled requests are fine:
rejection sampling runs after the read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.scheduler import SchedulerOutput
from tandem.worker.batch import FedTokens
from tandem.worker.host_copy import HostCopy

PENDING = -1  # a draft's id while it is on the device only (never a token id: an embedding would fail)


@dataclass(frozen=True)
class DeviceDrafts:
    ids: torch.Tensor  # [m] int64 on the device: every draft of the proposal, flat
    index: dict[str, tuple[int, ...]]  # request id -> positions in ``ids`` of its drafts, in order
    copy: HostCopy  # their copy to the host, queued behind the head's steps and ahead of the verify

    @staticmethod
    def launch(ids: torch.Tensor, index: dict[str, tuple[int, ...]]) -> DeviceDrafts:
        return DeviceDrafts(ids, index, HostCopy.queue(ids))

    def read(self) -> dict[str, list[int]]:
        """The host sync (waits for the head's steps only): each request's drafts."""
        flat = self.copy.tolist()
        return {rid: [flat[p] for p in pos] for rid, pos in self.index.items()}

    def feed(self, sched: SchedulerOutput) -> FedTokens | None:
        """The verify step's rows that take these drafts: each scheduled request's trailing query
        rows whose drafts are still ``PENDING`` (a budget cut may have dropped some of its tail)."""
        src: list[int] = []
        rows: list[int] = []
        t = 0
        for s in sched.scheduled:
            spec = s.spec_token_ids
            t += s.num_new_tokens
            if spec and spec[0] == PENDING:
                pos = self.index[s.request.request_id]
                src.extend(pos[:len(spec)])
                rows.extend(range(t - len(spec), t))
        return FedTokens(self.ids, tuple(src), tuple(rows)) if rows else None


def pending(num: int) -> tuple[int, ...]:
    """The placeholder drafts of a request granted ``num`` drafts on the device."""
    return (PENDING,) * num
