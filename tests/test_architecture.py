"""The house rules of issue 25, read from the code's own imports: no import circles, no private names used across
top-level folders, no engine module over 350 lines. Tests are left out of the first two (they may reach inside)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "app", "bench", "training", "grading")
MAX_ENGINE_LINES = 350


def project_files() -> dict[str, Path]:
    """Module name -> file, for every project module (app.py included), tests left out."""
    mods = {"app_main": REPO / "app.py"}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            if "results" in p.parts or "__pycache__" in p.parts:
                continue
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = p
    return mods


def imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported project module, names taken from it) for every import in the file, lazy ones included."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in mods]
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + (node.module.split(".") if node.module else []))
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in mods:  # `from pkg import module`
                    out.append((sub, []))
                elif mod in mods:
                    out.append((mod, [a.name]))
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, list[str]]]]]:
    mods = project_files()
    raw = {m: imports(m, p, mods) for m, p in mods.items()}
    return {m: {t for t, _ in deps if t != m} for m, deps in raw.items()}, raw


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def folder(mod: str) -> str:
    return mod.split(".")[0]


def test_no_import_circles() -> None:
    graph, _ = import_graph()
    assert circles(graph) == []


def test_the_circle_finder_finds_a_planted_circle() -> None:
    graph, _ = import_graph()
    graph["engine.model"] = graph["engine.model"] | {"engine.engine"}  # engine.engine reaches engine.model
    found = circles(graph)
    assert found and "engine.model" in found[0] and "engine.engine" in found[0]


def test_no_private_names_across_top_level_folders() -> None:
    _, raw = import_graph()
    crossing = [f"{m} takes {n} from {t}" for m, deps in raw.items() for t, names in deps for n in names
                if folder(t) != folder(m) and n.startswith("_") and not n.startswith("__")]
    assert crossing == []


def test_no_engine_module_over_350_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in (REPO / "engine").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_ENGINE_LINES}
    assert long == {}
