"""Builds of the kernels library from the same sources with different build-time settings
(``CFLAGS``, e.g. ``-DSK_PF_AHEAD=2 -DSK_PF_LOC=3``, the prefetch constants in
``runtime/kernels/c/sk_internal.h``), compared on one engine folder in one interleaved run.

Per round, in an order rotated each round, each build runs in its own process
(``SPECRT_KERNELS_LIB``):

* the target's step at each width of ``--widths`` after ``--past`` rows, with the reduced head
  (``run_argmax``, what greedy verification calls): median ms of ``--reps`` calls after one
  warm-up;
* the draft's 1-row ... step the same way, with its own (trimmed) head (``run``);
* with ``--bench-limit N``, ``specrt bench`` on the first N prompts of ``--prompts``
  (target-only, its 1-row form and the folder's speculative defaults: tok/s and output == target).

The ISA path is the CPU's best, or ``SPECRT_KERNELS_ISA`` (recorded). Medians over rounds of
each round's figure, the spread (min, max) of the rounds, and each build's ratio to the first.
The bits do not depend on the prefetch settings (tests/test_kernel_builds_ab.py checks a build
with every one changed). The record names the machine and the load average.

    .venv/bin/python scripts/kernel_builds_ab.py --engines ENGINES \\
        --build old="-DSK_PF_AHEAD=2 -DSK_PF_LOC=3" --build new="" \\
        --out docs/bench/kernel_tq/<cpu>_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(name: str, cflags: str, tmp: Path) -> Path:
    """The kernels library built with ``cflags`` (the sources' own flags after them) into
    ``tmp/name``; returns its path. Raises SystemExit when the build fails."""
    out, work = tmp / name, tmp / f"{name}.build"
    env = dict(os.environ, CFLAGS=cflags)
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out), "--build-temp", str(work), "--force"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    found = sorted(out.rglob("_sk*.so"))
    if r.returncode or not found or "were not built" in r.stdout:
        raise SystemExit(f"kernel_builds_ab: build {name!r} ({cflags!r}) failed: {(r.stdout + r.stderr).strip()[-400:]}")
    return found[0]


def child(engines: str, widths: list[int], past: int, reps: int, threads: int) -> dict:
    """In the measured process: ms per target call by width (reduced head) and per draft
    call by width (its own head), after ``past`` rows, on ``threads`` threads."""
    from specrt import Engine
    from specrt.bench.kernel_step import time_calls
    from specrt.runtime.backends.base import ThreadConfig
    from specrt.runtime.chunks import feed
    from specrt.runtime.kernels import library

    eng = Engine(engines, threads=ThreadConfig(intra_op=threads), backend="kernels", prefix_cache=False)
    vocab = eng.manifest.vocab_size
    out = {"library": str(library()._name), "isa": eng.target.isa}
    for role, model in (("target", eng.target), ("draft", eng.draft)):
        feed(model, [(13 * i) % 5000 + 100 for i in range(past)], 0)
        call = (lambda t, s, m=model: m.run_argmax(t, s, vocab)) if role == "target" else None
        out[role] = {q: time_calls(model, q, past, reps, call) for q in widths}
    return out


def bench_once(lib: Path, a) -> dict:
    """``specrt bench`` on the folder with library ``lib``: its rows' tok/s and output == target."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "b.json"
        cmd = [str(Path(sys.executable).parent / "specrt"), "bench", "--engines", a.engines, "--prompts", a.prompts, "--limit", str(a.bench_limit)]
        cmd += ["--max-new-tokens", str(a.max_new_tokens), "--out", str(out)]
        r = subprocess.run(cmd, env=dict(os.environ, SPECRT_KERNELS_LIB=str(lib)), capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"kernel_builds_ab: specrt bench failed: {r.stderr.strip()[-400:]}")
        rows = json.loads(out.read_text())["rows"]
    return {row["label"]: {"tok_s": row["tokens_per_second"], "equal_target": row["equal_to_target"]} for row in rows}


def measure(lib: Path, a) -> dict:
    """One round of one build: the step timings (a child process) and, if asked, the bench."""
    cmd = [sys.executable, __file__, "--child", "--engines", a.engines, "--widths", a.widths, "--past", str(a.past), "--reps", str(a.reps)]
    cmd += ["--threads", str(a.threads)]
    r = subprocess.run(cmd, env=dict(os.environ, SPECRT_KERNELS_LIB=str(lib)), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"kernel_builds_ab: the step timing failed with {lib}: {r.stderr.strip()[-400:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if a.bench_limit:
        got["bench"] = bench_once(lib, a)
    return got


def summarize(rounds: dict[str, list[dict]]) -> dict:
    """Per build: median (min, max) over rounds of each figure, and the ratio of each median to
    the first build's (ms: first / this, so > 1 is faster; tok/s: this / first)."""

    def agg(vals):
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    out = {}
    for name, rs in rounds.items():
        s = {role: {q: agg([r[role][q] for r in rs]) for q in rs[0][role]} for role in ("target", "draft")}
        if "bench" in rs[0]:
            s["bench"] = {c: agg([r["bench"][c]["tok_s"] for r in rs]) for c in rs[0]["bench"]}
            s["bench_equal_target"] = {c: [r["bench"][c]["equal_target"] for r in rs] for c in rs[0]["bench"]}
        out[name] = s
    first = next(iter(out.values()))
    for s in out.values():
        s["speedup_vs_first"] = {role: {q: first[role][q]["median"] / v["median"] for q, v in s[role].items()} for role in ("target", "draft")}
        if "bench" in s:
            s["speedup_vs_first"]["bench"] = {c: v["median"] / first["bench"][c]["median"] for c, v in s["bench"].items()}
    return out


def widths_of(spec: str) -> list[int]:
    """``"1-16"`` or ``"1,2,5,9"`` as a list of widths. Raises SystemExit on a bad spec."""
    try:
        if "-" in spec:
            lo, hi = (int(x) for x in spec.split("-"))
            ws = list(range(lo, hi + 1))
        else:
            ws = [int(x) for x in spec.split(",")]
    except ValueError:
        ws = []
    if not ws or min(ws) < 1:
        raise SystemExit(f"--widths {spec!r}: give A-B or a comma-separated list of widths >= 1")
    return ws


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", required=True, help="engine folder on the kernels (e.g. from `specrt export --target T.gguf --draft D.gguf`)")
    ap.add_argument("--build", action="append", default=[], metavar='NAME="CFLAGS"', help="a build to compare (repeatable; the first is the reference)")
    ap.add_argument("--widths", default="1-16")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared/data/humaneval_dev.jsonl"))
    ap.add_argument("--bench-limit", type=int, default=0, help="also run `specrt bench` on this many prompts per round and build")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    widths = widths_of(a.widths)
    if a.child:
        print(json.dumps(child(a.engines, widths, a.past, a.reps, a.threads)))
        return None
    names = [b.split("=", 1)[0] for b in a.build]
    if len(a.build) < 2 or any("=" not in b for b in a.build) or len(set(names)) < len(names):
        raise SystemExit('kernel_builds_ab: give at least two --build NAME="CFLAGS" with distinct names (the first is the reference)')
    if a.rounds < 1 or a.reps < 1:
        raise SystemExit(f"kernel_builds_ab: --rounds and --reps must be >= 1 (got {a.rounds}, {a.reps})")
    from specrt.bench.common import say_machine, source_commit, write_json
    from specrt.runtime.machine import machine_record

    say_machine()
    machine, load0 = machine_record(), os.getloadavg()
    isa_env = os.environ.get("SPECRT_KERNELS_ISA")
    with tempfile.TemporaryDirectory(prefix="kernel_builds_") as d:
        builds = {n: (f, build(n, f, Path(d))) for n, f in (b.split("=", 1) for b in a.build)}
        rounds: dict[str, list[dict]] = {n: [] for n in names}
        for i in range(a.rounds):
            for n in names[i % len(names) :] + names[: i % len(names)]:
                rounds[n].append(measure(builds[n][1], a))
                print(f"round {i + 1} {n}: target {rounds[n][-1]['target']}", flush=True)
    rec = {
        "what": "kernels library builds (CFLAGS) compared: target step (reduced head) and draft step by width, interleaved",
        "command": (f"SPECRT_KERNELS_ISA={isa_env} " if isa_env else "")
        + shlex.join(["python", "scripts/kernel_builds_ab.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "specrt_commit": source_commit(),
        "isa": rounds[names[0]][0]["isa"],
        "threads": a.threads,
        "load_before": load0,
        "load_after": os.getloadavg(),
        "builds": {n: f for n, (f, _) in builds.items()},
        "engines": a.engines,
        "past": a.past,
        "reps": a.reps,
        "rounds": a.rounds,
        "summary": summarize(rounds),
        "raw": rounds,
    }
    for n, s in rec["summary"].items():
        print(n, " ".join(f"q{q}:{v['median']:.1f}ms" for q, v in s["target"].items()))
    if a.out:
        write_json(a.out, rec)
    return rec


if __name__ == "__main__":
    main()
