"""The server's generation worker: a bounded queue and ONE thread that owns the Target.

Owns: admission (a bounded FIFO of waiting jobs; a full queue refuses at once, and
`estimated_wait` tells a refused client when the queue should have drained, from the run times
of the recent jobs), running jobs one at a time on a single worker thread, cancellation (a
per-job flag checked between text deltas), the per-request timeout, and turning every outcome
(finished, timed out, cancelled, failed) into an event for whoever submitted the job. Does not
own HTTP, JSON, validation or prompt encoding: the app encodes and validates a request into a
`verispec.api.Request` before submitting it here.

Why one thread: a `Target` holds a single per-request KV cache, so one Target serves one request
at a time; and generation is CPU-bound torch code (which releases the GIL inside its kernels), so
running it on a thread of its own keeps the asyncio event loop free to accept connections, answer
/health and /metrics, and refuse overload while a request is being generated. Requests are served
strictly in arrival order; there is no batching.

Events flow out through the job's `notify` callback, called on the worker thread (the app turns
them into asyncio-queue puts with `loop.call_soon_threadsafe`):
  Started  the job left the queue and its generation begins
  Delta    a piece of final text (from `TextStream`)
  Finished the generation ended: EOS, stop string, max_tokens, timeout or cancellation
  Failed   the generation raised (a `VerispecError` is the user's mistake, anything else a bug),
           or the job's deadline passed before it left the queue (`QueueTimeout`)

Cancellation and timeouts are checked between the deltas of `TextStream` (after each step that
produced text): the worker then stops iterating, which closes the stream and so stops the decode
loop. A step that produces no text (special tokens, a tail held back for a stop string) is not a
check point; every step commits at least one token, so max_tokens still bounds the wait.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..api import GenerationResult, Request, TextStream
from ..errors import VerispecError
from ..model import Target
from ..stats import GenerationStats

log = logging.getLogger("verispec.server")

QUEUED, RUNNING, DONE = "queued", "running", "done"
RECENT_JOBS = 32  # run times kept for the wait estimate of a refused request


# -- events ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    queue_s: float  # seconds the job waited in the queue


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    """The generation ended. `reason`: "eos", "stop" (a stop string), "length" (max_tokens),
    "timeout" (the request ran past its deadline) or "cancelled" (the client went away)."""

    result: GenerationResult
    text: str  # exactly the concatenated deltas (never a held-back tail)
    reason: str
    queue_s: float


@dataclass(frozen=True)
class Failed:
    error: BaseException
    user_error: bool  # a VerispecError: the request was bad, not the server


Event = Started | Delta | Finished | Failed


class QueueFull(Exception):
    """The queue already holds `max_queue` waiting jobs."""


class QueueTimeout(Exception):
    """The job's deadline passed before it left the queue; it was never started."""


class WorkerStopped(Exception):
    """The worker is shutting down and takes no new jobs."""


class Observer(Protocol):
    """What the worker reports for metrics (see `metrics.ServerMetrics`)."""

    def first_token(self, seconds: float) -> None: ...
    def finished(self, stats: GenerationStats, reason: str) -> None: ...
    def failed(self, method: str, user_error: bool) -> None: ...


class _NoObserver:
    def first_token(self, seconds: float) -> None:
        pass

    def finished(self, stats: GenerationStats, reason: str) -> None:
        pass

    def failed(self, method: str, user_error: bool) -> None:
        pass


_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    """One request on its way through the worker.

    request: the validated library request. notify: called on the worker thread with each
    event; it must not block. deadline: a `time.monotonic()` value after which the job ends with
    reason "timeout" (None: no limit); it counts from the request's arrival, queue wait included.
    """

    request: Request
    notify: Callable[[Event], None]
    deadline: float | None = None
    created: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=lambda: next(_ids))
    state: str = QUEUED
    cancel_reason: str | None = None
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _emit(self, event: Event) -> None:
        try:
            self.notify(event)
        except Exception:  # a listener that went away (closed event loop) must not stop the worker
            log.debug("job %s: event %s not delivered", self.id, type(event).__name__, exc_info=True)


class Worker:
    """A bounded FIFO of jobs served one at a time by one thread that owns `target`."""

    def __init__(self, target: Target, max_queue: int = 16, observer: Observer | None = None):
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        self.target = target
        self.max_queue = max_queue
        self.observer = observer or _NoObserver()
        self._waiting: collections.deque[Job] = collections.deque()
        self._current: Job | None = None
        self._current_started = 0.0
        # Seconds the last RECENT_JOBS jobs held the worker (queue wait not included).
        self.recent_run_s: collections.deque[float] = collections.deque(maxlen=RECENT_JOBS)
        self._lock = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- state -------------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        """Jobs waiting (the running one not included)."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def estimated_wait(self) -> float:
        """Seconds until the jobs waiting and running now are done: their number times the mean
        run time of the recent jobs (before any job finished, the running job's time so far)."""
        with self._lock:
            ahead = len(self._waiting) + (self._current is not None)
            recent = list(self.recent_run_s)
            running_for = time.monotonic() - self._current_started if self._current is not None else 0.0
        mean = sum(recent) / len(recent) if recent else running_for
        return ahead * mean

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="verispec-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Refuse new jobs, cancel the waiting and running ones, and join the thread."""
        with self._lock:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            current = self._current
            self._lock.notify_all()
        for job in waiting:
            job.state = DONE
            job._emit(Failed(WorkerStopped("the server is shutting down"), user_error=False))
        if current is not None:
            self._set_cancel(current, "cancelled")
        if self._thread is not None:
            self._thread.join(timeout)

    # -- admission and cancellation -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job`; raises QueueFull when `max_queue` jobs are already waiting."""
        with self._lock:
            if self._stopping:
                raise WorkerStopped("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._waiting.append(job)
            self._lock.notify()

    def cancel(self, job: Job, reason: str = "cancelled") -> bool:
        """Cancel `job`. A waiting job leaves the queue at once (returns True; no event follows);
        a running one stops at its next check point and then reports Finished (returns False)."""
        with self._lock:
            if job.state == QUEUED:
                try:
                    self._waiting.remove(job)
                except ValueError:
                    pass
                job.state = DONE
                job.cancel_reason = reason
                job._cancel.set()
                return True
        self._set_cancel(job, reason)
        return False

    @staticmethod
    def _set_cancel(job: Job, reason: str) -> None:
        if not job._cancel.is_set():
            job.cancel_reason = reason
            job._cancel.set()

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                job.state = RUNNING
                self._current = job
                self._current_started = time.monotonic()
            try:
                self._serve(job)
            except BaseException:  # never let one request take the worker down
                log.error("job %s: unexpected error in the worker\n%s", job.id, traceback.format_exc())
            finally:
                job.state = DONE
                with self._lock:
                    self._current = None
                    self.recent_run_s.append(time.monotonic() - self._current_started)

    def _serve(self, job: Job) -> None:
        started = time.monotonic()
        queue_s = started - job.created
        job._emit(Started(queue_s))
        method = job.request.method
        parts: list[str] = []
        reason = ""
        if job.cancelled:  # cancelled between leaving the queue and starting: nobody waits for it
            job._emit(Finished(GenerationResult("", [], list(job.request.prompt_ids), GenerationStats(method)),
                               "", job.cancel_reason or "cancelled", queue_s))
            return
        if job.deadline is not None and started >= job.deadline:
            job._emit(Failed(QueueTimeout(f"the request timed out after {queue_s:.3g} s waiting in the queue"),
                             user_error=False))
            return
        try:
            text_stream = TextStream(self.target, job.request)
            deltas = iter(text_stream)
            try:
                for delta in deltas:
                    if not parts:
                        self.observer.first_token(time.monotonic() - job.created)
                    parts.append(delta)
                    job._emit(Delta(delta))
                    # Check points: between deltas, i.e. between decode steps.
                    if job.cancelled:
                        reason = job.cancel_reason or "cancelled"
                        break
                    if job.deadline is not None and time.monotonic() >= job.deadline:
                        reason = "timeout"
                        break
            finally:
                deltas.close()  # stops the decode loop; sets text_stream.result once iteration began
            result = text_stream.result
            assert result is not None
        except VerispecError as error:
            self.observer.failed(method, True)
            job._emit(Failed(error, user_error=True))
            return
        except Exception as error:
            log.error("job %s: generation failed\n%s", job.id, traceback.format_exc())
            self.observer.failed(method, False)
            job._emit(Failed(error, user_error=False))
            return
        if not parts and not reason:
            self.observer.first_token(time.monotonic() - job.created)  # ended without any text
        reason = reason or result.stats.stop_reason or "length"
        self.observer.finished(result.stats, reason)
        job._emit(Finished(result, "".join(parts), reason, queue_s))
