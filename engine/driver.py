"""Runs the scheduler's plans on an Engine's model: the worker loop of continuous batching (nano-vllm's
LLMEngine.step(): schedule, run the forwards, postprocess).

The Engine owns one Driver (Engine.start_scheduler); the studio's visitors, the server's clients and the CLI submit
to it. Its worker thread runs every forward of their rows, under Engine.lock, so direct Engine.generate_ids callers
take turns with it. A pass: Scheduler.schedule() decides (engine/scheduler.py); the driver runs the decoders'
prefill / prefill_chunk / merge / step, a fault failing only the requests it touched; Scheduler.retire() delivers.
Static-shape steps (CUDA graphs) run where Engine.new_stepper says so, one stepper per batch key.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from .config import DecodeConfig
from .decode import Batch, Decoder, Row, decoder_for
from .events import Listener, Result, Summary, Trace
from .penalties import Penalties
from .prefix_cache import PREFIX_CACHE_MIB, PrefixCache
from .scheduler import (IDLE_STEPPERS, MAX_BATCH, MAX_WAITING, PREFILL_CHUNK, Plan, Prefill, Scheduler, Ticket,
                        not_started)
from .static import StaticStepper

# Prompts admitted together are prefilled in groups whose prefill widths round up to the same multiple of this: one
# padded forward for all would compute every row at the widest prompt's width (16 chat prompts of 2-3 blocks at once:
# 1,536 positions instead of 1,088, 2.49 s instead of 1.74 on the bundled model), and an extra forward costs about
# what 8 positions do (bench/results/prepack/README.md).
PREFILL_BUCKET = 32
PREFILL_GRAIN_CPU = 64  # a chunked prefill's forwards on a CPU (Scheduler.prefill_grain)


class Engine(Protocol):
    """What the driver needs of the Engine that owns it (engine/engine.py, which imports this module)."""

    lm: Any  # the loaded model: base, dllm, mask_token_id
    tb: Any  # its TokenBytes
    lock: Any  # serialises forwards with direct Engine.generate_ids callers

    def check_ids(self, ids: list[list[int]], cfg: DecodeConfig) -> DecodeConfig: ...

    def trace_header(self, ids: list[int], cfg: DecodeConfig, prompt: str | None) -> dict[str, Any]: ...

    def new_stepper(self, model: torch.nn.Module) -> StaticStepper | None: ...


@dataclass(eq=False)
class Running:
    """Rows on the model and the decoder that runs their forwards: a key's batch, or a long prompt's own row while
    its chunks prefill."""

    decoder: Decoder
    batch: Batch


class Driver:
    """Continuous batching over one Engine: thread-safe submit(), one worker thread running the Scheduler's plans."""

    def __init__(self, engine: Engine, max_batch: int = MAX_BATCH, max_waiting: int = MAX_WAITING,
                 prefill_chunk: int = PREFILL_CHUNK, prefix_cache_mib: int = PREFIX_CACHE_MIB,
                 prefill_grain: int | None = None):
        if not 0 <= prefix_cache_mib <= 1 << 20:
            raise ValueError(f"prefix_cache_mib: {prefix_cache_mib} must be in [0, {1 << 20}] (0: no prefix cache)")
        self.engine = engine
        if prefill_grain is None:  # CPU: a 64-wide forward costs about what 64 positions of a wider one do, so the
            # prefix cache gets a fine grain for free (bench/results/prefix_cache); a GPU pays per forward
            prefill_grain = min(PREFILL_GRAIN_CPU, prefill_chunk) if engine.lm.device.type == "cpu" else prefill_chunk
        self.scheduler = Scheduler(max_batch, max_waiting, prefill_chunk, prefill_grain)
        # K/V of prompt grains already prefilled, for later prompts that start with them (engine/prefix_cache.py)
        self.prefixes = PrefixCache(prefix_cache_mib << 20, prefill_grain) if prefix_cache_mib else None
        self.batches: dict[tuple, Running] = {}  # batch key -> its running batch
        self.opened: dict[Ticket, Running] = {}  # chunked prefills: each long prompt's row until its final piece
        # batches of different keys take turns and each keeps its rows' K/V in its own stepper's storage
        self.steppers: dict[tuple, StaticStepper | None] = {}
        self.forwards = 0  # forwards run by the worker (prefills and chunks included): what batching saves
        self.running = 0  # rows in all batches after the worker's last pass (read from any thread)
        self._cv = threading.Condition(threading.RLock())  # guards the scheduler: callers add while the worker plans
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
            self.scheduler.add(t)
            self._cv.notify()
        return t

    def generate_ids(self, ids: list[int], cfg: DecodeConfig, **kw: Any) -> Result:
        return self.submit(ids, cfg, **kw).wait()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished, wherever they are (waiting, prefilling, decoding)."""
        with self._cv:
            return self.scheduler.live

    @property
    def waiting(self) -> Any:
        return self.scheduler.waiting

    @property
    def alive(self) -> bool:
        """The decoding thread runs and the driver takes requests (what a health check asks)."""
        return self._worker.is_alive() and not self._closed

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def prefill_chunk(self) -> int:
        return self.scheduler.prefill_chunk

    def close(self) -> None:
        """Stop the worker after its pass; waiting and running requests fail."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._worker.join()

    # ---------------------------------------------------------------- the worker
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self.scheduler.has_work():
                    self._cv.wait()
                if self._closed:
                    self.scheduler.fail_all(RuntimeError("the scheduler was closed"))
                    self.batches.clear()
                    self.opened.clear()
                    return
            self.step()

    def step(self) -> None:
        """One pass: the scheduler's plan, its forwards (the engine lock held), then delivery."""
        with self._cv:
            plan = self.scheduler.schedule()
        with self.engine.lock, torch.inference_mode():
            self._run(plan)
        with self._cv:
            self.scheduler.retire()
        self.running = sum(len(r.batch.rows) for r in self.batches.values())

    def _run(self, plan: Plan) -> None:
        for t in plan.unstarted:
            self.opened.pop(t, None)
            self._complete(t, not_started())
        for p in plan.open:
            self._open(p)
        for key, ts in plan.join.items():
            self._join(key, ts)
        if plan.chunk is not None:
            self._chunk(*plan.chunk)
        if plan.final is not None:
            self._join(plan.final.key, [plan.final.ticket], self.opened.pop(plan.final.ticket), plan.final.done)
        for key in plan.step:
            if key in self.batches:  # (a key whose join failed has none)
                self._step(key)

    def _open(self, p: Prefill) -> None:
        """A long prompt's own row with an empty cache; its chunks fill it in later passes."""
        t = p.ticket
        try:
            dec = self._decoder_of(p.key, t.cfg)
            rows = self._rows(dec, [t])
            self.opened[t] = Running(dec, dec.open_batch([t.ids], rows))
            p.limit = dec.chunk_limit(rows)  # the block grid is the decoder's to know
        except Exception as exc:  # noqa: BLE001 - this request fails; the others go on
            self._fail([t], exc)

    def _chunk(self, p: Prefill, start: int, end: int) -> None:
        run, grain = self.opened[p.ticket], self.scheduler.prefill_grain
        try:
            if start == 0 and self.prefixes is not None:
                # the row's first piece: the grains an earlier prompt with the same start prefilled are copied, not
                # run again. Looked up now, not when the row opened: a prompt sent together with an identical one
                # (n > 1, a shared document) finds the grains the other's prefill saved before it.
                got = self.prefixes.restore(self._scope(run.decoder), p.ticket.ids, p.limit, run.batch.cache)
                run.batch.rows[0].cached = got
                if got >= end:
                    p.done = got  # the scheduler's next piece starts there
                    return
                start = got
            for lo in range(start, end, grain):  # one forward per grain: the grid the cached K/V depend on
                run.decoder.prefill_chunk(run.batch, lo, lo + grain)
                self.forwards += 1
                if self.prefixes is not None:
                    self.prefixes.save(self._scope(run.decoder), p.ticket.ids, lo, run.batch.cache)
        except Exception as exc:  # noqa: BLE001 - this request fails; the running batches go on
            del self.opened[p.ticket]
            self._fail([p.ticket], exc)

    def _join(self, key: tuple, ts: list[Ticket], opened: Running | None = None, cached: int = 0,
              dec: Decoder | None = None) -> None:
        """The (final) prefill forward of these requests' rows, then into their key's batch; requests of unlike
        prompt lengths in forwards of their own (PREFILL_BUCKET), shortest first, by one decoder."""
        if opened is None and dec is None and len(ts) > 1:
            groups: dict[int, list[Ticket]] = {}
            try:
                dec = self._decoder_of(key, ts[0].cfg)
                for t in ts:
                    groups.setdefault(-(-dec.prefill_width(len(t.ids)) // PREFILL_BUCKET), []).append(t)
            except Exception:  # noqa: BLE001 - the prefill below meets the same fault and fails these requests
                groups = {}
            if len(groups) > 1:
                for _, group in sorted(groups.items()):
                    self._join(key, group, dec=dec)
                return
        run = self.batches.get(key)
        try:
            if opened is None:
                dec = dec or self._decoder_of(key, ts[0].cfg)
                new = dec.prefill([t.ids for t in ts], self._rows(dec, ts))
            else:
                dec = opened.decoder
                new = dec.prefill([ts[0].ids], opened.batch.rows, batch=opened.batch, cached=cached)
            self.forwards += 1
            merged = dec.merge(run.batch if run else None, new)  # (a static stepper's storage may have to grow)
        except Exception as exc:  # noqa: BLE001 - these requests fail; the running batch is untouched
            self._fail(ts, exc)
            return
        if run is None:
            run = self.batches[key] = Running(dec, merged)
        else:
            run.batch = merged
        if not run.batch.rows:  # every row finished at its prefill
            del self.batches[key]

    def _step(self, key: tuple) -> None:
        run = self.batches[key]
        try:
            run.batch = run.decoder.drop_cancelled(run.batch)
            if run.batch.rows:
                run.batch = run.decoder.step(run.batch)
                self.forwards += run.decoder.step_forwards
        except Exception as exc:  # noqa: BLE001 - an engine fault fails this batch's requests, not the server
            del self.batches[key]
            with self._cv:
                self.scheduler.fail(list(self.scheduler.groups.get(key, [])), exc)
            return
        if not run.batch.rows:
            del self.batches[key]

    def _decoder_of(self, key: tuple, cfg: DecodeConfig) -> Decoder:
        """The decoder of key's running batch, or one for a new batch: on the engine's static path when it has one
        (Engine.new_stepper decides), its rows' prefills written to a plain cache and copied into the stepper's
        storage as they join."""
        if key in self.batches:
            return self.batches[key].decoder
        model = self.engine.lm.dllm if cfg.mode == "diffusion" else self.engine.lm.base
        if key not in self.steppers:
            busy = set(self.batches) | {t.key for t in self.opened}
            idle = [k for k in self.steppers if k not in busy]  # oldest first (dicts keep insertion order)
            for k in idle[:max(0, len(idle) - IDLE_STEPPERS + 1)]:  # many distinct settings must not pile up storage
                del self.steppers[k]
            self.steppers[key] = self.engine.new_stepper(model)
        return decoder_for(model, cfg, self.engine.lm.mask_token_id, self.engine.tb, stepper=self.steppers[key],
                           joins=True)

    @staticmethod
    def _scope(dec: Decoder) -> tuple:
        """What a prompt chunk's K/V depend on besides its tokens: the model (the dLLM's adapter changes them) and
        the prompt's attention rule (AR causal, diffusion block-causal of its block size)."""
        return id(dec.model), type(dec).__name__, dec.block

    @staticmethod
    def _rows(dec: Decoder, ts: list[Ticket]) -> list[Row]:
        rows = dec.new_rows([t.ids for t in ts], indices=[0] * len(ts), max_new=[t.cfg.max_new_tokens for t in ts],
                            listeners=[t.on_event for t in ts], cancels=[t.stop for t in ts],
                            penalties=[Penalties.of(t.cfg) for t in ts], seeds=[t.cfg.seed for t in ts],
                            tops=[t.cfg.top_logprobs for t in ts])
        for t, r in zip(ts, rows):
            t.row = r
        return rows

    def _complete(self, t: Ticket, summary: Summary) -> None:
        with self._cv:
            self.scheduler.complete(t, summary)

    def _fail(self, ts: list[Ticket], exc: BaseException) -> None:
        with self._cv:
            self.scheduler.fail(ts, exc)
