"""Who decodes next, for continuous batching of many callers' decodes (nano-vllm's scheduler, for block diffusion).

The scheduler only decides; it runs no forward and holds no tensor. Each pass, `schedule()` returns a Plan: which
waiting requests are admitted and how (a short prompt is prefilled with the other arrivals of its batch key and
merged into that key's running batch; a prompt longer than `prefill_chunk` goes to a chunked prefill), which chunked
prefill runs its next chunk or its final piece, and which batches step. engine/driver.py runs the plan on the
engine's model, then `retire()` hands every request whose row left its batch its Result. Requests whose settings
give the same forward (`batch_key`) share a batch; batches of different keys take turns, one forward each.

Not thread-safe: the driver calls it under its own lock.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import astuple, dataclass, field, replace
from typing import Callable

from .config import DecodeConfig
from .decode import Row, keeps_cache
from .events import Event, Listener, Result, Summary, Trace

MAX_BATCH = 16  # rows per batch; more requests wait for a row to finish
MAX_WAITING = 64  # requests not yet admitted; more are refused (SchedulerBusy)
IDLE_STEPPERS = 4  # static steppers kept for batch keys with no batch now (each holds its K/V storage and graphs)
PREFILL_CHUNK = 256  # a longer prompt is prefilled this many tokens a pass, between the running batches' forwards


class SchedulerBusy(RuntimeError):
    """The waiting line is full: retry later (HTTP 503)."""


def not_started() -> Summary:
    """The summary of a request cancelled before its first forward."""
    return Summary(0, 0, 0.0, 0.0, 0.0, 0.0, "cancelled", "", [])


def batch_key(cfg: DecodeConfig) -> tuple:
    """Requests with equal keys share forwards: every setting but the per-row answer cap, repetition knobs, seed
    and top_logprobs (Decoder.new_rows takes them row by row; each row samples from its own generator)."""
    return astuple(replace(cfg, max_new_tokens=1, seed=None,
                           repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                           no_repeat_ngram_size=0, top_logprobs=0))


@dataclass(eq=False)
class Ticket:
    """One submitted request: cancel() drops its row before the next forward; wait() gives its Result."""

    ids: list[int]
    cfg: DecodeConfig
    listener: Listener | None
    trace: Trace | None
    stop: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None
    error: BaseException | None = None
    row: Row | None = None  # its decoding row, from its (final) prefill until it is delivered
    on_finish: Callable[["Ticket"], None] | None = None  # called on the decoding thread once wait() would return

    @property
    def key(self) -> tuple:
        return batch_key(self.cfg)

    def cancel(self) -> None:
        self.stop.set()

    def wait(self, timeout: float | None = None) -> Result:
        if not self.finished.wait(timeout):
            raise TimeoutError("the request is still decoding")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def on_event(self, e: Event) -> None:
        """The row's listener: record, then pass on; a failing consumer cancels its own row only."""
        if self.trace is not None:
            self.trace.events.append(e)
        if self.listener is not None:
            try:
                self.listener(e)
            except BaseException as exc:  # noqa: BLE001 - reported to this request's waiter
                self.error = exc
                self.stop.set()


@dataclass(eq=False)
class Prefill:
    """A long prompt prefilled chunk by chunk before it joins its key's batch (its tensors are the driver's)."""

    key: tuple
    ticket: Ticket
    done: int = 0  # prompt positions whose K/V the planned chunks cover
    limit: int | None = None  # how far chunks may go, set when the driver opens the row (Decoder.chunk_limit)


@dataclass
class Plan:
    """One pass for the driver, run in this order: finish, open, join, chunk (or final), step."""

    unstarted: list[Ticket] = field(default_factory=list)  # cancelled before a forward: finish with not_started()
    open: list[Prefill] = field(default_factory=list)  # long prompts admitted: open their rows (chunks come later)
    join: dict[tuple, list[Ticket]] = field(default_factory=dict)  # short prompts by key: one prefill, then merge
    chunk: tuple[Prefill, int, int] | None = None  # the oldest opened long prompt's next piece [start, end)
    final: Prefill | None = None  # or its last piece: the prefill that commits its first tokens, then its batch
    step: list[tuple] = field(default_factory=list)  # keys whose batch runs one forward


class Scheduler:
    """Admission, grouping by batch key, chunked-prefill order and delivery; the driver runs what it decides."""

    def __init__(self, max_batch: int = MAX_BATCH, max_waiting: int = MAX_WAITING, prefill_chunk: int = PREFILL_CHUNK,
                 prefill_grain: int | None = None):
        """prefill_chunk: a longer prompt is prefilled this many positions a pass; prefill_grain (default: the chunk):
        in forwards of this many, so a pass's chunk is several forwards (the prefix cache reuses whole grains)."""
        grain = prefill_chunk if prefill_grain is None else prefill_grain
        if prefill_chunk < 64 or prefill_chunk % 64 or grain < 64 or grain % 64 or prefill_chunk % grain:
            raise ValueError(f"prefill_chunk {prefill_chunk} and prefill_grain {grain}: multiples of 64 (every block "
                             "size divides them), the grain dividing the chunk")
        self.max_batch, self.max_waiting, self.prefill_chunk = max_batch, max_waiting, prefill_chunk
        self.prefill_grain = grain
        self.waiting: deque[Ticket] = deque()
        self.groups: dict[tuple, list[Ticket]] = {}  # each key's batch: its rows, those joining this pass included
        self.prefills: deque[Prefill] = deque()  # long prompts, one chunk a pass, first come first served
        self.live = 0  # submitted, not finished, wherever they are (waiting, prefilling, decoding)

    def add(self, t: Ticket) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise SchedulerBusy(f"{len(self.waiting)} requests are waiting already; try again shortly")
        self.waiting.append(t)
        self.live += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.groups or self.prefills)

    def schedule(self) -> Plan:
        """This pass: admissions (FIFO; a full batch holds back only its own key), the next chunk, the steps."""
        plan = Plan()
        for t in self._take_waiting():
            if t.stop.is_set():  # cancelled while waiting: never decoded
                plan.unstarted.append(t)
            elif keeps_cache(t.cfg) and len(t.ids) - 1 > self.prefill_chunk:
                p = Prefill(t.key, t)
                self.prefills.append(p)
                plan.open.append(p)
            else:
                plan.join.setdefault(t.key, []).append(t)
                self.groups.setdefault(t.key, []).append(t)
        self._next_piece(plan)
        plan.step = list(self.groups)
        return plan

    def _take_waiting(self) -> list[Ticket]:
        out, left = [], deque()
        rows = {k: len(ts) for k, ts in self.groups.items()}
        for p in self.prefills:  # a long prompt being prefilled holds its row
            rows[p.key] = rows.get(p.key, 0) + 1
        while self.waiting:
            t = self.waiting.popleft()
            k = t.key
            if rows.get(k, 0) < self.max_batch or t.stop.is_set():
                rows[k] = rows.get(k, 0) + 1
                out.append(t)
            else:
                left.append(t)
        self.waiting = left
        return out

    def _next_piece(self, plan: Plan) -> None:
        """One piece of the oldest opened long prompt: a chunk, or the final prefill once the rest fits one."""
        if not self.prefills or self.prefills[0].limit is None:  # not opened yet: its first chunk is next pass
            return
        p = self.prefills[0]
        if p.ticket.stop.is_set():  # cancelled mid-prefill: no answer was started
            self.prefills.popleft()
            plan.unstarted.append(p.ticket)
        elif p.limit - p.done <= self.prefill_grain:
            self.prefills.popleft()
            self.groups.setdefault(p.key, []).append(p.ticket)
            plan.final = p
        else:  # whole grains while the rest is longer than one (the grid a prompt's K/V depend on), a chunk's worth
            n = min(self.prefill_chunk, (p.limit - p.done - 1) // self.prefill_grain * self.prefill_grain)
            plan.chunk = (p, p.done, p.done + n)
            p.done += n

    def retire(self) -> None:
        """Requests whose row left its batch get their Result; a key with no rows left has no batch."""
        for key, ts in list(self.groups.items()):
            for t in ts:
                if t.row is not None and t.row.summary is not None:
                    self.complete(t, t.row.summary)
            left = [t for t in ts if not t.finished.is_set()]
            if left:
                self.groups[key] = left
            else:
                del self.groups[key]

    def fail(self, tickets: list[Ticket], error: BaseException) -> None:
        """These requests end with error, wherever they are; the others go on."""
        gone = set(tickets)
        self.prefills = deque(p for p in self.prefills if p.ticket not in gone)
        for key, ts in list(self.groups.items()):
            left = [t for t in ts if t not in gone]
            if left:
                self.groups[key] = left
            else:
                del self.groups[key]
        for t in tickets:
            done = t.row.summary if t.row is not None else None  # its row finished before the fault: that answer stands
            self.complete(t, done, None if done is not None else error)

    def fail_all(self, error: BaseException) -> None:
        everyone = list(self.waiting) + [p.ticket for p in self.prefills] + [t for ts in self.groups.values() for t in ts]
        self.waiting.clear()
        self.fail(everyone, error)

    def complete(self, t: Ticket, summary: Summary | None, error: BaseException | None = None) -> None:
        """Deliver: the Result (or the error) to the request's waiter, then its on_finish."""
        if summary is not None:
            if t.trace is not None:
                t.trace.summary = summary
            t.result = Result(summary, t.trace)
        if error is not None and t.error is None:
            t.error = error
        t.row = None
        if not t.finished.is_set():
            self.live -= 1
        t.finished.set()
        if t.on_finish is not None:
            try:
                t.on_finish(t)
            except Exception:  # noqa: BLE001 - a gone consumer (closed event loop) must not stop the scheduler
                pass
