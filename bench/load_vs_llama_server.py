#!/usr/bin/env python
"""Serving throughput at several concurrencies: ``specrt serve --max-batch N`` against llama.cpp's
``llama-server`` with N parallel slots on the same pair, interleaved (issues 17 and 53's anchor).

For each concurrency C (in the order given, and for each repeat) every system takes the same
bounded load run (``specrt.bench.load``: C client threads, ``max(16, 4 C)`` non-streamed
``/v1/completions`` requests of ``--max-tokens`` tokens, greedy, the built-in code prompts)
one after the other, the order rotating. specrt is started by the load run itself
(``--engines``). llama-server (built from the pinned llama.cpp source, ``make bench-envs``)
is started once per ``--llama-modes`` mode with ``-np N -c N*ctx --metrics`` on the target's
GGUF and reused: ``target-only``, ``ngram-simple``, ``draft-simple`` (needs ``--draft-gguf``).

The baseline row ``specrt target-only, one request`` is the same specrt server with
``"speculative": false`` in every body, run at C = 1 only (issue 53's "aggregate >= 3.0x
single-request target-only"). Output: one JSON with every run's summary, the completion
tokens/s per (system, concurrency), and specrt's ratios to that baseline and to the fastest
llama-server mode at each C.

    python -m specrt.bench.load_vs_llama_server --engines FOLDER --gguf T.gguf \\
        --llama-server .venv-llamacpp/src/build/bin/llama-server --slots 4 --concurrency 1,2,4 \\
        --llama-modes target-only,ngram-simple --repeats 2 --out slots4.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from specrt.bench.common import source_commit, write_json
from specrt.bench.kernel_step import llama_version
from specrt.bench.servers import LLAMA_MODES, free_port, llama_mode_flags, stop_all

BASELINE = "specrt target-only, one request"


def start_llama_server(binary: str, gguf: str, slots: int, ctx: int, threads: int, extra=()) -> tuple[subprocess.Popen, int]:
    """Start llama-server on loopback (``extra`` flags after the model's) and wait until
    /health answers (at most 300 s). Raises SystemExit when it exits or never answers."""
    port = free_port()
    lib = str(Path(binary).resolve().parent.parent / "src" / "build" / "bin")
    env = dict(os.environ, LD_LIBRARY_PATH=lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    cmd = [binary, "-m", gguf, *extra, "-np", str(slots), "-c", str(slots * ctx), "-t", str(threads), "-tb", str(threads)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--metrics"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while time.time() - t0 < 300:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    proc.wait()
    raise SystemExit("llama-server did not become healthy in 300 s")


def load_run(target: list[str], c: int, max_tokens: int) -> dict:
    """One load run (``python -m specrt.bench.load``, a process of its own); returns its summary JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "specrt.bench.load", *target, "--concurrency", str(c), "--requests", str(max(16, 4 * c))]
    cmd += ["--max-tokens", str(max_tokens), "--max-seconds", "120", "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        summary = json.load(f)
    os.unlink(out)
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module's docstring); argparse exits on a bad one."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--gguf", required=True, help="the target's GGUF for llama-server")
    ap.add_argument("--draft-gguf", help="the draft's GGUF, for --llama-modes draft-simple")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--llama-modes", default="target-only", help=f"comma-separated llama-server modes, of {', '.join(LLAMA_MODES)}")
    ap.add_argument("--no-baseline", action="store_true", help="skip specrt's single-request target-only row")
    ap.add_argument("--slots", type=int, default=8, help="llama-server -np and specrt --max-batch")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    a.levels = [int(x) for x in a.concurrency.split(",")]
    a.modes = [m.strip() for m in a.llama_modes.split(",") if m.strip()]
    if not a.modes:
        ap.error(f"--llama-modes names no mode; give one or more of {', '.join(LLAMA_MODES)}")
    for m in a.modes:
        llama_mode_flags(m, a.draft_gguf, a.threads)  # refuses a bad mode before any server starts
    return a


def schedule(systems: list[str], levels: list[int], repeats: int, baseline: str | None) -> list[tuple[int, int, str]]:
    """The interleaved order of (repeat, concurrency, system) runs: at each (repeat, C) every
    system once, rotated by one place per concurrency and per repeat, so that at one C the
    first system changes from one repeat to the next; ``baseline`` (when given) joins each
    repeat's first step, always at C = 1 (one request at a time)."""
    order = []
    for r in range(repeats):
        for i, c in enumerate(levels):
            runs = [(c, n) for n in systems] + ([(1, baseline)] if baseline and i == 0 else [])
            k = (r + i) % len(runs)
            order += [(r, cc, n) for cc, n in runs[k:] + runs[:k]]
    return order


def summarize(runs: list[dict], levels: list[int], specrt: str, llama: list[str], baseline: str | None) -> dict:
    """Median completion tok/s per (system, C), and specrt's ratios at each C: to the fastest
    llama-server mode at that C, and to the single-request target-only baseline's median."""
    got: dict[str, dict[str, list[float]]] = {}
    for x in runs:  # every concurrency a system ran at (the baseline's 1 need not be in levels)
        got.setdefault(x["system"], {}).setdefault(str(x["concurrency"]), []).append(x["summary"]["completion_tokens_per_s"])
    table = {name: {c: statistics.median(v) for c, v in row.items()} for name, row in got.items()}
    base = table.get(baseline, {}).get("1") if baseline else None
    ratios = {}
    for c in map(str, levels):
        best = max(llama, key=lambda n: table[n].get(c, 0.0))
        ratios[c] = dict(
            fastest_llama_server=best,
            vs_fastest_llama_server=round(table[specrt][c] / table[best][c], 3),
            vs_single_request_target_only=round(table[specrt][c] / base, 3) if base else None,
        )
    return dict(completion_tokens_per_s=table, specrt_ratios=ratios)


def main(argv=None) -> int:
    """Start llama-server once per mode, run every system at every concurrency
    (interleaved), stop them; write every run to ``--out`` and print the table. Returns 0.

    Raises:
        SystemExit: a bad mode, or llama-server did not come up.
        subprocess.CalledProcessError: a load run failed.
    """
    a = parse_args(argv)
    specrt_args = ["--engines", a.engines, "--max-batch", str(a.slots), "--threads", str(a.threads)]
    specrt = f"specrt serve --max-batch {a.slots}"
    systems, procs = {specrt: specrt_args}, []
    baseline = None if a.no_baseline else BASELINE
    if baseline:
        systems[baseline] = [*specrt_args, "--body", json.dumps({"speculative": False})]
    llama = []
    try:
        for m in a.modes:
            proc, port = start_llama_server(a.llama_server, a.gguf, a.slots, a.ctx, a.threads, llama_mode_flags(m, a.draft_gguf, a.threads))
            procs.append(proc)
            llama.append(f"llama-server -np {a.slots} {m}")
            systems[llama[-1]] = ["--url", f"http://127.0.0.1:{port}"]
        runs = []
        for r, c, name in schedule([n for n in systems if n != baseline], a.levels, a.repeats, baseline):
            s = load_run(systems[name], c, a.max_tokens)
            runs.append(dict(system=name, concurrency=c, repeat=r, summary=s))
            print(f"{name:40s} C={c}: {s.get('completion_tokens_per_s')} tok/s, errors {s.get('errors')}", flush=True)
    finally:
        stop_all(procs)
    from specrt.runtime.machine import machine_record

    result = dict(
        command=" ".join(["python -m specrt.bench.load_vs_llama_server", *sys.argv[1:]]),
        specrt_commit=source_commit(),
        llama_cpp=llama_version(a.llama_server),
        machine=machine_record(),
        load_average_after=os.getloadavg(),
        **summarize(runs, a.levels, specrt, llama, baseline),
        runs=runs,
    )
    write_json(a.out, result)
    print(json.dumps({k: result[k] for k in ("completion_tokens_per_s", "specrt_ratios")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
