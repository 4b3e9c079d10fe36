"""Shared benchmark plumbing: prompts, engine loading, peak memory, tables, charts, JSON output."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_PROMPTS = BENCH_DIR / "data" / "long_answer.jsonl"
DEFAULT_EVAL_SET = BENCH_DIR / "data" / "eval_short.jsonl"
NEVER_STOP = 2**31 - 1  # a stop id no tokenizer produces: --ignore-eos decodes exactly max_new_tokens


def parse_list(text: str | None, kind: type = str) -> list[Any]:
    """'1,4' -> [1, 4]; empty or None -> []."""
    if not text:
        return []
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(cmd: list[str], ready_url: str, what: str, threads: int,
                  cwd: Path | None = None) -> Any:
    """Start a server process (FASTDLLM_THREADS=threads) and wait until GET ready_url answers 200 (at most 300 s);
    its last stderr in the error when it exits first."""
    import subprocess

    import httpx

    env = {**os.environ, "FASTDLLM_THREADS": str(threads)}  # the child's switch, read by its own Runtime
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the {what} did not start within 300 s")


@contextlib.contextmanager
def running(url: str | None, start: Callable[[], tuple[Any, str]]) -> Iterator[str]:
    """The URL of an already running server (`url`), or of one `start` launches for the bench and stops after it."""
    proc, url = (None, url) if url else start()
    try:
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def prompts_for(path: str | Path, n: int) -> list[str] | None:
    """The first n prompts of a file, or None after printing why there are fewer (a benchmark's exit code 2)."""
    prompts = load_prompts(path, n)
    if len(prompts) < n:
        print(f"error: {path} has fewer than {n} prompts", file=sys.stderr)
        return None
    return prompts


def subcommand(sub: Any, name: str, help: str, func: Callable[[Any], int], *, threads: int | None = None) -> Any:
    """A bench's subparser with what every such bench takes: --threads (torch threads; None: torch's default) and
    --out (a directory for NAME.json; none: print only). The caller adds its own options."""
    import argparse

    p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--threads", type=int, default=threads, help="torch CPU threads")
    p.add_argument("--out", default=None, help=f"write DIR/{name}.json")
    p.set_defaults(func=func)
    return p


def add_concurrency_options(p: Any, *, started: tuple[str, str, str], crowd: str, settings: dict[str, Any], default_settings: str,
                            max_tokens_help: str) -> None:
    """The options of a "N at once vs one after another" bench (serve: clients, studio: browser sessions)."""
    p.add_argument("--url", help=f"an already running {started[0]}'s {started[2]} (default: start `{started[1]}`)")
    p.add_argument("--model", help=f"model for the started {started[0]} (default: the bundled one)")
    p.add_argument(f"--{crowd}", type=int, default=8, help=f"{crowd} at once")
    p.add_argument("--repeats", type=int, default=2, help=f"alternations of the one-{crowd[:-1]} and N-{crowd[:-1]} phases")
    p.add_argument("--max-tokens", type=int, default=32, help=max_tokens_help)
    p.add_argument("--settings", default=default_settings, help=f"of {', '.join(settings)}")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help=f'JSONL of {{"prompt": ...}} (the first --{crowd})')
    p.add_argument("--threads", type=int, default=1, help=f"FASTDLLM_THREADS of the started {started[0]}")


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from JSONL of {"prompt": ...} (other fields ignored); errors name the line."""
    from grading.checker import read_jsonl

    prompts: list[str] = []
    for lineno, item in read_jsonl(path):
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise ValueError(f"{path}: line {lineno}: needs a non-empty string field 'prompt'")
        prompts.append(item["prompt"])
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def setup_torch(threads: int | None) -> None:
    """Intra-op threads: on a shared, oversubscribed CPU 1 thread can beat 2 by a wide margin."""
    if threads:
        torch.set_num_threads(threads)


_ENGINES: dict[tuple, Any] = {}


def load_engine(model: str | None, dtype: str | None, device: str | None = None, runtime: Any = None):
    """Engine.load, memoised per (model, dtype, device, FASTDLLM_* switches: `runtime`, else the environment's) so
    in-process callers load once."""
    from engine import Engine
    from engine.runtime import Runtime

    runtime = runtime or Runtime.from_env()
    key = (model, dtype, device, runtime)
    if key not in _ENGINES:
        _ENGINES[key] = Engine.load(model, device=device, dtype=dtype, runtime=runtime)
    return _ENGINES[key]


def adapter_info(path: Any) -> dict[str, str] | None:
    """The adapter file's metadata (training step, loss...), so a result says which adapter made it."""
    if not path:
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
    except Exception:  # unreadable metadata must not stop a benchmark
        return None
    keep = ("step", "total_steps", "loss_last10", "tokens_seen", "checkpoint", "recipe", "rank")
    return {k: meta[k] for k in keep if k in meta}


def environment(eng) -> dict[str, Any]:
    lm = eng.lm
    return {
        "adapter_meta": adapter_info(lm.source.adapter),
        "model": lm.banner(), "model_name": lm.name, "adapter": str(lm.source.adapter) if lm.source.adapter else None,
        "device": lm.device.type, "dtype": str(lm.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _proc_status_mb(key: str) -> float | None:
    """A kB field of /proc/self/status (VmRSS, VmHWM) in MiB; None where there is no procfs."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of one measured span: CUDA max allocated on GPU; process peak RSS (VmHWM) on CPU.

    On Linux the RSS high-water mark is reset by writing 5 to /proc/self/clear_refs, so each span gets
    its own peak; where that is not possible the process-wide peak is reported (kind says which).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.kind = "cuda_max_allocated" if self.cuda else "rss_peak"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.kind = "rss_peak_process"

    def current_mb(self) -> float:
        """Memory in use now (allocated on GPU, VmRSS on CPU): the baseline a span's peak grows from."""
        if self.cuda:
            return torch.cuda.memory_allocated() / 2**20
        rss = _proc_status_mb("VmRSS")
        return rss if rss is not None else 0.0

    def peak_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        if _proc_status_mb("VmHWM") is None:
            self.kind = "rss_peak_process"
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """This process's peak RSS in MiB: VmHWM where there is procfs (ru_maxrss elsewhere; on Linux ru_maxrss also
    holds the parent's RSS at fork, carried across exec)."""
    hwm = _proc_status_mb("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def median_index(values: list[float]) -> int:
    """Index of the (lower) median value: the repeat whose numbers are reported."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(order) - 1) // 2]


def median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else 0.0


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]], nd: int = 2) -> str:
    """Plain text table (also valid Markdown) of rows[key] under the given headers."""
    head = [h for _, h in columns]
    body = [[fmt(r.get(k), nd) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(b) for b in body)])


@dataclass
class ChartFiles:
    html: list[str]
    png: list[str]
    png_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"html": self.html, "png": self.png, "png_error": self.png_error}


_PNG_CHILD = """
import json, sys
import plotly.io as pio
for src, dst in json.loads(sys.argv[1]):
    pio.from_json(open(src, encoding="utf-8").read()).write_image(dst, width=1100, height=560, scale=1)
"""


def save_figures(figs: dict[str, Any], out: Path, png: bool = True, timeout: float | None = None) -> ChartFiles:
    """Write each plotly figure as HTML (always, plotly.js inlined so it opens offline) and as PNG when kaleido
    can render (kaleido >= 1 drives a Chrome/Chromium on the machine, e.g. Debian's `chromium`).

    PNG export runs in its own process group with a time limit: a browser that hangs (seen here under
    load) costs at most `timeout` seconds and leaves no process behind, and the HTML still stands.
    """
    import signal
    import subprocess
    import tempfile

    files = ChartFiles([], [])
    for name, fig in figs.items():
        path = out / f"{name}.html"
        fig.write_html(str(path), include_plotlyjs=True, full_html=True)
        files.html.append(str(path))
    if not png:
        files.png_error = "disabled (--no-png)"
        return files
    timeout = timeout or 60.0 + 20.0 * len(figs)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for name, fig in figs.items():
            src = Path(tmp) / f"{name}.json"
            src.write_text(fig.to_json(), encoding="utf-8")
            jobs.append((str(src), str(out / f"{name}.png")))
        proc = subprocess.Popen([sys.executable, "-c", _PNG_CHILD, json.dumps(jobs)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and the browser it started
            proc.communicate()
            files.png_error = f"PNG export timed out after {timeout:.0f} s (kaleido/Chromium hung)"
            return files
    if proc.returncode != 0:
        last = [ln for ln in (err or "").strip().splitlines() if ln.strip()]
        files.png_error = (last[-1] if last else f"exit code {proc.returncode}")[:300]
    files.png = [dst for _, dst in jobs if Path(dst).exists()]
    return files


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def progress(total: int, desc: str, disable: bool = False):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=disable, dynamic_ncols=True, leave=False)
