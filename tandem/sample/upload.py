"""Host values → a device tensor without waiting for the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory *and then synchronises the
stream*: the host waits for every kernel queued before it (on a sampled step, the whole forward).
A pageable host→device ``cudaMemcpyAsync`` needs no such wait — CUDA stages the bytes before the
call returns, so the source may be freed at once — and torch issues exactly that for
``.to(device, non_blocking=True)``. Every per-row parameter the sampler sends to the device goes
through ``upload``, so building a sampled step's probabilities and drawing its tokens queue work
without a host sync; the one sync is the read of the tokens (or, for asynchronous decode, the
read one step later).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """A 1-D ``dtype`` tensor of ``values`` on ``device``, queued on the current stream."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return t
    return t.to(device, non_blocking=True)


__all__ = ["upload"]
