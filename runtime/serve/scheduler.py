"""One model, one stream at a time: the compute gate, the request queue and the worker that owns the API session.

    gate = ComputeGate(on_step=watchdog.beat)
    sched = Scheduler(model, gate, queue_bound=8, system_prompt="...")
    sched.warm(); sched.start()
    job = AsyncJob(messages, GenerationConfig(...), loop=asyncio.get_running_loop())
    sched.submit(job)                      # QueueFull past the bound, ShuttingDown after stop()
    kind, value = await job.next()         # ("start", prompt_tokens), ("delta", text)..., ("done", stats)
    job.request_cancel("disconnect")       # the generation stops within one decode step or prefill chunk

Why a gate and two sessions rather than one queue for everything: the voice loop (runtime/voice/pipeline.py)
drives its own session from its own LLM thread, speculatively (partial prefills while the user speaks, a
reply started before the end of the turn is confirmed) and cancels it on barge-in. Routing those calls
through a queue would serialize them behind API requests and change the loop. Instead every forward pass
of every session (one prefill chunk or one decode step, ``Session._forward``) takes the ``ComputeGate``:
voice steps go first, an API step waits while a voice step waits or ran less than ``grace_s`` ago. So the
cores run one stream at a time, a voice turn pre-empts even a running API generation at the next step (that
generation resumes after the turn, its KV cache intact), and each side keeps its own KV cache and prefix
reuse (the voice conversation and the API's system prompt both stay cached).

API requests (and Wyoming's LLM calls) queue in FIFO order, bounded; one worker thread serves them on one
session, whose prefix reuse keeps the system prompt's KV across requests.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from typing import Callable

from ..kv_cache import ContextOverflow
from ..sampling import GenerationConfig
from ..session import CancelToken, GenerationStats, Session

log = logging.getLogger(__name__)
VOICE, API = 0, 1  # gate priorities: lower goes first
FINISH = {"stop": "stop", "stop_string": "stop", "length": "length", "context": "length", "cancelled": "cancelled"}


class ComputeGate:
    """A priority lock held for one forward pass at a time (a prefill chunk or a decode step)."""

    def __init__(self, grace_s: float = 0.05, on_step: Callable[[], None] | None = None):
        self.grace_s = grace_s  # seconds after a voice step during which API steps still wait
        self.on_step = on_step  # called after every step (the systemd watchdog's beat)
        self.steps = [0, 0]  # forward passes run, per priority
        self._cond = threading.Condition()
        self._holder: int | None = None
        self._waiting = [0, 0]
        self._reserved_until = 0.0  # monotonic seconds: API steps wait until then (after a voice step)
        self._held_until = 0.0  # monotonic seconds: API steps wait until then (the user is speaking)

    def acquire(self, prio: int) -> None:
        with self._cond:
            self._waiting[prio] += 1
            try:
                while True:
                    if self._holder is None:
                        if prio == VOICE:
                            break
                        if not self._waiting[VOICE]:
                            wait = max(self._reserved_until, self._held_until) - time.monotonic()
                            if wait <= 0:
                                break
                            self._cond.wait(wait)
                            continue
                    self._cond.wait()
            finally:
                self._waiting[prio] -= 1
            self._holder = prio

    def hold_api(self, on: bool, max_s: float = 10.0) -> None:
        """Hold API steps back (for at most max_s seconds) while the voice loop needs the cores for
        something other than the model: the ASR passes while the user speaks."""
        with self._cond:
            self._held_until = time.monotonic() + max_s if on else 0.0
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            if self._holder == VOICE:
                self._reserved_until = time.monotonic() + self.grace_s
            self.steps[self._holder] += 1
            self._holder = None
            self._cond.notify_all()
        if self.on_step is not None:
            self.on_step()

    @contextlib.contextmanager
    def step(self, prio: int):
        self.acquire(prio)
        try:
            yield
        finally:
            self.release()


class GatedSession(Session):
    """A session whose every forward pass goes through the gate at one priority; counts its passes."""

    def __init__(self, model, max_context: int | None = None, *, gate: ComputeGate, prio: int):
        super().__init__(model, max_context)
        self.gate, self.prio = gate, prio
        self.forwards = 0  # forward passes run (prefill chunks + decode steps)

    def _forward(self, ids, logits_from):
        with self.gate.step(self.prio):
            self.forwards += 1
            return super()._forward(ids, logits_from)


class GatedModel:
    """The model as the voice loop sees it: same weights, but its sessions step through the gate."""

    def __init__(self, model, gate: ComputeGate, prio: int = VOICE):
        self._model, self._gate, self._prio = model, gate, prio

    def new_session(self, max_context: int | None = None) -> GatedSession:
        return self._model.new_session(max_context, GatedSession, gate=self._gate, prio=self._prio)

    def __getattr__(self, name):
        return getattr(self._model, name)


class QueueFull(Exception):
    def __init__(self, depth: int, retry_after_s: int):
        super().__init__(f"the model is busy: {depth} requests are waiting; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    def __init__(self):
        super().__init__("the service is shutting down")


class PromptTooLong(ValueError):
    pass


_ids = itertools.count(1)


class Job:
    """One generation request. ``post(event)`` is called from the worker thread."""

    def __init__(self, messages: list[dict], config: GenerationConfig, source: str = "api",
                 post: Callable[[tuple], None] | None = None, job_id: str | None = None):
        self.messages, self.config, self.source = messages, config, source
        self.id = job_id or f"{source}-{next(_ids)}"
        self.cancel = CancelToken()
        self.cancel_reason = ""
        self.t_arrival = time.monotonic()
        self.t_start: float | None = None  # the worker took it
        self.stats: GenerationStats | None = None
        self.steps_after_cancel: int | None = None  # forward passes begun after request_cancel (<= 1)
        self._forwards_at_cancel: int | None = None
        self._session: GatedSession | None = None
        self._post = post or (lambda ev: None)
        self.done = threading.Event()

    def request_cancel(self, reason: str) -> None:
        if self.cancel.cancelled or self.done.is_set():
            return
        self.cancel_reason = reason
        s = self._session
        self._forwards_at_cancel = s.forwards if s is not None else 0
        self.cancel.cancel()


class AsyncJob(Job):
    """A job whose events arrive on an asyncio loop: ``await job.next()``."""

    def __init__(self, messages, config, source="api", *, loop: asyncio.AbstractEventLoop, job_id=None):
        self._q: asyncio.Queue = asyncio.Queue()
        super().__init__(messages, config, source, self._deliver, job_id)
        self._loop = loop

    def _deliver(self, ev: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, ev)
        except RuntimeError:  # the loop closed (shutdown): nobody is listening
            pass

    async def next(self) -> tuple:
        return await self._q.get()


class Scheduler:
    def __init__(self, model, gate: ComputeGate, *, queue_bound: int, system_prompt: str = "", metrics=None,
                 beat: Callable[[], None] | None = None):
        self.model, self.gate, self.metrics = model, gate, metrics
        self.queue_bound = queue_bound
        self.system_prompt = system_prompt
        self.session = model.new_session(None, GatedSession, gate=gate, prio=API)
        self._beat = beat or (lambda: None)
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="boardtalk-llm", daemon=True)
        self._avg_s = 2.0  # seconds per request, smoothed (for Retry-After)
        self.max_depth = 0  # the most jobs ever waiting at once (<= queue_bound)
        self.finished: collections.deque[Job] = collections.deque(maxlen=64)  # the latest jobs served (tests, soak)

    # ---- lifecycle ------------------------------------------------------------------------------
    def warm(self) -> int:
        """Prefill the system prompt (tokens); a request that starts with it reuses its KV."""
        if not self.system_prompt:
            return 0
        return self.session.warm_prefix([{"role": "system", "content": self.system_prompt}])

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """Take no more work, drop what waits, let the running job finish for grace_s, then cancel it."""
        with self._cond:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in dropped:
            job._post(("error", ShuttingDown()))
            job.done.set()
        cur = self.current
        if cur is not None and not cur.done.wait(grace_s):
            cur.request_cancel("shutdown")
            cur.done.wait(5)
        self._thread.join(timeout=5) if self._thread.is_alive() else None

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self.current is not None

    # ---- submitting -----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise ShuttingDown()
            # the bound counts waiting jobs; the running one is not waiting
            if len(self._queue) >= self.queue_bound and (self.current is not None or self._queue):
                wait = max(1, round(self._avg_s * (len(self._queue) + 1)))
                raise QueueFull(len(self._queue), wait)
            self._queue.append(job)
            self.max_depth = max(self.max_depth, len(self._queue))
            self._set_depth()
            self._cond.notify()

    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))

    # ---- the worker -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait(1.0)
                    self._beat()  # idle ticks keep the watchdog fed
                if self._stopping and not self._queue:
                    return
                job = self._queue.popleft()
                self.current = job
                self._set_depth()
            try:
                self._serve(job)
            except Exception as e:  # noqa: BLE001 - a request never takes the worker down
                log.exception("request %s failed", job.id)
                job._post(("error", e))
            finally:
                self.current = None
                job.done.set()
                self._beat()

    def _serve(self, job: Job) -> None:
        job.t_start = time.monotonic()
        m = self.metrics
        if job.cancel.cancelled:  # gone while it waited
            job._post(("done", GenerationStats(finish_reason="cancelled")))
            self._count_cancel(job)
            return
        room = self.session.max_context - 1
        try:  # tokenizing stops past the room: a 256 KiB message costs what fits, not ~1.4 s of this worker
            ids = self.model.chat_ids(job.messages, limit=room)
        except ValueError as e:  # the template refused the conversation (a client's error, not ours)
            job._post(("error", e))
            return
        if len(ids) > room:
            raise_to = PromptTooLong(f"the prompt is more than {room} tokens; the context holds "
                                     f"{self.session.max_context} (at most {room} prompt tokens, leaving room for "
                                     "1 new token)")
            job._post(("error", raise_to))
            return
        job._session = self.session
        job._post(("start", len(ids)))
        try:
            texts = self.session.stream(ids, job.config, job.cancel)
        except ContextOverflow as e:
            job._post(("error", PromptTooLong(str(e))))
            return
        st = job.stats = self.session.last_stats  # filled in as the stream runs
        for text in texts:
            job._post(("delta", text))
        if job._forwards_at_cancel is not None:
            job.steps_after_cancel = self.session.forwards - job._forwards_at_cancel
        job._post(("done", st))
        self.finished.append(job)
        queue_s = job.t_start - job.t_arrival
        ttft = queue_s + st.ttft_s if st.new_tokens else None
        took = time.monotonic() - job.t_start
        self._avg_s = 0.8 * self._avg_s + 0.2 * took
        log.info("request id=%s source=%s queue_ms=%.1f prefill_ms=%.1f ttft_ms=%s prompt_tokens=%d reused=%d "
                 "new_tokens=%d tok_s=%.1f finish=%s%s", job.id, job.source, queue_s * 1e3, st.prefill_s * 1e3,
                 f"{ttft * 1e3:.1f}" if ttft is not None else "-", st.prompt_tokens, st.reused_tokens, st.new_tokens,
                 st.decode_tokens_per_s, st.finish_reason,
                 f" cancel={job.cancel_reason} steps_after_cancel={job.steps_after_cancel}"
                 if st.finish_reason == "cancelled" else "")
        if m is not None:
            m.generations.inc(1, job.source, FINISH.get(st.finish_reason, st.finish_reason))
            m.tokens.inc(st.new_tokens, job.source)
            m.prompt_tokens.inc(st.prompt_tokens - st.reused_tokens, job.source)
            m.queue_wait.observe(queue_s, job.source)
            if ttft is not None:
                m.ttft.observe(ttft, job.source)
            if st.decode_tokens_per_s:
                m.rate.observe(st.decode_tokens_per_s, job.source)
        if st.finish_reason == "cancelled":
            self._count_cancel(job)

    def _count_cancel(self, job: Job) -> None:
        if self.metrics is not None:
            self.metrics.cancellations.inc(1, job.cancel_reason or "unknown")
