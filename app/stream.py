"""Run a decode on a worker thread and hand its events to the UI in frame-sized batches.

The engine calls its listener synchronously from the decoding thread; the UI is a Gradio generator.
A queue joins them, and batching to at most ~30 frames per second keeps the browser smooth however
fast the engine steps; visitors streaming at once share those frames (n visitors: ~30/n each), so the process's
UI work does not grow with them. Stop requests are threading.Events found by a key (the browser session), so the
GPU function below takes only picklable arguments, as ZeroGPU on Hugging Face Spaces requires.

An in-process Engine decodes through its continuous-batching driver (engine/driver.py, Engine.scheduler), the one
`python -m engine serve` uses: concurrent visitors' rows share forwards. A remote engine batches on its server;
on ZeroGPU the GPU is only held inside the decorated function, so there each decode runs on its own thread.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from engine import DecodeConfig, Engine, Event, Result
from engine.driver import Driver

FRAME_SECONDS = 1 / 30

_engine: Engine | None = None
_cancels: dict[str, threading.Event] = {}
_cancels_lock = threading.Lock()

_streams = 0  # decode_stream generators running now (visitors decoding at once): they share FRAME_SECONDS
_streams_lock = threading.Lock()


try:  # Hugging Face ZeroGPU: the GPU generation function must be decorated; elsewhere nothing changes
    import spaces  # type: ignore[import-not-found]

    _gpu = spaces.GPU(duration=120)
    ZERO_GPU = True
except ImportError:  # pragma: no cover - depends on the host
    def _gpu(fn):
        return fn
    ZERO_GPU = False


def set_engine(engine: Engine) -> None:
    global _engine
    _engine = engine


def get_engine() -> Engine:
    if _engine is None:
        raise RuntimeError("the studio has no engine loaded")
    return _engine


def scheduler_for(engine: Any) -> Driver | None:
    """The engine's shared scheduler (one per in-process Engine, started on first use); None where decodes go
    straight to engine.generate_ids (a remote engine, ZeroGPU)."""
    if ZERO_GPU or not isinstance(engine, Engine):
        return None
    return engine.scheduler


def cancel_event(key: str) -> threading.Event:
    """A fresh stop flag for this key (a browser session); the previous run of the key is done by now."""
    with _cancels_lock:
        ev = _cancels[key] = threading.Event()
        return ev


def request_stop(key: str) -> bool:
    """Ask the key's running decode to stop after its current forward; False when nothing runs."""
    with _cancels_lock:
        ev = _cancels.get(key)
    if ev is None:
        return False
    ev.set()
    return True


def release(key: str, ev: threading.Event) -> None:
    with _cancels_lock:
        if _cancels.get(key) is ev:
            del _cancels[key]


@contextmanager
def stop_scope(key: str) -> Iterator[threading.Event]:
    """One stop flag for a handler that runs several decodes (race, sweep): a Stop that lands between two runs
    stops the next one instead of finding no flag and being lost."""
    ev = cancel_event(key)
    try:
        yield ev
    finally:
        release(key, ev)


@_gpu
def decode_stream(ids: list[int], cfg: DecodeConfig, prompt_text: str | None, key: str | None = None,
                  frame: float = FRAME_SECONDS) -> Iterator[tuple[list[Event], Result | None]]:
    """Yield (new events, None) batches while decoding, then ([], result). No tensors cross this border."""
    engine = get_engine()
    cancel = _cancels.get(key) if key else None
    if cancel is None:
        cancel = threading.Event()
    q: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
    texts = [prompt_text] if prompt_text is not None else None
    sched = scheduler_for(engine)
    if sched is not None:  # the row joins whatever batch of its settings is decoding
        ticket = sched.submit(ids, cfg, listener=q.put, prompt_text=prompt_text, record=True,
                              on_finish=lambda _: q.put(None), stop=cancel)
        running, finish, outcome = (lambda: not ticket.finished.is_set()), ticket.finished.wait, ticket.wait
    else:
        running, finish, outcome = _thread(lambda: engine.generate_ids([ids], cfg, listener=q.put, cancel=cancel,
                                                                       record=True, prompt_texts=texts)[0], q)
    global _streams
    last, done = 0.0, False
    with _streams_lock:
        _streams += 1
    try:
        while not done:
            first = q.get()
            # n visitors streaming at once: each gets a frame every n * frame seconds, so the process renders and
            # sends ~1/frame frames per second in all (its Python competes with the decoding thread for the GIL)
            wait = last + frame * max(1, _streams) - time.perf_counter()
            if wait > 0 and first is not None:
                time.sleep(wait)
            batch: list[Event] = []
            item: Event | None = first
            while True:
                if item is None:
                    done = True
                else:
                    batch.append(item)
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
            if batch:
                last = time.perf_counter()
                yield batch, None
    finally:
        with _streams_lock:
            _streams -= 1
        if running():  # the consumer went away (tab closed, generator closed): stop the decode
            cancel.set()
        finish()  # returns once the row has left its batch: within one forward
    yield [], outcome()


def _thread(decode: Callable[[], Result], q: queue.SimpleQueue) -> tuple[Callable[[], bool], Callable[[], Any],
                                                                          Callable[[], Result]]:
    """decode() on its own thread, ending q with None: (is it running, wait for it, its result or error)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = decode()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e
        finally:
            q.put(None)

    worker = threading.Thread(target=work, name="fastdllm-decode", daemon=True)
    worker.start()

    def outcome() -> Result:
        if "error" in box:
            raise box["error"]
        return box["result"]

    return worker.is_alive, worker.join, outcome
