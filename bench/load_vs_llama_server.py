#!/usr/bin/env python
"""Serving throughput at several concurrencies: ``specrt serve --max-batch N`` against llama.cpp's
``llama-server`` with N parallel slots on the same pair, interleaved (issue 17's anchor).

For each concurrency C (in the order given, and for each repeat) both systems take the same
bounded load run (``specrt.bench.load``: C client threads, ``max(16, 4 C)`` non-streamed
``/v1/completions`` requests of ``--max-tokens`` tokens, greedy, the built-in code prompts)
one after the other, alternating which goes first. specrt is started by the load run itself
(``--engines``); llama-server (built from llama-cpp-python's source package, ``make
bench-envs``) is started once here with ``-np N -c N*ctx --metrics`` on the target's GGUF
(Q4_0 from ``specrt.bench.compare``'s anchors) and reused. Output: one JSON with every
run's summary and the completion tokens/s per (system, concurrency).

    python -m specrt.bench.load_vs_llama_server --engines engines/default \\
        --gguf bench_out/compare/anchors/llamacpp/target-Q4_0.gguf \\
        --llama-server .venv-llamacpp/bin/llama-server --concurrency 1,4,8 --out docs/bench/load_vs_llama_server.json
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
from specrt.bench.servers import free_port


def start_llama_server(binary: str, gguf: str, slots: int, ctx: int, threads: int) -> tuple[subprocess.Popen, int]:
    """Start llama-server on loopback and wait until /health answers (at most 300 s)."""
    port = free_port()
    lib = str(Path(binary).resolve().parent.parent / "src" / "build" / "bin")
    env = dict(os.environ, LD_LIBRARY_PATH=lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    cmd = [binary, "-m", gguf, "-np", str(slots), "-c", str(slots * ctx), "-t", str(threads), "-tb", str(threads)]
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


def main(argv=None) -> int:
    """Start llama-server, run both systems at every concurrency (interleaved), stop it;
    write every run to ``--out`` and print the tok/s table. Returns 0.

    Raises:
        SystemExit: llama-server did not come up.
        subprocess.CalledProcessError: a load run failed.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--gguf", required=True, help="the target's GGUF for llama-server")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--slots", type=int, default=8, help="llama-server -np and specrt --max-batch")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    proc, port = start_llama_server(a.llama_server, a.gguf, a.slots, a.ctx, a.threads)
    systems = {
        f"specrt serve --max-batch {a.slots}": ["--engines", a.engines, "--max-batch", str(a.slots), "--threads", str(a.threads)],
        f"llama-server -np {a.slots}": ["--url", f"http://127.0.0.1:{port}"],
    }
    runs: list[dict] = []
    try:
        for r in range(a.repeats):
            for i, c in enumerate(levels):
                names = list(systems) if (r + i) % 2 == 0 else list(systems)[::-1]
                for name in names:
                    s = load_run(systems[name], c, a.max_tokens)
                    runs.append(dict(system=name, concurrency=c, repeat=r, summary=s))
                    print(f"{name:32s} C={c}: {s.get('completion_tokens_per_s')} tok/s, errors {s.get('errors')}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    table = {
        name: {
            str(c): statistics.median([x["summary"]["completion_tokens_per_s"] for x in runs if x["system"] == name and x["concurrency"] == c]) for c in levels
        }
        for name in systems
    }
    from specrt.runtime.machine import this_machine

    result = dict(
        command=" ".join(["python -m specrt.bench.load_vs_llama_server", *sys.argv[1:]]),
        specrt_commit=source_commit(),
        llama_cpp=llama_version(a.llama_server),
        machine=this_machine().to_json(),
        load_average_after=os.getloadavg(),
        completion_tokens_per_s=table,
        runs=runs,
    )
    write_json(a.out, result)
    print(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
