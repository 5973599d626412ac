"""A device tensor's copy to pinned host memory, queued now and waited for only when read.

Queued right after the work that produced the tensor, the copy runs before anything launched later,
so ``tolist`` waits for that work only (a plain ``.tolist()`` would wait for everything queued after
it). Asynchronous decode reads a step's tokens this way while the next step runs; an EAGLE head's
drafts are read this way once the verify step they feed is queued.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostCopy:
    host: torch.Tensor  # pinned; valid once ``ready`` has passed (the tensor itself off CUDA)
    ready: torch.cuda.Event | None  # recorded after the device -> host copy (None off CUDA)

    @staticmethod
    def queue(t: torch.Tensor) -> HostCopy:
        if t.device.type != "cuda":
            return HostCopy(t, None)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return HostCopy(host, ready)

    def tolist(self) -> list:
        """The host sync: waits for the copy (and what it was queued behind) only."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
