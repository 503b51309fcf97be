"""Mutation runs: apply one source change to a scratch copy of the tree and run tests there.

A test suite that cannot fail is a defect; a mutation run shows that a named bug makes at least
one test fail. The shared checkout is never touched: the tree (tracked and untracked files, not
ignored ones) is copied to a temporary folder, ``engines/`` is linked in, the mutation is applied
to the copy (a mutation of the C kernels rebuilds the copy's library), and pytest runs there with ``specrt`` imported from the copy (a ``PYTHONPATH`` entry
ahead of the editable install's finder).

Usage::

    python scripts/mutate.py --file runtime/prefix.py --old "len(seq) - min_q" --new "len(seq) - 1" \\
        -- tests/test_prefix.py -q -x
    python scripts/mutate.py --plan mutations.json      # [{"name", "file", "old", "new", "tests": [...]}, ...]

Each mutation prints one line: ``CAUGHT`` (pytest failed: the tests see the bug) or ``SURVIVED``
(every selected test passed), with the pytest summary line. ``--old`` must occur exactly once
in ``--file`` (else the run is refused: a mutation that does not apply proves nothing).
Exit status: 0 when every mutation was caught, 1 when one survived, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the package-dir mapping of pyproject.toml: import name -> folder under the tree
SUBPACKAGES = {"runtime": "runtime", "export": "export", "bench": "bench"}


def copy_tree(dst: Path) -> None:
    """Copy the tracked and untracked (not ignored) files of the checkout into ``dst``; link
    ``engines/`` (built artefacts, read-only for tests) and any built kernel library."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, check=True, capture_output=True).stdout.split(
        b"\0"
    )
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file():
            continue  # deleted in the work tree
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)
    (dst / "engines").exists() and shutil.rmtree(dst / "engines")
    os.symlink(REPO / "engines", dst / "engines")
    for so in REPO.glob("runtime/kernels/*.so"):  # the compiled kernels (ignored by git): reuse the build
        shutil.copy2(so, dst / so.relative_to(REPO))


def import_root(dst: Path) -> Path:
    """A folder to put first on ``PYTHONPATH`` so that ``import specrt`` loads the copy."""
    root = dst / ".mutant_pkg"
    root.mkdir()
    os.symlink(dst / "specrt_ns", root / "specrt")
    for name, folder in SUBPACKAGES.items():
        link = dst / "specrt_ns" / name
        if not link.exists():
            os.symlink(dst / folder, link)
    return root


def apply(dst: Path, file: str, old: str, new: str) -> None:
    """Replace the one occurrence of ``old`` in ``dst/file`` by ``new``.

    Raises:
        SystemExit(2): the file is missing or ``old`` occurs other than exactly once.
    """
    p = dst / file
    if not p.is_file():
        raise SystemExit(f"mutate: {file} is not a file of the tree")
    text = p.read_text()
    n = text.count(old)
    if n != 1:
        raise SystemExit(f"mutate: --old occurs {n} times in {file}; it must occur exactly once")
    p.write_text(text.replace(old, new))


def run_one(name: str, file: str, old: str, new: str, tests: list[str]) -> bool:
    """Run one mutation; True when caught (pytest failed). Prints one line."""
    with tempfile.TemporaryDirectory(prefix="specrt-mutant-") as tmp:
        dst = Path(tmp)
        copy_tree(dst)
        apply(dst, file, old, new)
        env = dict(os.environ, PYTHONPATH=f"{import_root(dst)}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        if file.startswith("runtime/kernels/") and file.endswith((".c", ".h")):  # a C mutation: rebuild the copy's library
            for so in (dst / "runtime" / "kernels").glob("_sk*.so"):
                so.unlink()
            b = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dst, capture_output=True, text=True)
            if b.returncode != 0 or not list((dst / "runtime" / "kernels").glob("_sk*.so")):
                print(f"ERROR    {name}: the mutated kernels do not build: {b.stderr.strip()[-300:]}", flush=True)
                return False
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *tests], cwd=dst, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
        summary = lines[-1] if lines else proc.stderr.strip()[-200:]
        caught = proc.returncode != 0
        print(f"{'CAUGHT  ' if caught else 'SURVIVED'} {name}: {summary}", flush=True)
        if proc.returncode not in (0, 1):
            print(f"         (pytest exit {proc.returncode}: not a test failure; check the selection)", flush=True)
        return caught


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", help="JSON list of {name, file, old, new, tests}")
    ap.add_argument("--file")
    ap.add_argument("--old")
    ap.add_argument("--new")
    ap.add_argument("--name", default="mutation")
    ap.add_argument("tests", nargs="*", help="pytest arguments (after --)")
    a = ap.parse_args(argv)
    if a.plan:
        plan = json.loads(Path(a.plan).read_text())
    elif a.file and a.old is not None and a.new is not None and a.tests:
        plan = [{"name": a.name, "file": a.file, "old": a.old, "new": a.new, "tests": a.tests}]
    else:
        ap.error("give --plan FILE, or --file, --old, --new and the pytest arguments after --")
    caught = [run_one(m["name"], m["file"], m["old"], m["new"], list(m["tests"])) for m in plan]
    print(f"{sum(caught)}/{len(caught)} mutations caught")
    return 0 if all(caught) else 1


if __name__ == "__main__":
    sys.exit(main())
