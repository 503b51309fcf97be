"""Every path the front page and the design name exists; every link in the docs resolves.

- README.md's Layout block: each listed file and folder exists (a module line under
  ``runtime/serve/`` means ``runtime/serve/<name>``), and each module of a listed code folder
  is listed (the block says "every module, one line each").
- README.md and docs/design.md: each path written as code (``runtime/prefix.py``,
  ``serve/tools.py``, ``ort_gqa.py``) names a file of the repository.
- README.md, docs/**/*.md and the folders' README.md files: each relative link points to a
  file that exists and, with ``#anchor``, to a heading of that page (GitHub's slugs).

Pure text checks: no engines, no imports of the package. The ``*_finds_*`` tests feed each
checker a known-bad text, so none of them can pass by seeing nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DESIGN = REPO / "docs" / "design.md"
# git-ignored or generated trees: never a place a doc's path should point into
SKIP_DIRS = {".git", ".venv", "engines", "bench_out", "node_modules", "__pycache__", "specrt.egg-info", ".pytest_cache", ".ruff_cache"}
# folders whose modules the Layout block lists as a comma list, not one line each
LISTED_INLINE = ("bench/", "scripts/")
NOT_MODULES = {"__init__.py", "__main__.py"}
CODE_SUFFIXES = {".py", ".sh"}
NAME = r"[\w.-]+"
# in descriptions: modules, scripts, pages and folders (a bare "tokenizer.json" names a kind of file)
FILE_TOKEN = re.compile(rf"(?<![\w./-])((?:{NAME}/)*{NAME}\.(?:py|sh|md)|(?:{NAME}/)+)(?![\w/-])")


def layout_block(readme: str) -> list[str]:
    """The lines of the first fenced block after README's ``## Layout`` heading.

    Raises AssertionError when the heading or its block is missing."""
    head = readme.index("\n## Layout")
    start = readme.index("```", head)
    end = readme.index("```", start + 3)
    return readme[start:end].splitlines()[1:]


def layout_paths(lines: list[str]) -> tuple[list[str], list[str]]:
    """``(paths, folders)`` the Layout block names, as repo-relative strings.

    A line starting at column 0 opens a folder (its first token, e.g. ``runtime/serve/``, or a
    file such as ``.ci/run``); a line indented by exactly two spaces lists a module of the open
    folder (its first token); on the folder lines and their deeper-indented continuations every
    file-like token counts, relative to the open folder or, when it holds a ``/``, to the repo.
    ``folders`` are those whose every module is listed: the ones with module lines, and
    LISTED_INLINE."""
    paths, folder, complete = [], "", set()
    for line in lines:
        if not line.strip():
            continue
        if not line.startswith(" "):
            first = line.split()[0]
            folder = first if first.endswith("/") else ""
            paths.append(first.rstrip("/"))
            rest = line[len(first) :]
        elif line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            paths.append(folder + name)
            complete.add(folder)
            continue
        else:
            rest = line
        for tok in FILE_TOKEN.findall(rest):
            tok = tok.rstrip("/")
            paths.append(tok if "/" in tok and (REPO / tok.split("/")[0]).exists() else folder + tok)
        if folder in LISTED_INLINE:
            complete.add(folder)
    return paths, sorted(complete)


def missing(paths: list[str]) -> list[str]:
    """The paths of ``paths`` (repo-relative) that do not exist."""
    return [p for p in paths if not (REPO / p).exists()]


def unlisted_modules(paths: list[str], folders: list[str]) -> list[str]:
    """Code files directly in ``folders`` that ``paths`` does not list (package markers aside)."""
    listed = set(paths)
    out = []
    for folder in folders:
        for f in sorted((REPO / folder).iterdir()):
            rel = f"{folder}{f.name}"
            if f.is_file() and f.suffix in CODE_SUFFIXES and f.name not in NOT_MODULES and rel not in listed:
                out.append(rel)
    return out


def repo_files() -> list[str]:
    """Every file of the working tree outside SKIP_DIRS, repo-relative with ``/``."""
    out = []
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if p.is_file() and not SKIP_DIRS.intersection(rel.parts[:-1]):
            out.append(rel.as_posix())
    return out


def code_paths(text: str) -> list[str]:
    """Paths written as inline code in ``text``: a token ending in .py/.sh, or holding a ``/``
    and ending in .md/.json/.jsonl/.jinja (``/v1/...`` routes and bare data file names are not
    repository paths). Fenced blocks are skipped."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    for code in re.findall(r"`([^`\n]+)`", text):
        tok = code.strip().split()[0] if code.strip() else ""
        tok = tok.split("::")[0].split(":")[0].rstrip(",.;)")
        if re.fullmatch(rf"(?:{NAME}/)*{NAME}\.(?:py|sh)", tok) or re.fullmatch(rf"(?:{NAME}/)+{NAME}\.(?:md|json|jsonl|jinja)", tok):
            out.append(tok)
    return out


def unknown_code_paths(text: str, files: list[str]) -> list[str]:
    """The code paths of ``text`` that are no file of ``files`` (equal, or a ``/``-suffix of one)."""
    return [p for p in code_paths(text) if not any(f == p or f.endswith("/" + p) for f in files)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: links and code marks dropped, lowercased, punctuation
    other than ``-`` and ``_`` removed, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a markdown page's headings (outside fenced blocks; repeats get -1, -2)."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """Relative links of ``page`` (its text, or ``text``) whose file or heading does not exist."""
    text = page.read_text() if text is None else text
    bad = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path) if path else page
        if not target.exists():
            bad.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{link} (no such heading)")
    return bad


def doc_pages() -> list[Path]:
    """README.md, every page under docs/, and the README.md of each top folder."""
    return [README, *sorted((REPO / "docs").rglob("*.md")), *sorted(REPO.glob("*/README.md")), *sorted(REPO.glob("spikes/*/README.md"))]


def test_every_layout_path_exists():
    paths, _ = layout_paths(layout_block(README.read_text()))
    assert len(paths) > 100, "the Layout block was not parsed"
    assert not missing(paths), f"README.md's Layout names paths that do not exist: {missing(paths)}"


def test_layout_lists_every_module():
    paths, folders = layout_paths(layout_block(README.read_text()))
    assert {"runtime/", "runtime/serve/", "export/", "bench/", "scripts/"} <= set(folders), folders
    bad = unlisted_modules(paths, folders)
    assert not bad, f"modules missing from README.md's Layout (add one line each): {bad}"


def test_code_paths_in_readme_and_design_exist():
    files = repo_files()
    for page in (README, DESIGN):
        bad = unknown_code_paths(page.read_text(), files)
        assert not bad, f"{page.relative_to(REPO)} names files that do not exist: {bad}"


def test_every_relative_link_resolves():
    bad = {str(p.relative_to(REPO)): b for p in doc_pages() if (b := broken_links(p))}
    assert not bad, f"broken links: {bad}"


def test_layout_checker_finds_a_missing_module_line():
    """The defect this test was written for: a module line for a file that is gone."""
    lines = layout_block(README.read_text())
    at = next(i for i, x in enumerate(lines) if x.startswith("  tools.py"))
    paths, _ = layout_paths([*lines[:at], "  chat.py              the old import path", *lines[at:]])
    assert missing(paths) == ["runtime/serve/chat.py"]


def test_layout_checker_finds_an_unlisted_module():
    lines = [x for x in layout_block(README.read_text()) if not x.startswith("  prefix.py")]
    paths, folders = layout_paths(lines)
    assert unlisted_modules(paths, folders) == ["runtime/prefix.py"]


def test_code_path_checker_finds_a_missing_file():
    files = repo_files()
    text = "See `runtime/serve/chat.py`, `serve/tools.py`, `ort_gqa.py:12`, `/v1/completions`, `manifest.json`."
    assert unknown_code_paths(text, files) == ["runtime/serve/chat.py"]


def test_link_checker_finds_a_missing_file_and_heading():
    text = "[a](docs/nope.md) [b](#layout) [c](#no-such-heading) [d](docs/design.md) [e](https://x.org/y.md)"
    assert broken_links(README, text) == ["docs/nope.md (no such file)", "#no-such-heading (no such heading)"]
