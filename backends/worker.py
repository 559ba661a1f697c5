"""The worker: the one thread that owns the model and runs a step at a time for every running request.

A step is data: the scheduler returns a plan (which sequences, how many tokens each), the runner computes it in one
forward pass, and each sequence takes its result. Results go out after the step, so whoever sees a stream end also
sees every step it took.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from prefixgate.backends.model_runner import ModelRunner, StepInput
from prefixgate.backends.scheduler import Scheduled, Scheduler
from prefixgate.backends.sequence import Sequence, StepKind
from prefixgate.errors import ModelStoppedError
from prefixgate.threads import use_threads

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Work:
    """What one sequence computed in a step."""

    seq_id: int
    kind: StepKind
    tokens: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    """Describe one step the worker ran: each sequence's share, when it started and how long it took."""

    work: tuple[Work, ...]
    started: float
    seconds: float

    def tokens(self, kind: StepKind | None = None) -> int:
        """Return the tokens computed in this step, of one kind or of both."""
        return sum(w.tokens for w in self.work if kind is None or w.kind == kind)

    def seq_ids(self) -> tuple[int, ...]:
        """Return the ids of the sequences that took part."""
        return tuple(w.seq_id for w in self.work)


StepListener = Callable[[StepRecord], None]
# How long prompts that would start a step alone wait for requests admitted and on their way (fetching a cached
# prefix into memory: 25 to 45 ms for a 4k-token prefix from the host tier on 2 cores), so that prompts arriving
# together are prefilled in the same steps instead of the first alone and the rest one step later.
GATHER_SECONDS = 0.05


class Worker:
    """Run sequences on one thread, all of them in every step, so no request waits for another to finish."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        name: str = "prefixgate-model",
        on_step: StepListener | None = None,
        clock: Callable[[], float] = time.perf_counter,
        gather_seconds: float = GATHER_SECONDS,
    ) -> None:
        self._runner = runner
        self._scheduler = scheduler
        self._on_step = on_step
        self._clock = clock
        self._gather_seconds = gather_seconds
        self._arrivals: list[Sequence] = []
        self._expected = 0  # requests admitted and on their way: expect()ed, not yet submitted nor given up
        self.gathering = False  # whether the thread waits for them now (see _gather)
        self._running: list[Sequence] = []  # oldest first; touched by the worker thread only
        self._wake = threading.Condition()
        self._closed = False
        self._failure: str | None = None
        self._ids = itertools.count(1)
        self._threads = torch.get_num_threads()  # the constructing thread's count: every core unless told otherwise
        # A daemon thread, so a process that forgets aclose() still exits; close() joins it properly.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def prefill_seconds(self, tokens: int) -> float | None:
        """Return what computing a prompt's first `tokens` tokens alone would take, as measured lately (see
        `Scheduler.prefill_seconds`); None before a prompt was."""
        return self._scheduler.prefill_seconds(tokens)

    def next_seq_id(self) -> int:
        """Return a fresh sequence id (1, 2, ... in submission order when taken just before submit)."""
        return next(self._ids)

    def expect(self) -> None:
        """Count a request on its way to `submit` (admitted, fetching its cached prefix): see GATHER_SECONDS."""
        with self._wake:
            self._expected += 1

    def unexpect(self) -> None:
        """Stop counting a request that was expected and will not be submitted."""
        with self._wake:
            self._expected -= 1
            self._wake.notify()

    def submit(self, seq: Sequence, *, expected: bool = False) -> None:
        """Add a sequence to the next step (`expected`: one counted by `expect()`, which this ends); raise
        ModelStoppedError when the thread has stopped on a fault."""
        with self._wake:
            if expected:
                self._expected -= 1
            if self._failure is not None:
                raise ModelStoppedError(self._failure)
            if self._closed:
                raise RuntimeError("the backend is closed; create a new one to run more requests")
            self._arrivals.append(seq)
            self._wake.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking sequences, fail the running ones, and wait for the step in progress to end."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        """Say whether close() was called."""
        return self._closed

    @property
    def failure(self) -> str | None:
        """Say why the thread stopped on a fault, or None while it serves (or was closed on purpose)."""
        return self._failure

    def _run(self) -> None:
        use_threads(self._threads)  # this thread's OpenMP pool, the one a server keeps (see prefixgate.threads)
        try:
            self._serve()
        except BaseException as error:  # a fault outside any one request's step: nothing more can run
            _log.critical("the model thread stopped", exc_info=True)
            with self._wake:
                self._failure = f"the model thread stopped ({type(error).__name__}: {error}); restart the server"
                self._closed = True
        stopped = ModelStoppedError(self._failure) if self._failure else None
        with self._wake:
            left = [s for s in self._running + self._arrivals if not s.finished]
            self._arrivals = []
        for seq in left:
            seq.fail(stopped or RuntimeError("the backend was closed while this request was running"))

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._arrivals and not self._running and not self._closed:
                    self._wake.wait()
                self._gather()
                if self._closed:
                    break
                self._running += self._arrivals
                self._arrivals = []
            # Cancellation is honoured here, before each step: a sequence whose consumer left costs at most one more.
            for seq in [s for s in self._running if s.cancelled]:
                seq.release()
            self._running = [s for s in self._running if not s.cancelled]
            plan = self._scheduler.plan(self._running)
            if plan:
                self._step(plan)
            self._running = [s for s in self._running if not s.finished]

    def _gather(self) -> None:
        """When new prompts are ready and nothing decodes, wait up to `gather_seconds` for the requests on their way
        (call with the lock)."""
        if not self._arrivals or any(not seq.prefill_left for seq in self._running):
            return  # streams are decoding: they do not wait, and newcomers join the next step
        deadline = time.monotonic() + self._gather_seconds
        self.gathering = True
        while self._expected > 0 and not self._closed and (left := deadline - time.monotonic()) > 0:
            self._wake.wait(left)
        self.gathering = False

    def _step(self, plan: list[Scheduled]) -> None:
        started = self._clock()
        # A step that gives every position's logits of a prompt (its log probabilities) pays for them over the whole
        # vocabulary: it says little of what steps cost, and the scheduler's measures leave it out.
        scored = any(item.seq.every_logit for item in plan)
        try:
            with torch.inference_mode():
                logits = self._forward(plan)  # logits: [rows, vocab], a row a sequence or one a token fed (see rows)
        except Exception as error:
            if len(plan) == 1:  # the request fails, the worker keeps serving the others
                _log.debug("sequence %d failed", plan[0].seq.seq_id, exc_info=True)
                plan[0].seq.fail(error)
                return
            # One sequence's input broke the whole step: run each alone, so only that one fails. A sequence's K
            # and V for this step are rewritten by its rerun, since it has not advanced.
            for item in plan:
                self._step([item])
            return
        work = []
        rows = [item.tokens if item.seq.every_logit else 1 for item in plan]
        for item, row in zip(plan, torch.split(logits, rows), strict=True):
            try:
                with torch.inference_mode():
                    kind = item.seq.advance(item.tokens, row)
            except Exception as error:  # its block callback or sampler failed: that request alone ends
                _log.debug("sequence %d failed", item.seq.seq_id, exc_info=True)
                item.seq.fail(error)
                continue
            work.append(Work(item.seq.seq_id, kind, item.tokens))
        seconds = self._clock() - started
        if not scored:
            self._scheduler.costs.observe(plan, seconds)
        if self._on_step is not None:
            try:
                self._on_step(StepRecord(tuple(work), started, seconds))
            except Exception:  # a broken listener must not take the worker down with it
                _log.exception("step listener failed")
        for item in plan:
            item.seq.publish()

    def _forward(self, plan: list[Scheduled]) -> torch.Tensor:
        if self._scheduler.packed:
            inputs = []
            for item in plan:
                token_ids = item.seq.feed(item.tokens)
                memory = item.seq.memory
                buffer = memory.buffer
                assert buffer is not None, "packed steps run in KV buffers"
                every = item.seq.every_logit
                inputs.append(StepInput(token_ids, buffer, item.seq.computed, memory.offset, memory.shared, every))
            return self._runner.run(inputs)
        (item,) = plan
        seq = item.seq
        if seq.cache is None:
            seq.cache = DynamicCache(config=self._runner.config)
        return self._runner.run_alone(seq.feed(item.tokens), seq.cache, every_logit=seq.every_logit)
