"""The engine's front door: a loaded model, chat encoding, and generate() returning summary + trace."""
from __future__ import annotations

import threading
import weakref
from dataclasses import replace
from typing import Any

import torch

from .config import ConfigError, DecodeConfig, fit_to_context
from .decode import Cancel, decoder_for
from .driver import Driver
from .events import Result  # (in events.py, beside Summary and Trace: the scheduler hands it out too)
from .events import Event, Listener, Summary, Trace
from .loading import LoadedModel, load
from .runtime import Runtime
from .static import StaticStepper, compile_wanted, static_layer, graphs_wanted, wanted as static_wanted
from .text import TokenBytes


class Engine:
    """One model; its lock serialises direct generate() callers and its driver's passes (engine/driver.py)."""

    def __init__(self, lm: LoadedModel, static: bool | None = None, runtime: Runtime | None = None):
        self.lm = lm
        self.runtime = runtime or Runtime.from_env()
        self.tb = TokenBytes(lm.tokenizer)
        self.lock = threading.Lock()
        # static-shape decode steps (CUDA graphs on GPUs): default on for CUDA, off for CPU (FASTDLLM_STATIC)
        self.static = static_wanted(lm.device, self.runtime) if static is None else static
        self._steppers: dict[int, StaticStepper] = {}
        # every stepper made, the scheduler's too (graphs_report); weak, so a stepper the scheduler drops frees its storage
        self._all_steppers: weakref.WeakSet[StaticStepper] = weakref.WeakSet()
        self._scheduler: Driver | None = None  # continuous batching (engine/driver.py), started on first use
        self._scheduler_lock = threading.Lock()  # not self.lock: a decode holds that for its whole run

    @classmethod
    def load(cls, model: str | None = None, device: str | None = None, dtype: str | None = None,
             static: bool | None = None, runtime: Runtime | None = None) -> "Engine":
        """Load a model (None: FASTDLLM_MODEL, else the bundled one). `runtime` holds every FASTDLLM_* switch
        (engine/runtime.py); None reads them from the environment now. Arguments win over the runtime's."""
        runtime = runtime or Runtime.from_env()
        return cls(load(model, device, dtype, runtime), static=static, runtime=runtime)

    def stepper(self, model: torch.nn.Module) -> StaticStepper | None:
        """The static stepper of `model` for direct generate() calls (one per model: it owns the static KV cache
        and the graphs); None when new_stepper says the static path is off."""
        if id(model) not in self._steppers:
            made = self.new_stepper(model)
            if made is None:
                return None
            self._steppers[id(model)] = made
        return self._steppers[id(model)]

    def new_stepper(self, model: torch.nn.Module) -> StaticStepper | None:
        """A static stepper with its own storage, or None: the one place that decides whether decode steps run on
        the static path, captured as CUDA graphs, with compiled layers (direct calls and the scheduler's batches,
        which each keep their own storage, ask here)."""
        if not self.static:
            return None
        stepper = StaticStepper(model, graphs=graphs_wanted(self.lm.device, self.runtime),
                                quantum=256 if self.lm.device.type == "cuda" else 32,
                                compile=compile_wanted(self.runtime))
        self._all_steppers.add(stepper)
        return stepper

    def start_scheduler(self, **settings: Any) -> Driver:
        """The engine's one front door for many callers (the studio's visitors, the server's clients, the CLI):
        a Driver running a Scheduler's plans (continuous batching), started with `settings` (max_batch, max_waiting,
        prefill_chunk, prefix_cache_mib; FASTDLLM_PREFILL_CHUNK and FASTDLLM_PREFIX_CACHE_MIB when not given) on the
        first call; later calls return it as it is. Its worker thread sleeps while idle."""
        for name in ("prefill_chunk", "prefix_cache_mib"):
            if getattr(self.runtime, name) is not None:
                settings.setdefault(name, getattr(self.runtime, name))
        with self._scheduler_lock:
            if self._scheduler is None:
                self._scheduler = Driver(self, **settings)
            return self._scheduler

    @property
    def scheduler(self) -> Driver:
        """start_scheduler() with the default settings."""
        return self.start_scheduler()

    def close_scheduler(self) -> None:
        """Stop the driver's worker (its waiting and running requests fail); the next use starts a new one."""
        with self._scheduler_lock:
            sched, self._scheduler = self._scheduler, None
        if sched is not None:
            sched.close()

    def graphs_report(self) -> dict:
        """CUDA graphs the static steps captured so far, and why capture failed if it did (for run reports)."""
        steppers = list({id(s): s for s in [*self._steppers.values(), *self._all_steppers]}.values())
        return {"static": self.static, "captured": sum(s.captured for s in steppers),
                "error": next((s.graph_error for s in steppers if s.graph_error), None),
                "compiled": any(s.layer_fn is not static_layer for s in steppers),
                "compile_error": next((s.compile_error for s in steppers if s.compile_error), None)}

    @property
    def max_context(self) -> int:
        return self.lm.cfg.max_position_embeddings

    @property
    def can_diffuse(self) -> bool:
        return self.lm.mask_token_id is not None

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied, ready for the assistant's turn."""
        return self.lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.lm.tokenizer.encode(text, add_special_tokens=False))

    def decode_config(self, **overrides: Any) -> DecodeConfig:
        """A DecodeConfig with the model's stop tokens filled in, validated."""
        cfg = DecodeConfig(**overrides)
        if not cfg.stop_token_ids:
            cfg = replace(cfg, stop_token_ids=self.lm.stop_token_ids)
        return cfg.validate()

    def generate(self, prompts: list[str] | str, cfg: DecodeConfig, *, listener: Listener | None = None,
                 cancel: Cancel | None = None, record: bool = True, chat: bool = True) -> list[Result]:
        """Decode a batch of prompts (chat-templated unless chat=False); one Result per prompt."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ConfigError("prompts", "at least one prompt is needed")
        if not cfg.stop_token_ids:
            cfg = replace(cfg, stop_token_ids=self.lm.stop_token_ids)
        cfg.validate()
        if cfg.mode == "diffusion" and not self.can_diffuse:
            raise ConfigError("mode", "this model has no |<MASK>| token and cannot decode by block diffusion; use 'ar'")
        texts = [self.chat_prompt([{"role": "user", "content": p}]) if chat else p for p in prompts]
        return self.generate_ids([self.encode(t) for t in texts], cfg, listener=listener, cancel=cancel,
                                 record=record, prompt_texts=prompts)

    def generate_ids(self, ids: list[list[int]], cfg: DecodeConfig, *, listener: Listener | None = None,
                     cancel: Cancel | None = None, record: bool = True,
                     prompt_texts: list[str] | None = None) -> list[Result]:
        """Decode token ids (engine time starts here: tokenisation is the caller's)."""
        cfg = self.check_ids(ids, cfg)
        traces = [Trace(self.trace_header(p, cfg, prompt_texts[i] if prompt_texts else None))
                  for i, p in enumerate(ids)] if record else None

        def on_event(e: Event) -> None:
            if traces is not None:
                traces[e.row].events.append(e)
            if listener is not None:
                listener(e)

        model = self.lm.dllm if cfg.mode == "diffusion" else self.lm.base
        with self.lock:
            dec = decoder_for(model, cfg, self.lm.mask_token_id, self.tb,
                              listener=on_event if (record or listener) else None, cancel=cancel,
                              stepper=self.stepper(model))
            summaries: list[Summary] = dec.run(ids)
            if self.lm.device.type == "cuda":
                torch.cuda.synchronize()
        results = []
        for i, s in enumerate(summaries):
            tr = traces[i] if traces is not None else None
            if tr is not None:
                tr.summary = s
            results.append(Result(s, tr))
        return results

    def check_ids(self, ids: list[list[int]], cfg: DecodeConfig) -> DecodeConfig:
        """Validate prompts and config; max_new_tokens clipped to the context room left by the longest prompt."""
        if not cfg.stop_token_ids:
            cfg = replace(cfg, stop_token_ids=self.lm.stop_token_ids)
        cfg.validate()
        if cfg.mode == "diffusion" and not self.can_diffuse:
            raise ConfigError("mode", "this model has no |<MASK>| token and cannot decode by block diffusion; use 'ar'")
        if cfg.mode == "diffusion" and cfg.cache == "dual-sparse" and self.static:
            raise ConfigError("cache", "'dual-sparse' runs on the dynamic path only, and this engine runs static-shape "
                                       "steps (FASTDLLM_STATIC; CUDA graphs on a GPU); use 'dual', or load with "
                                       "FASTDLLM_STATIC=0")
        return fit_to_context(ids, cfg, self.max_context)

    def trace_header(self, ids: list[int], cfg: DecodeConfig, prompt: str | None) -> dict[str, Any]:
        """What a trace (and a live view, before its first event) needs to lay out and label a run."""
        lm = self.lm
        return {"model": lm.name, "source": lm.source.reason, "adapter": bool(lm.source.adapter),
                "device": lm.device.type, "dtype": str(lm.dtype).replace("torch.", ""),
                "config": cfg.to_dict(), "prompt": prompt, "prompt_len": len(ids),
                "mask_token_id": lm.mask_token_id}
