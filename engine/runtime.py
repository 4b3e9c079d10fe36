"""One runtime config: every FASTDLLM_* switch, read once and validated (`Runtime.from_env`), passed to Engine.load.

`Engine.load(runtime=Runtime(weights="fp32", threads=1))` sets switches in code; without it the environment is read
when the engine loads. Code that runs outside an engine (tests, benchmarks, training tools) takes the same object or
reads a fresh one. The table in docs/engine.md ("Environment switches") gives every switch's meaning and default; a
test keeps that table, `engine.env.NAMES` and these fields equal. Which choices a string switch takes (weights,
activations, kernels) is checked where the choice is made (WeightPolicy, weights.kernels), with the switch's name.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from . import env


DEFAULT_CACHE = Path.home() / ".cache" / "fastdllm"


class RuntimeConfigError(ValueError):
    """A FASTDLLM_* switch holds a value it cannot take; the message names the switch and what it takes."""


def _int(name: str, lo: int) -> int | None:
    raw = env.get(name)
    if not raw:
        return None
    try:
        val = int(raw)
    except ValueError:
        raise RuntimeConfigError(f"{name}: {raw!r} is not an integer >= {lo}") from None
    if val < lo:
        raise RuntimeConfigError(f"{name}: {val} must be >= {lo}")
    return val


def _flag(name: str, default: bool | None) -> bool | None:
    raw = env.get(name)
    if not raw:
        return default
    if raw not in ("0", "1"):
        raise RuntimeConfigError(f"{name}: {raw!r} is not 0 or 1")
    return raw == "1"


@dataclass(frozen=True, slots=True)
class Runtime:
    """How this process runs models. None means "the default for the device" where the doc table says so."""

    model: str | None = None  # FASTDLLM_MODEL: hub id, local dir, "bundled" or "bundled-base"
    adapter: Path | None = None  # FASTDLLM_ADAPTER: the bundled base's adapter file
    gguf: Path | None = None  # FASTDLLM_GGUF: the bundled base's GGUF file
    cache: Path = DEFAULT_CACHE  # FASTDLLM_CACHE
    dtype: str | None = None  # FASTDLLM_DTYPE: float32 | bfloat16 | float16 (None: bf16 on CUDA, fp32 on CPU)
    threads: int | None = None  # FASTDLLM_THREADS: torch threads set at load (None: torch's default)
    weights: str = "int4+bf16"  # FASTDLLM_WEIGHTS: CPU weights (engine.weights.quant.MODES)
    int4_wide_rows: int | None = None  # FASTDLLM_INT4_WIDE_ROWS: where int4+bf16 switches to bf16 activations
    # FASTDLLM_ACTIVATIONS: our 4-bit kernels' narrow activations, fp32 | int8 (None: int8, engine.weights.int4.DEFAULT_ACT)
    activations: str | None = None
    # FASTDLLM_WIDE_ACTIVATIONS: our 4-bit kernels' wide activations, bf16 | int8 (None: bf16; the studio picks int8)
    wide_activations: str | None = None
    # FASTDLLM_INT8_PREPACK: int8-activation products on a copy of the 4-bit weights prepacked at load (None: when
    # every product is int8 or the copy is small, engine.weights.quant.PREPACK_MAX_BYTES)
    int8_prepack: bool | None = None
    kernels: str = "auto"  # FASTDLLM_KERNELS: auto | ours | torch
    amx: bool = True  # FASTDLLM_AMX: our bf16 wide products on AMX tiles where the CPU has AMX-BF16
    fused: bool = True  # FASTDLLM_FUSED: one C++ call for every decoder layer of a narrow 4-bit forward
    pack: bool = True  # FASTDLLM_PACK: the dense CPU decode layout
    static: bool | None = None  # FASTDLLM_STATIC: static-shape steps (None: on for CUDA, off for CPU)
    graphs: bool = True  # FASTDLLM_GRAPHS: CUDA graph capture of static steps
    compile: bool = False  # FASTDLLM_COMPILE: torch.compile the static step's layer
    # FASTDLLM_PREFILL_CHUNK: positions a chunked prefill takes per scheduler pass, a multiple of 64 (None: 256)
    prefill_chunk: int | None = None
    # FASTDLLM_PREFIX_CACHE_MIB: K/V of prompt chunks kept for prompts that start with them (None: 512; 0: off)
    prefix_cache_mib: int | None = None
    queue_size: int | None = None  # FASTDLLM_QUEUE_SIZE: studio requests that may wait (None: the studio's 16)
    engine_url: str | None = None  # FASTDLLM_ENGINE_URL: the studio drives this server instead of a local model
    api_key: str | None = None  # FASTDLLM_API_KEY: the server's key
    update_screenshot: bool = False  # FASTDLLM_UPDATE_SCREENSHOT: tests refresh assets/screenshot.png

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise RuntimeConfigError(f"FASTDLLM_DTYPE: {self.dtype!r} is not one of float32, bfloat16, float16")
        if self.prefill_chunk is not None and (self.prefill_chunk < 64 or self.prefill_chunk % 64):
            raise RuntimeConfigError(f"FASTDLLM_PREFILL_CHUNK: {self.prefill_chunk} must be a multiple of 64, at least 64")

    @classmethod
    def from_env(cls) -> "Runtime":
        """Every switch read from the environment now (blank or unset: the default)."""
        adapter, gguf, cache = env.get("FASTDLLM_ADAPTER"), env.get("FASTDLLM_GGUF"), env.get("FASTDLLM_CACHE")
        return cls(
            model=env.get("FASTDLLM_MODEL") or None,
            adapter=Path(adapter) if adapter else None,
            gguf=Path(gguf) if gguf else None,
            cache=Path(cache) if cache else DEFAULT_CACHE,
            dtype=env.get("FASTDLLM_DTYPE") or None,
            threads=_int("FASTDLLM_THREADS", 1),
            weights=env.get("FASTDLLM_WEIGHTS", "int4+bf16"),
            int4_wide_rows=_int("FASTDLLM_INT4_WIDE_ROWS", 2),
            activations=env.get("FASTDLLM_ACTIVATIONS") or None,
            wide_activations=env.get("FASTDLLM_WIDE_ACTIVATIONS") or None,
            int8_prepack=_flag("FASTDLLM_INT8_PREPACK", None),
            kernels=env.get("FASTDLLM_KERNELS", "auto"),
            amx=bool(_flag("FASTDLLM_AMX", True)),
            fused=bool(_flag("FASTDLLM_FUSED", True)),
            pack=bool(_flag("FASTDLLM_PACK", True)),
            static=_flag("FASTDLLM_STATIC", None),
            graphs=bool(_flag("FASTDLLM_GRAPHS", True)),
            compile=bool(_flag("FASTDLLM_COMPILE", False)),
            prefill_chunk=_int("FASTDLLM_PREFILL_CHUNK", 64),
            prefix_cache_mib=_int("FASTDLLM_PREFIX_CACHE_MIB", 0),
            queue_size=_int("FASTDLLM_QUEUE_SIZE", 1),
            engine_url=env.get("FASTDLLM_ENGINE_URL") or None,
            api_key=env.get("FASTDLLM_API_KEY") or None,
            update_screenshot=bool(_flag("FASTDLLM_UPDATE_SCREENSHOT", False)),
        )

    @staticmethod
    def switch_of(field_name: str) -> str:
        """The environment switch a field is read from."""
        return "FASTDLLM_" + field_name.upper()


FIELDS = tuple(f.name for f in fields(Runtime))
