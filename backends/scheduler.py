"""The scheduler: one worker thread that owns the model and runs every request one step at a time, round-robin."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

StepKind = Literal["prefill", "decode"]
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """Describe one step the worker ran: which job, what kind, how many tokens, when and how long."""

    job_id: int
    kind: StepKind
    tokens: int
    started: float
    seconds: float


StepListener = Callable[[StepRecord], None]


class Job(Protocol):
    """A unit of model work that advances one bounded step per call."""

    job_id: int

    @property
    def finished(self) -> bool:
        """Say whether the job has nothing left to run."""
        ...

    @property
    def cancelled(self) -> bool:
        """Say whether the job's consumer has gone."""
        ...

    def step(self) -> tuple[StepKind, int]:
        """Run one prefill chunk or one decode step; return its kind and the tokens it computed."""
        ...

    def publish(self) -> None:
        """Deliver what the last step produced (a token, or the end of a prefill) to the job's consumer."""
        ...

    def fail(self, error: BaseException) -> None:
        """Deliver an error to the job's consumer and drop the job's state."""
        ...

    def release(self) -> None:
        """Drop the job's state (its KV cache) once it is cancelled."""
        ...


class Scheduler:
    """Run jobs on one worker thread, a step of each in turn, so no request waits for another to finish."""

    def __init__(
        self,
        *,
        name: str = "prefixgate-model",
        on_step: StepListener | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._on_step = on_step
        self._clock = clock
        self._queue: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._ids = itertools.count(1)
        # A daemon thread, so a process that forgets aclose() still exits; close() joins it properly.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def next_job_id(self) -> int:
        """Return a fresh job id (1, 2, ... in submission order when taken just before submit)."""
        return next(self._ids)

    def submit(self, job: Job) -> None:
        """Queue a job behind the ones already running."""
        with self._wake:
            if self._closed:
                raise RuntimeError("the backend is closed; create a new one to run more requests")
            self._queue.append(job)
            self._wake.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking jobs, fail the queued ones, and wait for the step in progress to end."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        """Say whether close() was called."""
        return self._closed

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    pending, self._queue = list(self._queue), collections.deque()
                    break
                job = self._queue.popleft()
            self._advance(job)
        for job in pending:
            job.fail(RuntimeError("the backend was closed while this request was running"))

    def _advance(self, job: Job) -> None:
        # Cancellation is honoured here, before each step: a job whose consumer left costs at most one more step.
        if job.cancelled:
            job.release()
            return
        started = self._clock()
        try:
            with torch.inference_mode():
                kind, tokens = job.step()
        except Exception as error:  # the request fails, the worker keeps serving the others
            _log.debug("job %d failed", job.job_id, exc_info=True)
            job.fail(error)
            return
        if self._on_step is not None:
            try:
                self._on_step(StepRecord(job.job_id, kind, tokens, started, self._clock() - started))
            except Exception:  # a broken listener must not take the worker down with it
                _log.exception("step listener failed")
        # Results go out after the step is recorded, so whoever sees a stream end also sees all its steps.
        job.publish()
        if job.finished:
            return
        if job.cancelled:
            job.release()
            return
        with self._wake:
            if not self._closed:
                self._queue.append(job)
                return
        job.fail(RuntimeError("the backend was closed while this request was running"))
