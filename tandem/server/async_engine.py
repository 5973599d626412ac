"""AsyncEngine: the synchronous LLMEngine driven by one background thread, fed from asyncio.

Threads and ownership:

- The *engine thread* is the only thread that touches the LLMEngine (add_request, abort_request,
  step, stats). It loops: take pending commands → ``step()`` while there is work → publish
  metrics → hand outputs to their requests; with nothing to do it sleeps on a condition variable.
- The asyncio side talks to it only through a command list guarded by that condition
  (``_submit``), and receives results through one ``asyncio.Queue`` per request, filled with
  ``loop.call_soon_threadsafe`` (asyncio queues are not thread-safe).

Request lifecycle: :meth:`AsyncEngine.add_request` submits ``add`` and waits for the engine thread's
acknowledgement, so an engine-side rejection (:class:`~tandem.errors.RequestError` and subclasses,
:class:`~tandem.errors.SamplingParamsError`) is raised *before* the first output — the HTTP layer can
still answer 400. It returns a :class:`RequestStream` of cumulative RequestOutputs, one per step that
touched the request; :meth:`AsyncEngine.generate` wraps both in one async generator. If the consumer
stops early (client disconnect → task cancelled, ``aclose()``, or the stream is garbage-collected
unfinished), ``abort`` is submitted and the engine frees the request's KV blocks on its next turn.
Commands run in submission order, so an ``abort`` always follows its ``add``.

Failure handling: an exception from ``step()`` is logged with its traceback; every in-flight
request receives :class:`EngineStepError` (HTTP 500) and is aborted in the engine; the loop goes on
serving new requests. If steps keep failing even with nothing in flight, the loop backs off and
:attr:`AsyncEngine.healthy` turns False (``/health`` answers 503).

Metrics invariant: :meth:`ServerMetrics.sync_engine` runs after every step *before* the step's
outputs are delivered, so a client that has seen its request finish also finds it in ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.llm_engine import LLMEngine
from tandem.errors import TandemError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.metrics import ServerMetrics

logger = logging.getLogger("tandem.server")

_UNHEALTHY_AFTER = 5  # consecutive failed steps before /health reports 503


class EngineStepError(TandemError):
    """The engine failed while serving this request (HTTP 500); the server keeps running."""


class EngineDeadError(TandemError):
    """The engine thread is not running (shut down or crashed); no request can be served (HTTP 503)."""


@dataclass
class _Stream:
    """Where one request's outputs go: a queue living on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Thread-safe enqueue; False if the loop is gone (the request's client left with it)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # event loop closed
            return False
        return True


@dataclass
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: _Stream
    ack: asyncio.Future[None]
    arrival: float


@dataclass
class _Abort:
    request_ids: list[str]


class RequestStream:
    """The outputs of one accepted request, as an async iterator of cumulative RequestOutputs.

    Iteration ends after the output with ``finished=True``; an engine failure is raised from it.
    ``abort()`` asks the engine to drop the request (no-op once it finished or was aborted).
    """

    def __init__(self, owner: AsyncEngine, request_id: str,
                 queue: asyncio.Queue[RequestOutput | BaseException]) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._queue = queue

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine thread already dropped it
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    def __del__(self) -> None:
        # Safety net: a stream dropped unfinished (e.g. a streaming response cancelled before its
        # body iterator ever started) must not keep generating. abort() is thread-safe.
        if not self.finished:
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Serve an :class:`LLMEngine` to asyncio code; see the module docstring for the threading."""

    def __init__(self, engine: LLMEngine, model_name: str = "tandem", *, start: bool = True,
                 metrics_prefix: str = "tandem") -> None:
        self.engine = engine
        k = engine.spec.num_speculative_tokens if getattr(engine, "spec", None) is not None else 0
        self.metrics = ServerMetrics(model_name, num_speculative_tokens=k, prefix=metrics_prefix)
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._consecutive_failures = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        if start:
            self.start()

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests still in flight receive EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def healthy(self) -> bool:
        return self.is_running and self._consecutive_failures < _UNHEALTHY_AFTER

    # ---- asyncio side -------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | Sequence[int] | None, params: SamplingParams,
                          prompt_token_ids: Sequence[int] | None = None,
                          arrival_time: float | None = None) -> RequestStream:
        """Submit one request; return its output stream once the engine thread has accepted it.

        Raises the engine's RequestError/SamplingParamsError if it rejects the request, and
        EngineDeadError if the engine thread is not running. The caller owns the stream: iterate
        it, or call ``abort()`` (a no-op once finished) when giving up on it.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        ack: asyncio.Future[None] = loop.create_future()
        text = prompt if isinstance(prompt, str) else None
        ids = list(prompt_token_ids) if prompt_token_ids is not None else (
            None if prompt is None or isinstance(prompt, str) else list(prompt))
        self._submit(_Add(request_id, text, ids, params, stream, ack,
                          time.monotonic() if arrival_time is None else arrival_time))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added meanwhile
            raise
        return RequestStream(self, request_id, stream.queue)

    async def generate(self, prompt: str | Sequence[int] | None, params: SamplingParams, request_id: str,
                       prompt_token_ids: Sequence[int] | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its cumulative outputs until it finishes.

        Raises as :meth:`add_request` (before any output), EngineStepError if the engine fails
        while serving it. Leaving the iteration early (break, cancellation) aborts the request.
        """
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort request(s) (thread-safe, returns at once). Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids:
            self._submit(_Abort(ids))

    def _submit(self, cmd: _Add | _Abort) -> None:
        with self._cond:
            self._commands.append(cmd)
            self._cond.notify()

    # ---- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine thread started")
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                try:
                    self._iteration(commands)
                except Exception:  # a bug outside step(): log it, fail what is in flight, go on
                    logger.exception("engine loop error")
                    self._fail_all(EngineStepError("internal server error in the engine loop"))
        finally:
            self._stopping = True
            with self._cond:
                leftover, self._commands = self._commands, []
            for cmd in leftover:
                if isinstance(cmd, _Add):
                    _resolve(cmd.ack, EngineDeadError("the engine has shut down"))
            for stream in self._streams.values():
                stream.put(EngineDeadError("the engine has shut down"))
            self._streams.clear()
            logger.info("engine thread stopped")

    def _iteration(self, commands: list[_Add | _Abort]) -> None:
        for cmd in commands:
            if isinstance(cmd, _Add):
                self._apply_add(cmd)
            else:
                self._apply_abort(cmd)
        outputs: list[RequestOutput] = []
        if self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step()
            except Exception as e:
                self._on_step_failure(e)
                return
            self._consecutive_failures = 0
        now = time.monotonic()
        self._publish_metrics(outputs, now)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted earlier: nobody is listening
            if out.finished:
                del self._streams[out.request_id]
            if not stream.put(out):
                self._streams.pop(out.request_id, None)
                if not out.finished:
                    self._abort_in_engine([out.request_id])

    def _apply_add(self, cmd: _Add) -> None:
        if cmd.ack.cancelled():  # the client left before we got here; its abort follows
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, prompt_token_ids=cmd.prompt_token_ids)
        except TandemError as e:
            _resolve(cmd.ack, e)
            return
        except Exception as e:  # not the user's fault: log it, 500 for this request only
            logger.exception("add_request failed for %s", cmd.request_id)
            _resolve(cmd.ack, EngineStepError(f"internal error while adding the request: {e}"))
            return
        self._streams[cmd.request_id] = cmd.stream
        self.metrics.track(cmd.request_id, cmd.arrival)
        _resolve(cmd.ack, None)

    def _apply_abort(self, cmd: _Abort) -> None:
        for rid in cmd.request_ids:
            self._streams.pop(rid, None)
            self.metrics.forget(rid)
        self._abort_in_engine(cmd.request_ids)

    def _abort_in_engine(self, ids: list[str]) -> None:
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("abort_request failed for %s", ids)

    def _publish_metrics(self, outputs: list[RequestOutput], now: float) -> None:
        try:
            self.metrics.sync_engine(self.engine)
            self.metrics.observe_outputs(outputs, now)
        except Exception:  # metrics must never take serving down
            logger.exception("metrics update failed")

    def _on_step_failure(self, exc: Exception) -> None:
        self._consecutive_failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        logger.error("engine step failed (%d in a row); failing %d in-flight request(s)",
                     self._consecutive_failures, len(self._streams), exc_info=exc)
        had_streams = bool(self._streams)
        self._fail_all(EngineStepError(f"the engine failed while serving this request: {self.last_error}"))
        if not had_streams:  # failing with nothing in flight: do not spin
            time.sleep(min(1.0, 0.01 * 2 ** min(self._consecutive_failures, 7)))

    def _fail_all(self, exc: TandemError) -> None:
        ids = list(self._streams)
        for rid, stream in self._streams.items():
            stream.put(type(exc)(str(exc)))  # one instance per request: each gets its own traceback
            self.metrics.forget(rid)
        self._streams.clear()
        if ids:
            self._abort_in_engine(ids)
        try:
            self.metrics.sync_engine(self.engine)
        except Exception:
            logger.exception("metrics update failed")


def _resolve(fut: asyncio.Future[Any], exc: BaseException | None) -> None:
    """Complete ``fut`` from another thread (no-op if it was cancelled or its loop is gone)."""

    def done() -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    try:
        fut.get_loop().call_soon_threadsafe(done)
    except RuntimeError:
        pass


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index.

    An error from any stream is raised at once; leaving the iteration stops the helper tasks (the
    caller still owns the streams and aborts them).
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The last (finished) output of each stream, in order."""
    last: dict[int, RequestOutput] = {}
    async for i, out in merge_streams(streams):
        last[i] = out
    return [last[i] for i in range(len(streams))]
