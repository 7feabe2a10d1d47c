"""The server's generation worker: admission, and ONE thread that owns the Target and steps a batch.

Owns: admission (a bounded queue of waiting requests, the choices of one counted once; a full
queue refuses at once, and
`estimated_wait` tells a refused client when a slot should free up, from the run times of the
recent jobs), the worker thread that runs every admitted job's decode loop together in a
continuous batch (`batch.BatchEngine`: jobs join and leave the running batch between steps,
prompts are prefilled in chunks beside the decoding rows), each job's text (`lifecycle.Generation`:
incremental detokenization and stop strings, applied as its tokens arrive), cancellation (a
per-job flag, acted on between steps), the per-request timeout, and turning every outcome
(finished, timed out, cancelled, failed) into an event for whoever submitted the job. Does not
own HTTP, JSON, validation or prompt encoding: the app encodes and validates a request into a
`verispec.api.Request` before submitting it here.

Why one thread: generation is CPU-bound torch and C code that uses every core for each step (its
kernels release the GIL); one thread steps the batch, so the asyncio event loop stays free to
accept connections, answer /health and /metrics and refuse overload. Exactness under load comes
from the batch engine: a request's output is the one it gives alone, whatever else runs. A target
that cannot batch exactly (no paged KV: float32 numerics, transformers' forward, a GPU) serves
its jobs one at a time, in arrival order.

Events flow out through the job's `notify` callback, called on the worker thread (the app turns
them into asyncio-queue puts with `loop.call_soon_threadsafe`); `notify` must not block, so a
slow reader never stalls the batch (its events queue up, at most one per committed token):
  Started  the job joined the running batch
  Delta    a piece of final text, with the ids (and log-probabilities, if asked) of the tokens
           committed in that step
  Finished the generation ended: EOS, stop string, max_tokens, timeout or cancellation
  Failed   the generation raised (a `VerispecError` is the user's mistake, anything else a bug),
           or the job's deadline passed before it joined the batch (`QueueTimeout`)
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

from ..core.batch import DEFAULT_MAX_ROWS, BatchEngine
from ..core.batch import Job as EngineJob
from ..errors import VerispecError
from ..request.lifecycle import Generation, GenerationResult, Request
from ..target.model import Target
from ..runtime.openmp import release_thread_pool
from ..core.stats import GenerationStats

log = logging.getLogger("verispec.server")

QUEUED, RUNNING, DONE = "queued", "running", "done"
RECENT_JOBS = 32  # run times kept for the wait estimate of a refused request
DEFAULT_MAX_SEQUENCES = 16  # requests decoding together


# -- events ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    queue_s: float  # seconds the job waited before joining the batch


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...] = ()  # the tokens committed with it (their text may come later)
    logprobs: tuple = ()  # per token (logprob, [(id, logprob), ...]) when the job asked for them


@dataclass(frozen=True)
class Finished:
    """The generation ended. `reason`: "eos", "stop" (a stop string), "length" (max_tokens),
    "timeout" (the request ran past its deadline) or "cancelled" (the client went away)."""

    result: GenerationResult
    text: str  # exactly the concatenated deltas (never a held-back tail)
    reason: str
    queue_s: float
    logprobs: tuple = ()  # per token of result.token_ids, when asked for


@dataclass(frozen=True)
class Failed:
    error: BaseException
    user_error: bool  # a VerispecError: the request was bad, not the server


Event = Started | Delta | Finished | Failed


class QueueFull(Exception):
    """The queue already holds `max_queue` waiting jobs."""


class QueueTimeout(Exception):
    """The job's deadline passed before it joined the batch; it was never started."""


class WorkerStopped(Exception):
    """The worker is shutting down and takes no new jobs."""


class Observer(Protocol):
    """What the worker reports for metrics (see `metrics.ServerMetrics`)."""

    def first_token(self, seconds: float) -> None: ...
    def finished(self, stats: GenerationStats, reason: str) -> None: ...
    def failed(self, method: str, user_error: bool) -> None: ...
    def step(self, rows: int, sequences: int, seconds: float) -> None: ...
    def chunk_gap(self, seconds: float) -> None: ...
    def per_output_token(self, seconds: float) -> None: ...


class _NoObserver:
    def first_token(self, seconds: float) -> None:
        pass

    def finished(self, stats: GenerationStats, reason: str) -> None:
        pass

    def failed(self, method: str, user_error: bool) -> None:
        pass

    def step(self, rows: int, sequences: int, seconds: float) -> None:
        pass

    def chunk_gap(self, seconds: float) -> None:
        pass

    def per_output_token(self, seconds: float) -> None:
        pass


_ids = itertools.count(1)


@dataclass(eq=False)
class Ticket:
    """One request on its way through the worker (its ticket: the batch engine makes its own `batch.Job` of it).

    request: the validated library request. notify: called on the worker thread with each
    event; it must not block. deadline: a `time.monotonic()` value after which the job ends with
    reason "timeout" (None: no limit); it counts from the request's arrival, queue wait included.
    logprobs: None, or how many top log-probabilities to report per token (0: the chosen token's).
    """

    request: Request
    notify: Callable[[Event], None]
    deadline: float | None = None
    created: float = field(default_factory=time.monotonic)
    logprobs: int | None = None
    id: int = field(default_factory=lambda: next(_ids))
    group: int | None = None  # the first job's id among the choices of one request (`Worker.submit_all`)
    state: str = QUEUED
    cancel_reason: str | None = None
    cancel_flag: threading.Event = field(default_factory=threading.Event, repr=False)
    # the worker thread's own
    generation: Generation | None = field(default=None, repr=False)  # its text, stats and engine job
    parts: list = field(default_factory=list, repr=False)  # the text handed out
    started: float = 0.0
    last_text: float = 0.0
    first_text: float = 0.0

    @property
    def cancelled(self) -> bool:
        return self.cancel_flag.is_set()

    @property
    def engine_job(self) -> EngineJob | None:
        """Its job in the batch engine, once handed over."""
        return self.generation.job if self.generation is not None else None

    def emit(self, event: Event) -> None:
        try:
            self.notify(event)
        except Exception:  # a listener that went away (closed event loop) must not stop the worker
            log.debug("job %s: event %s not delivered", self.id, type(event).__name__, exc_info=True)


class Worker:
    """A bounded queue of jobs, run together by one thread that owns `target` (see the module
    docstring). max_sequences: jobs decoding at once; max_rows: rows of one step's forward."""

    def __init__(self, target: Target, max_queue: int = 16, observer: Observer | None = None,
                 max_sequences: int = DEFAULT_MAX_SEQUENCES, max_rows: int = DEFAULT_MAX_ROWS):
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        self.target = target
        self.max_queue = max_queue
        self.observer = observer or _NoObserver()
        self.engine = BatchEngine(target, max_rows, max_sequences)
        self._inbox: collections.deque[Ticket] = collections.deque()  # submitted, not yet handed to the engine
        self._waiting: list[Ticket] = []  # handed to the engine, not yet running
        self._running: list[Ticket] = []
        # Seconds the last RECENT_JOBS jobs ran (queue wait not included).
        self.recent_run_s: collections.deque[float] = collections.deque(maxlen=RECENT_JOBS)
        self._lock = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- state -------------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        """Requests waiting to join the batch (what `max_queue` bounds): the choices of one request
        count once, until all of them have joined."""
        with self._lock:
            return len({job.id if job.group is None else job.group
                        for jobs in (self._inbox, self._waiting) for job in jobs if job.state == QUEUED})

    @property
    def queued_jobs(self) -> int:
        """Jobs waiting to join the batch (each choice of a request is one)."""
        return len(self._inbox) + len(self._waiting)

    @property
    def running(self) -> int:
        """Jobs in the running batch."""
        return len(self._running)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def max_sequences(self) -> int:
        return self.engine.max_sequences

    def estimated_wait(self) -> float:
        """Seconds until a request sent now should be running: the jobs ahead of it (waiting,
        and running ones, whose places it needs) in rounds of as many as run at once
        (`max_sequences`, or 1 on a target that cannot batch), times the mean run time of the
        recent jobs (before any job finished, the oldest running job's time so far)."""
        with self._lock:
            ahead = self.queued_jobs + len(self._running)
            recent = list(self.recent_run_s)
            started = [job.started for job in self._running]
        mean = sum(recent) / len(recent) if recent else (time.monotonic() - min(started) if started else 0.0)
        at_once = self.max_sequences if self.engine.batches else 1
        return -(-ahead // at_once) * mean

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        # The calling thread (which loaded the target) stops computing: its OpenMP pool would
        # put the worker's pool to sleep between parallel regions (runtime/openmp.py).
        release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="verispec-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Refuse new jobs, cancel the waiting and running ones, and join the thread."""
        with self._lock:
            self._stopping = True
            waiting = list(self._inbox)
            self._inbox.clear()
            for job in self._waiting + self._running:
                self._set_cancel(job, "cancelled")
            self._lock.notify_all()
        for job in waiting:
            job.state = DONE
            job.emit(Failed(WorkerStopped("the server is shutting down"), user_error=False))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- admission and cancellation -------------------------------------------------------------
    def submit(self, job: Ticket) -> None:
        """Queue `job`; raises QueueFull when `max_queue` jobs are already waiting."""
        self.submit_all([job])

    def submit_all(self, jobs: list[Ticket]) -> None:
        """Queue `jobs` together (the choices of one request, counted as one request), or none of
        them (QueueFull: `max_queue` requests are already waiting)."""
        with self._lock:
            if self._stopping:
                raise WorkerStopped("the server is shutting down")
            if self.queue_length >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            for job in jobs:
                job.group = jobs[0].id
            self._inbox.extend(jobs)
            self._lock.notify()

    def cancel(self, job: Ticket, reason: str = "cancelled") -> bool:
        """Cancel `job`. A waiting job leaves the queue at once (returns True; no event follows);
        a running one stops at its next step and then reports Finished (returns False)."""
        with self._lock:
            if job.state == QUEUED:
                if job in self._inbox:
                    self._inbox.remove(job)
                job.state = DONE
                job.cancel_reason = reason
                job.cancel_flag.set()  # the thread takes it out of the engine's queue
                self._lock.notify()
                return True
        self._set_cancel(job, reason)
        return False

    def _set_cancel(self, job: Ticket, reason: str) -> None:
        if not job.cancel_flag.is_set():
            job.cancel_reason = reason
            job.cancel_flag.set()
            with self._lock:
                self._lock.notify()

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._inbox and not self._waiting and not self._running and not self._stopping:
                    self._lock.wait()
                if self._stopping and not self._running and not self._waiting:
                    return
                arrived = list(self._inbox)
                self._inbox.clear()
            try:
                for job in arrived:
                    self._hand_over(job)
                self._apply_cancellations()
                if self._waiting or self._running:
                    self._step()
            except BaseException:  # never let one request take the worker down
                log.error("unexpected error in the worker\n%s", traceback.format_exc())
                for job in self._waiting + self._running:  # they leave the engine too, their blocks freed
                    if job.engine_job is not None:
                        self.engine.cancel(job.engine_job, "error")
                    self._fail(job, RuntimeError("the worker failed"), user_error=False)

    def _hand_over(self, job: Ticket) -> None:
        """Build `job`'s recipe and give it to the engine (a bad request fails here)."""
        if job.cancelled:
            return  # cancelled while waiting: its canceller was answered
        if job.deadline is not None and time.monotonic() >= job.deadline:
            self._fail(job, QueueTimeout(f"the request timed out after {time.monotonic() - job.created:.3g} s "
                                         f"waiting in the queue"), user_error=False)
            return
        try:
            generation = Generation(self.target, job.request, job.logprobs)
            generation.submit(self.engine)
            job.generation = generation
        except VerispecError as error:
            self._fail(job, error, user_error=True)
            return
        except Exception as error:  # noqa: BLE001 - a bug in building one request fails that request
            log.error("job %s: could not start\n%s", job.id, traceback.format_exc())
            self._fail(job, error, user_error=False)
            return
        self._waiting.append(job)

    def _apply_cancellations(self) -> None:
        """Jobs cancelled (or past their deadline) since the last step leave the batch."""
        now = time.monotonic()
        for job in list(self._waiting):
            if job.cancelled:  # answered by `cancel` already: no event
                self.engine.cancel(job.engine_job, job.cancel_reason or "cancelled")
                self._waiting.remove(job)
            elif job.deadline is not None and now >= job.deadline:
                self.engine.cancel(job.engine_job, "timeout")
                self._waiting.remove(job)
                self._fail(job, QueueTimeout(f"the request timed out after {now - job.created:.3g} s waiting in "
                                             f"the queue"), user_error=False)
        for job in list(self._running):
            if job.cancelled:
                self.engine.cancel(job.engine_job, job.cancel_reason or "cancelled")
                self._end(job, job.cancel_reason or "cancelled")
            elif job.deadline is not None and now >= job.deadline:
                self.engine.cancel(job.engine_job, "timeout")
                self._end(job, "timeout")

    def _step(self) -> None:
        byengine_job = {id(job.engine_job): job for job in self._waiting + self._running}
        self.engine.admit()
        for engine_job in self.engine.running:  # joined the batch now
            job = byengine_job.get(id(engine_job))
            if job is not None and job.state == QUEUED:
                self._begin(job)
        started = time.perf_counter()
        events = self.engine.step()
        self.observer.step(self.engine.last_rows, len(self.engine.running), time.perf_counter() - started)
        for engine_job, committed in events:
            job = byengine_job.get(id(engine_job))
            if job is None or job.state == DONE:
                continue  # cancelled while it was joining: it leaves at the next step
            if job.state == QUEUED:  # joined and ended in one step
                self._begin(job)
            self._deliver(job, committed)

    def _begin(self, job: Ticket) -> None:
        with self._lock:
            if job.state != QUEUED:
                return
            job.state = RUNNING
            self._waiting.remove(job)
            self._running.append(job)
        job.started = time.monotonic()
        job.emit(Started(job.started - job.created))

    def _deliver(self, job: Ticket, committed: list[int]) -> None:
        """A job's tokens of this step: its text so far as a Delta, its end as Finished or Failed
        (a stop string ends its engine job: `Generation.push`)."""
        engine_job = job.engine_job
        if committed:
            delta, ids, logprobs = job.generation.push(committed)
            if delta or logprobs:
                now = time.monotonic()
                if not job.parts and delta:
                    job.first_text = now
                    self.observer.first_token(now - job.created)
                elif delta:
                    self.observer.chunk_gap(now - job.last_text)
                if delta:
                    job.parts.append(delta)
                    job.last_text = now
                job.emit(Delta(delta, ids, logprobs))
        if engine_job.done:
            if engine_job.error is not None:
                user = isinstance(engine_job.error, VerispecError)
                if not user:
                    log.error("job %s: generation failed: %r", job.id, engine_job.error)
                self._fail(job, engine_job.error, user_error=user)
            else:
                self._end(job, engine_job.stats.stop_reason or engine_job.finish_reason or "length")

    def _end(self, job: Ticket, reason: str) -> None:
        """Finished: the text so far (the held-back tail too, unless cut short), its stats."""
        generation = job.generation
        cut_short = reason in ("cancelled", "timeout")
        if not cut_short:
            tail = generation.finish()
            if tail:
                if not job.parts:
                    job.first_text = time.monotonic()
                    self.observer.first_token(job.first_text - job.created)
                job.parts.append(tail)
                job.last_text = time.monotonic()
                job.emit(Delta(tail))
        result = generation.result("".join(job.parts) if cut_short else None)
        stats = result.stats
        stats.stop_reason = reason if cut_short else stats.stop_reason or reason
        if not job.parts:
            self.observer.first_token(time.monotonic() - job.created)  # ended without any text
        elif stats.new_tokens > 1:
            self.observer.per_output_token((job.last_text - job.first_text) / (stats.new_tokens - 1))
        logprobs = generation.kept_logprobs
        self.observer.finished(stats, reason)
        self._leave(job)
        with self._lock:
            self.recent_run_s.append(time.monotonic() - (job.started or job.created))
        job.emit(Finished(result, "".join(job.parts), reason, job.started - job.created if job.started else 0.0,
                           logprobs))

    def _fail(self, job: Ticket, error: BaseException, user_error: bool) -> None:
        self.observer.failed(job.request.method, user_error)
        self._leave(job)
        job.emit(Failed(error, user_error=user_error))

    def _leave(self, job: Ticket) -> None:
        """`job` is done: out of the waiting or running list."""
        with self._lock:
            if job in self._running:
                self._running.remove(job)
            if job in self._waiting:
                self._waiting.remove(job)
            job.state = DONE
