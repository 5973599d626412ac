"""The target features an EAGLE head has not read yet, per request (``EagleProposer``'s store).

Every target step hands over the features of all its query rows ([T, F], rows in schedule order,
``record``); the head reads a request's rows for positions ``[lo, hi)`` when it catches up
(``segment``) and then keeps only what it will read again (``consumed``). Per request the rows are
one contiguous segment of positions: a later record starting at position ``s`` replaces what was
kept from ``s`` on (rejected drafts' rows, a recompute after preemption).

The host work of a step must not grow with the batch while nobody drafts (an idle head costs every
step, docs/performance.md §24a). So consecutive plain decode steps of the same requests in the same
order — each request one row, one position further than in the step before — form a *run*: such a
step is kept as its one [B, F] tensor (the executor's copy: the CUDA runner's features are graph
outputs that the next step overwrites), with no per-request work. Any other step, and any read,
first splits the run into the requests' segments (one ``stack``, a view per request). Other steps
(prefill chunks, verifies, mixed batches) are split into the requests' segments as they arrive.

``due``: some request in its decode phase holds more than ``backlog_rows`` rows (O(1) per step while
nobody else is marked): the head should catch up (bounded memory; the head's KV stays current).
"""

from __future__ import annotations

import torch

from tandem.request import Request
from tandem.scheduler import SchedulerOutput


class Segment:
    """One request's rows for positions ``start .. end``: the recorded pieces, joined only when read
    (appending a step's rows is O(1), not a copy of everything kept)."""

    def __init__(self, start: int, rows: torch.Tensor) -> None:
        self.start = start
        self._pieces = [rows]
        self.num_rows = rows.shape[0]

    @property
    def end(self) -> int:
        return self.start + self.num_rows

    @property
    def rows(self) -> torch.Tensor:  # [num_rows, F]
        if len(self._pieces) > 1:
            self._pieces = [torch.cat(self._pieces)]
        return self._pieces[0]

    def record(self, start: int, rows: torch.Tensor) -> None:
        """Rows from position ``start`` (within ``start .. end``): what was kept from there on is replaced."""
        if start < self.end:
            self._pieces = [self.rows[: start - self.start]]
            self.num_rows = start - self.start
        self._pieces.append(rows)
        self.num_rows += rows.shape[0]


class _Run:
    """Consecutive plain decode steps of one batch: step j holds row i of request i at position
    ``starts[i] + j``."""

    def __init__(self, sched: SchedulerOutput, rows: torch.Tensor, held: int) -> None:
        self.requests = [s.request for s in sched.scheduled]
        self.starts = [s.start for s in sched.scheduled]
        self.next_starts = [p + 1 for p in self.starts]
        self.steps = [rows]
        self.held = held  # the most rows a decoding request of the run held in its segment before it

    def extends(self, sched: SchedulerOutput) -> bool:
        """``sched`` is the run's next step: the same requests in the same order, one row each, each
        one position further."""
        scheduled = sched.scheduled
        if sched.num_batched_tokens != len(scheduled) or len(scheduled) != len(self.requests):
            return False
        starts = [s.start for s in scheduled]
        # (requests compare by identity: Request has no __eq__)
        if starts != self.next_starts or [s.request for s in scheduled] != self.requests:
            return False
        self.next_starts = [p + 1 for p in starts]
        return True


class FeatureStore:
    def __init__(self, backlog_rows: int) -> None:
        self.backlog_rows = backlog_rows
        self._segments: dict[str, Segment] = {}
        self._run: _Run | None = None
        self._backlog: dict[str, Request] = {}  # requests whose segment held more than backlog_rows

    def record(self, sched: SchedulerOutput, features: torch.Tensor) -> None:
        """Keep the features of every query row of a target step ([T, F], rows in schedule order; a
        tensor nobody else writes: the executor hands over a copy)."""
        run = self._run
        if run is not None and run.extends(sched):
            run.steps.append(features)
            return
        self._flush()
        scheduled = sched.scheduled
        if scheduled and sched.num_batched_tokens == len(scheduled):  # one row per request: a run starts
            segs = self._segments
            held = max((segs[s.request.request_id].num_rows for s in scheduled
                        if s.request.request_id in segs and s.request.is_decoding), default=0)
            self._run = _Run(sched, features, held)
            return
        t = 0
        for s in scheduled:
            n = s.num_new_tokens
            rows = features if n == features.shape[0] else features[t:t + n]
            if self._put(s.request.request_id, s.start, rows) > self.backlog_rows:
                self._backlog[s.request.request_id] = s.request
            t += n

    @property
    def due(self) -> bool:
        """Some request in its decode phase holds more than ``backlog_rows`` rows the head has not
        read (a prompt's rows wait for its first decode step; a preempted request for its return)."""
        run = self._run
        if run is not None and run.held + len(run.steps) > self.backlog_rows:
            return True
        return bool(self._backlog) and any(r.is_decoding for r in self._backlog.values())

    def segment(self, request_id: str) -> Segment | None:
        self._flush()
        return self._segments.get(request_id)

    def consumed(self, request_id: str, upto: int) -> None:
        """The head has read the request's rows before position ``upto``: drop them (a copy of the
        rest, so that no view keeps a larger tensor alive)."""
        self._backlog.pop(request_id, None)
        f = self.segment(request_id)
        if f is not None and upto > f.start:
            self._segments[request_id] = Segment(upto, f.rows[upto - f.start:].clone())

    def forget(self, request_id: str) -> None:
        """(A run that still holds the request's rows skips them when split: it has finished.)"""
        self._segments.pop(request_id, None)
        self._backlog.pop(request_id, None)

    def rows_held(self) -> dict[str, int]:
        """Rows kept per request (the run's included; nothing is split or copied)."""
        held = {rid: f.num_rows for rid, f in self._segments.items()}
        run = self._run
        if run is not None:
            for r, start in zip(run.requests, run.starts):
                f = self._segments.get(r.request_id)
                if f is None and r.status.finished:
                    continue  # forgotten (as ``_flush`` skips it)
                before = start - f.start if f is not None and f.start <= start <= f.end else 0
                held[r.request_id] = before + len(run.steps)
        return held

    # ---- internals -------------------------------------------------------------------------------
    def _put(self, request_id: str, start: int, rows: torch.Tensor) -> int:
        """Keep the rows; returns how many the request holds now."""
        f = self._segments.get(request_id)
        if f is not None and f.start <= start <= f.end:
            f.record(start, rows)
        else:
            f = self._segments[request_id] = Segment(start, rows)
        return f.num_rows

    def _flush(self) -> None:
        """Split the run into the requests' segments."""
        run, self._run = self._run, None
        if run is None:
            return
        steps = torch.stack(run.steps, dim=1) if len(run.steps) > 1 else run.steps[0].unsqueeze(1)  # [B, S, F]
        for i, (r, start) in enumerate(zip(run.requests, run.starts)):
            if r.status.finished and r.request_id not in self._segments:
                continue  # finished (and forgotten) while the run was kept
            if self._put(r.request_id, start, steps[i]) > self.backlog_rows:
                self._backlog[r.request_id] = r
