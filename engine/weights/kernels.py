"""Our AVX-512 kernels (engine/weights/csrc/: 4-bit products, one decoder layer's step; AMX tiles for the bf16 wide
products where the CPU has AMX-BF16), compiled on first use.

torch.utils.cpp_extension builds them once per machine (~1 min; cached under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions) for the CPU it runs on. Where that cannot happen (no compiler, no AVX-512 VNNI, or
FASTDLLM_KERNELS=torch) `load()` returns None with the reason, and engine/weights/quant.py uses torch's int4 kernel.
"""
from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "q4.cpp", CSRC / "wide_i8.cpp", CSRC / "amx.cpp", CSRC / "lora.cpp", CSRC / "layer.cpp"]  # + q4.h
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma"]
CHOICES = ("auto", "ours", "torch")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def bf16_ok() -> bool:
    """AVX-512 BF16 (Zen 4, Cooper Lake, Sapphire Rapids): wide calls run the 4-bit weights through q4_bf16
    instead of a dense bf16 copy (engine/weights/quant.py)."""
    return "avx512_bf16" in cpu_flags()


def check(c: str) -> str:
    """`c` if it is a FASTDLLM_KERNELS choice, else a ValueError naming the switch."""
    if c not in CHOICES:
        raise ValueError(f"FASTDLLM_KERNELS: {c!r} is not one of {', '.join(CHOICES)}")
    return c


@lru_cache(maxsize=1)
def _build() -> tuple[ModuleType | None, str]:
    missing = [f for f in NEEDS if f not in cpu_flags()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    try:
        try:  # the pip `ninja` (requirements.txt) when the venv's bin/ is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        from torch.utils.cpp_extension import load

        header = hashlib.sha256((CSRC / "q4.h").read_bytes()).hexdigest()[:12]  # torch re-builds on sources/flags only
        mod = load(name="fastdllm_q4", sources=[str(p) for p in SOURCES], extra_cflags=[*FLAGS, f"-DFASTDLLM_H={header}"],
                   extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], verbose=False)
    except Exception as e:  # no compiler / ninja, or a build error: fall back, and say why
        return None, f"building {CSRC} failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
    return mod, "built"


def load(choice: str = "auto") -> ModuleType | None:
    """The compiled kernels, or None (then `status()` says why). FASTDLLM_KERNELS=ours fails loudly instead."""
    c = check(choice)
    if c == "torch":
        return None
    mod, why = _build()
    if mod is None:
        if c == "ours":
            raise RuntimeError(f"FASTDLLM_KERNELS=ours: {why}")
        log.warning("engine: our CPU kernels are unavailable (%s); using torch's int4 kernel", why)
    return mod


def use_amx(choice: str, on: bool) -> bool:
    """Switch our bf16 wide products onto AMX tiles (`on`, FASTDLLM_AMX; for the whole process: the kernels are
    process-wide) and say whether they run there: the kernels are ours and the CPU and OS give AMX-BF16."""
    mod = load(choice) if check(choice) != "torch" else None
    if mod is None:
        return False
    mod.set_amx(on)
    return bool(mod.amx_bf16_on())


def status(choice: str = "auto") -> str:
    c = check(choice)
    if c == "torch":
        return "torch (FASTDLLM_KERNELS=torch)"
    mod, why = _build()
    return "ours (AVX-512 VNNI)" if mod is not None else f"torch ({why})"
