"""The docs: README.md stays a short Space card (front matter first, <= 250 lines) and every link in README.md and
docs/*.md (and the READMEs they send readers to under bench/results/) resolves inside the repository. Pure text:
runs in milliseconds, no model."""
from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_README_LINES = 250


def doc_files() -> list[Path]:
    """README.md, docs/*.md and the result READMEs under bench/results/ (they hold the dated results)."""
    return [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "bench" / "results").glob("**/README.md"))]


# [text](target) and ![alt](target), with an optional "title"; reference-style definitions `[x]: target`
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def strip_code(text: str) -> str:
    """Markdown without fenced blocks and code spans (a `[x](y)` inside code is not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = strip_code(text)
    return [m.group(1) for m in _INLINE.finditer(body)] + [m.group(1) for m in _REFDEF.finditer(body)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    h = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    h = h.replace("`", "").replace("*", "").strip().lower()
    h = "".join(c for c in h if c in " -_" or unicodedata.category(c)[0] in "LN")
    return h.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", text), re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def ignored_by_git(paths: list[Path]) -> set[Path]:
    """Which of `paths` git ignores (they would not exist in a clone); empty when git is not available."""
    try:
        res = subprocess.run(["git", "check-ignore", "--stdin"], cwd=REPO, input="\n".join(map(str, paths)),
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {Path(line) for line in res.stdout.splitlines() if line.strip()}


def dead_links(doc: Path, text: str | None = None) -> list[str]:
    """What is wrong with each link of `doc` (its text read from disk unless given)."""
    text = doc.read_text(encoding="utf-8") if text is None else text
    problems, local = [], []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ... are not ours to check
            continue
        path_part, _, anchor = target.partition("#")
        if not path_part:  # an anchor in this same file
            if anchor and unquote(anchor).lower() not in anchors(text):
                problems.append(f"{target}: no such heading in this file")
            continue
        dest = (doc.parent / unquote(path_part)).resolve()
        if REPO not in dest.parents:
            problems.append(f"{target}: leaves the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        else:
            local.append(dest)
            if anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(REPO)}")
    problems += [f"{p.relative_to(REPO)}: ignored by git, so absent from a clone" for p in ignored_by_git(local)]
    return problems


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves_inside_the_repository(doc: Path) -> None:
    if doc == README or doc.parent.name == "docs":
        assert links(doc.read_text(encoding="utf-8")), f"{doc}: no links found (parser broken?)"
    assert dead_links(doc) == []


def test_readme_is_a_short_space_card() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the limit is {MAX_README_LINES}"
    assert lines[0] == "---", "README.md must start with the Hugging Face Space front matter"
    end = lines.index("---", 1)
    yaml = pytest.importorskip("yaml")
    card = yaml.safe_load("\n".join(lines[1:end]))
    assert card["sdk"] == "gradio" and card["app_file"] == "app.py" and card["title"]


def test_quick_start_commands_exist() -> None:
    """The README's two commands are the scripts that install and run the studio and the tests."""
    text = README.read_text(encoding="utf-8")
    for script in ("scripts/studio.sh", "scripts/test.sh"):
        assert f"bash {script}" in text and (REPO / script).is_file()


def test_link_checker_finds_dead_links() -> None:
    """The checker itself: a dead file, a dead anchor and an escape from the repository are found; code is not read."""
    text = ("# Title\n[ok](../README.md) [self](#title) [bad](nope.md) [anchor](design.md#no-such-heading)\n"
            "[out](../../etc/passwd) `[code](missing.md)`\n```\n[fenced](missing2.md)\n```\n")
    found = dead_links(REPO / "docs" / "probe.md", text)  # a file that need not exist: its text is given
    assert [p.split(":")[0] for p in found] == ["nope.md", "design.md#no-such-heading", "../../etc/passwd"]


def test_fastdllm_switches_are_read_in_one_place_and_documented() -> None:
    """engine/env.py names every FASTDLLM_* switch and only engine/runtime.py reads it: one Runtime field per switch,
    passed to Engine.load; the code mentions no other switch; docs/engine.md's table lists exactly them (issue 25)."""
    from engine import env
    from engine.runtime import FIELDS, Runtime

    py = [p for d in ("engine", "app", "bench", "training", "tests", "scripts", "grading") for p in (REPO / d).rglob("*.py")]
    py += [REPO / "app.py"]
    mentioned = set()
    for p in py:
        text = p.read_text(encoding="utf-8")
        mentioned |= set(re.findall(r"(?<!-D)\bFASTDLLM_[A-Z0-9_]*[A-Z0-9]", text))
        if p.is_relative_to(REPO / "tests") or p.name in ("env.py", "runtime.py"):
            continue
        assert not re.search(r"(os\.environ\.get|os\.getenv|os\.environ\[)\(?f?[\"']FASTDLLM_", text), p
        assert not re.search(r"from engine import env\b|from \.+ import env\b|import engine\.env|engine\.env\.get", text), p
    assert mentioned <= set(env.NAMES), sorted(mentioned - set(env.NAMES))
    assert sorted(Runtime.switch_of(f) for f in FIELDS) == sorted(env.NAMES)
    doc = (REPO / "docs" / "engine.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Environment switches"):]
    table = table[:table.index("\n## ", 5)]
    assert set(re.findall(r"^\| `(FASTDLLM_[A-Z0-9_]+)` \|", table, re.M)) == set(env.NAMES)
    with pytest.raises(KeyError, match="not a FASTDLLM switch"):
        env.get("FASTDLLM_" + "TYPO")  # built, so the scan above does not see a name
