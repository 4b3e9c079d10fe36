"""Requests in, shared forwards out: continuous batching of decodes from many callers (nano-vllm's scheduler, for
block diffusion).

One worker thread owns the model. Requests whose settings give the same forward (the DecodeConfig less
max_new_tokens and the repetition knobs, which each row applies to its own logits: mode, block and sub-block size,
cache, unmasking rule, sampling) share a batch; a request that
arrives while that batch decodes is prefilled on its own and merged into it before the next forward, so it never
waits for the batch to finish. Batches with different settings take turns, one forward each. A request's stop
flag drops its own row before the next forward; the other rows carry on. A prompt longer than `prefill_chunk`
tokens is prefilled a chunk per pass between the batches' forwards (chunked prefill), so a 4,000-token prompt
delays a short request's first token by one chunk's forward, not by its whole prefill.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import astuple, dataclass, field, replace
from typing import Any, Callable

import torch

from .config import DecodeConfig
from .decode import Batch, Decoder, Row, decoder_for
from .penalties import Penalties
from .engine import Engine, Result
from .events import Event, Listener, Summary, Trace

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
    """Requests with equal keys share forwards: every setting but the per-row answer cap, repetition knobs and
    seed (Decoder.new_rows takes them row by row; each row samples from its own generator)."""
    return astuple(replace(cfg, max_new_tokens=1, seed=None,
                           repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                           no_repeat_ngram_size=0))


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
    row: Row | None = None
    on_finish: Callable[["Ticket"], None] | None = None  # called on the decoding thread once wait() would return

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
    """A long prompt being prefilled chunk by chunk (chunked prefill) before it joins its key's batch."""

    key: tuple
    decoder: Decoder
    batch: Batch
    ticket: Ticket
    done: int = 0  # prompt positions whose K/V are in the batch's cache
    limit: int = 0  # how far chunks may go (Decoder.chunk_limit); the final prefill does the rest


@dataclass(eq=False)
class Group:
    """One batch of rows with the same key, and the decoder that steps it."""

    decoder: Decoder
    batch: Batch
    tickets: list[Ticket]


class Scheduler:
    """Continuous batching over one Engine; thread-safe submit(), one decoding thread."""

    def __init__(self, engine: Engine, max_batch: int = MAX_BATCH, max_waiting: int = MAX_WAITING,
                 prefill_chunk: int = PREFILL_CHUNK):
        if prefill_chunk < 64 or prefill_chunk % 64:
            raise ValueError(f"prefill_chunk: {prefill_chunk} must be a multiple of 64 (every block size divides it)")
        self.engine, self.max_batch, self.max_waiting = engine, max_batch, max_waiting
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Ticket] = deque()
        self.groups: dict[tuple, Group] = {}
        self.prefills: deque[Prefill] = deque()  # long prompts, one chunk a pass, first come first served
        # static-shape steps (CUDA graphs on GPUs) where the engine runs them: one stepper per batch key, since
        # batches of different keys take turns and each keeps its rows' K/V in its stepper's storage
        self.steppers: dict[tuple, Any] = {}
        self.forwards = 0  # forwards run by the worker (prefills included): what batching saves
        self.running = 0  # rows in all batches after the worker's last pass (read from any thread)
        self._live = 0  # submitted, not finished: also counts a row between waiting and its batch (prefill)
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="fastdllm-scheduler", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- callers' side
    def submit(self, ids: list[int], cfg: DecodeConfig, *, listener: Listener | None = None,
               prompt_text: str | None = None, record: bool = True,
               on_finish: Callable[[Ticket], None] | None = None, stop: threading.Event | None = None) -> Ticket:
        """Queue one prompt (token ids); ConfigError for bad settings or prompts, SchedulerBusy when full.
        `stop` lets the caller's own flag (the studio's Stop button) cancel the row."""
        cfg = self.engine.check_ids([ids], cfg)
        trace = Trace(self.engine.trace_header(ids, cfg, prompt_text)) if record else None
        t = Ticket(list(ids), cfg, listener, trace, on_finish=on_finish)
        if stop is not None:
            t.stop = stop
        with self._cv:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if len(self.waiting) >= self.max_waiting:
                raise SchedulerBusy(f"{len(self.waiting)} requests are waiting already; try again shortly")
            self.waiting.append(t)
            self._live += 1
            self._cv.notify()
        return t

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished, wherever they are (waiting, prefilling, decoding)."""
        with self._cv:
            return self._live

    def generate_ids(self, ids: list[int], cfg: DecodeConfig, **kw: Any) -> Result:
        return self.submit(ids, cfg, **kw).wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._worker.join()

    # ---------------------------------------------------------------- the decoding thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self.waiting and not self.groups and not self.prefills:
                    self._cv.wait()
                if self._closed:
                    self._fail_all(RuntimeError("the scheduler was closed"))
                    return
                admit = self._take_waiting()
            with self.engine.lock, torch.inference_mode():  # direct Engine.generate_ids callers take turns with us
                self._admit(admit)
                self._prefill_chunk()
                for key in list(self.groups):
                    self._step(key)
            self.running = sum(len(g.batch.rows) for g in self.groups.values())

    def _take_waiting(self) -> list[Ticket]:
        """Waiting requests that fit into their batch now (FIFO; a full batch holds back only its own key)."""
        out, left = [], deque()
        rows = {k: len(g.batch.rows) for k, g in self.groups.items()}
        for p in self.prefills:  # a long prompt being prefilled holds its row
            rows[p.key] = rows.get(p.key, 0) + 1
        while self.waiting:
            t = self.waiting.popleft()
            k = batch_key(t.cfg)
            if rows.get(k, 0) < self.max_batch or t.stop.is_set():
                rows[k] = rows.get(k, 0) + 1
                out.append(t)
            else:
                left.append(t)
        self.waiting = left
        return out

    def _admit(self, tickets: list[Ticket]) -> None:
        """Prefill newly arrived rows (one forward per key) and merge them into their key's batch; a prompt longer
        than prefill_chunk starts a chunked prefill instead, so it delays the running batches by a chunk a pass."""
        by_key: dict[tuple, list[Ticket]] = {}
        for t in tickets:
            if t.stop.is_set():  # cancelled while waiting: never decoded
                self._complete(t, not_started())
            else:
                by_key.setdefault(batch_key(t.cfg), []).append(t)
        for key, ts in by_key.items():
            g = self.groups.get(key)
            dec = g.decoder if g else self._decoder(key, ts[0].cfg)
            long = [t for t in ts if dec.uses_cache() and len(t.ids) - 1 > self.prefill_chunk]
            for t in long:
                try:
                    rows = self._rows(dec, [t])
                    self.prefills.append(Prefill(key, dec, dec.open_batch([t.ids], rows), t, 0, dec.chunk_limit(rows)))
                except Exception as exc:  # noqa: BLE001 - this request fails; the others go on
                    self._complete(t, None, exc)
            short = [t for t in ts if t not in long]
            if short:
                self._join(key, dec, short)

    def _decoder(self, key: tuple, cfg: DecodeConfig) -> Decoder:
        """A decoder for a new batch of this key: on the engine's static path when it has one (Engine.new_stepper
        decides), its rows' prefills written to a plain cache and copied into the stepper's storage as they join."""
        model = self._model(cfg.mode)
        if key not in self.steppers:
            busy = set(self.groups) | {p.key for p in self.prefills}
            idle = [k for k in self.steppers if k not in busy]  # oldest first (dicts keep insertion order)
            for k in idle[:max(0, len(idle) - IDLE_STEPPERS + 1)]:  # many distinct settings must not pile up storage
                del self.steppers[k]
            self.steppers[key] = self.engine.new_stepper(model)
        return decoder_for(model, cfg, self.engine.lm.mask_token_id, self.engine.tb, stepper=self.steppers[key],
                           joins=True)

    def _rows(self, dec: Decoder, ts: list[Ticket]) -> list[Row]:
        rows = dec.new_rows([t.ids for t in ts], indices=[0] * len(ts), max_new=[t.cfg.max_new_tokens for t in ts],
                            listeners=[t.on_event for t in ts], cancels=[t.stop for t in ts],
                            penalties=[Penalties.of(t.cfg) for t in ts], seeds=[t.cfg.seed for t in ts])
        for t, r in zip(ts, rows):
            t.row = r
        return rows

    def _join(self, key: tuple, dec: Decoder, ts: list[Ticket], pre: Prefill | None = None) -> None:
        """The (final) prefill forward of these requests' rows, then into their key's batch."""
        try:
            if pre is None:
                new = dec.prefill([t.ids for t in ts], self._rows(dec, ts))
            else:
                new = dec.prefill([pre.ticket.ids], pre.batch.rows, batch=pre.batch, cached=pre.done)
            self.forwards += 1
            g = self.groups.get(key)
            merged = dec.merge(g.batch if g else None, new)  # (a static stepper's storage may have to grow)
        except Exception as exc:  # noqa: BLE001 - these requests fail; the running batch is untouched
            for t in ts:
                self._complete(t, None, exc)
            return
        if g is None:
            g = self.groups[key] = Group(dec, merged, [])
        else:
            g.batch = merged
        g.tickets += ts
        self._deliver(key)

    def _prefill_chunk(self) -> None:
        """One chunk of the oldest long prompt; its last piece is the prefill that commits its first tokens."""
        if not self.prefills:
            return
        p = self.prefills[0]
        if p.ticket.stop.is_set():  # cancelled mid-prefill: no answer was started
            self.prefills.popleft()
            self._complete(p.ticket, not_started())
            return
        if p.limit - p.done <= self.prefill_chunk:  # the rest fits one forward: the final prefill, then its batch
            self.prefills.popleft()
            self._join(p.key, p.decoder, [p.ticket], p)
            return
        try:
            p.decoder.prefill_chunk(p.batch, p.done, p.done + self.prefill_chunk)
        except Exception as exc:  # noqa: BLE001 - this request fails; the running batches go on
            self.prefills.popleft()
            self._complete(p.ticket, None, exc)
            return
        self.forwards += 1
        p.done += self.prefill_chunk

    def _step(self, key: tuple) -> None:
        g = self.groups[key]
        try:
            g.batch = g.decoder.drop_cancelled(g.batch)
            if g.batch.rows:
                g.batch = g.decoder.step(g.batch)
                self.forwards += g.decoder.step_forwards
        except Exception as exc:  # noqa: BLE001 - an engine fault fails this batch's requests, not the server
            for t in g.tickets:
                self._complete(t, None, exc)
            del self.groups[key]
            return
        self._deliver(key)

    def _deliver(self, key: tuple) -> None:
        """Requests whose row left the batch get their Result; an empty batch is dropped."""
        g = self.groups[key]
        for t in [t for t in g.tickets if t.row is not None and t.row.summary is not None]:
            self._complete(t, t.row.summary)
        g.tickets = [t for t in g.tickets if not t.finished.is_set()]
        if not g.batch.rows:
            del self.groups[key]

    def _model(self, mode: str) -> torch.nn.Module:
        return self.engine.lm.dllm if mode == "diffusion" else self.engine.lm.base

    def _complete(self, t: Ticket, summary: Summary | None, error: BaseException | None = None) -> None:
        if summary is not None:
            if t.trace is not None:
                t.trace.summary = summary
            t.result = Result(summary, t.trace)
        if error is not None and t.error is None:
            t.error = error
        t.row = None
        if not t.finished.is_set():
            with self._cv:  # an RLock: _fail_all calls this while holding it
                self._live -= 1
        t.finished.set()
        if t.on_finish is not None:
            try:
                t.on_finish(t)
            except Exception:  # noqa: BLE001 - a gone consumer (closed event loop) must not stop the scheduler
                pass

    def _fail_all(self, error: BaseException) -> None:
        for t in list(self.waiting) + [p.ticket for p in self.prefills] + [t for g in self.groups.values() for t in g.tickets]:
            self._complete(t, None, error)
        self.waiting.clear()
        self.prefills.clear()
        self.groups.clear()
