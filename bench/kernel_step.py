"""The exact target step at every verification width, and prefill, on specrt's kernels, on the
folder's ONNX graph and on llama.cpp, in one interleaved, repeated run.

Per round, in an order rotated each round:

* specrt kernels: the target's ``run`` at q = 1..9 (``--widths N``: 1..N) after ``--past`` rows (10 timed calls each,
  after one warm-up), and a prefill of each ``--prefill`` length (the decode loop's 256-row
  chunks, only the last row projected).
* specrt's ONNX graph (``backend="ort-cpu"``): the same; a q-row call runs ``max(q,
  exact_min_q)`` rows, as its exact decode loop does; skipped for a folder built from GGUF files
  alone (no graph).
* llama.cpp: ``llama-bench -m TARGET.gguf -p 1,..,N -n 64 -d PAST -t T -r 3`` (its 1..N-token
  calls at that depth, and its decode step, tg) and ``-p PREFILL`` at depth 0.

Medians over rounds of each round's median, with the spread (min, max) of the round medians;
ratios are formed within the run. The record names the machine (CPU model, ISA flags) and the
load average before and after.

    python -m specrt.bench.kernel_step --engines engines/qwen2.5-coder \\
        --llama-bench /path/to/llama-bench --out docs/bench/real_pair/kernel_step_<cpu>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from specrt.bench.common import say_machine, source_commit, write_json
from specrt.runtime.machine import machine_record

WIDTHS = tuple(range(1, 10))


def time_calls(model, q: int, start: int, reps: int, call=None) -> float:
    """Median ms of ``reps`` calls of ``q`` rows at ``start`` (one warm-up); ``call(tokens,
    start)`` is ``model.run`` unless given (e.g. the reduced head's ``run_argmax``)."""
    call = call or model.run
    toks = [101 + i for i in range(q)]
    call(toks, start)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call(toks, start)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def prefill_ms(engine, n: int) -> float:
    """ms to prefill ``n`` prompt tokens the way the decode loop does (chunks of the target's
    widest call from position 0, only the last row projected where the model can)."""
    from specrt.runtime.backends.base import run_tail
    from specrt.runtime.chunks import chunk_bounds

    toks = [(17 * i) % 5000 + 100 for i in range(n)]
    bounds = list(chunk_bounds(n, engine.target.max_q, engine.min_q, 0))
    t0 = time.perf_counter()
    for i, (a, b) in enumerate(bounds):
        run_tail(engine.target, toks[a:b], a, 1 if i == len(bounds) - 1 else 0)
    return (time.perf_counter() - t0) * 1e3


def specrt_round(engine, past: int, reps: int, prefills: list[int], widths=WIDTHS) -> dict:
    """One round of one specrt path: ms per call by width, and ms per prefill length."""
    from specrt.runtime.chunks import feed

    q_min = engine.min_q
    feed(engine.target, [(13 * i) % 5000 + 100 for i in range(past)], 0)
    calls = {q: time_calls(engine.target, max(q, q_min), past - max(0, q_min - q), reps) for q in widths}
    return dict(calls_ms=calls, prefill_ms={n: prefill_ms(engine, n) for n in prefills})


def llama_round(bench: str, gguf: str, past: int, threads: int, prefills: list[int], widths=WIDTHS) -> dict:
    """One round of llama-bench: ms per call of each width's tokens at depth ``past``, ms per decoded
    token (tg64 at that depth), ms per prefill (depth 0)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(bench).parent))

    def run(args: list[str]) -> list[dict]:
        out = subprocess.run([bench, "-m", gguf, "-t", str(threads), "-r", "3", "-o", "json", *args], capture_output=True, text=True, env=env, check=True)
        return json.loads(out.stdout)

    rows = run(["-p", ",".join(map(str, widths)), "-n", "64", "-d", str(past)])
    calls = {r["n_prompt"]: 1e3 * r["n_prompt"] / r["avg_ts"] for r in rows if r["n_prompt"]}
    tg = next(1e3 / r["avg_ts"] for r in rows if r["n_gen"])
    pre = run(["-p", ",".join(map(str, prefills)), "-n", "0"]) if prefills else []
    return dict(calls_ms=calls, decode_ms=tg, prefill_ms={r["n_prompt"]: 1e3 * r["n_prompt"] / r["avg_ts"] for r in pre})


def llama_version(bench: str) -> str:
    """llama-bench's ``--version`` line (llama.cpp's version and commit)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(bench).parent))
    out = subprocess.run([bench, "--version"], capture_output=True, text=True, env=env)
    return (out.stdout + out.stderr).strip().splitlines()[0]


def summarize(rounds: list[dict]) -> dict:
    """Median over rounds (and min/max of the round medians) of every figure."""

    def agg(get) -> dict:
        xs = [get(r) for r in rounds]
        return dict(median=round(statistics.median(xs), 2), min=round(min(xs), 2), max=round(max(xs), 2))

    out: dict = {}
    for sys_ in ("kernels", "onnx", "llama.cpp"):
        if sys_ not in rounds[0]:
            continue
        first = rounds[0][sys_]
        out[sys_] = dict(
            calls_ms={str(q): agg(lambda r, q=q: r[sys_]["calls_ms"][q]) for q in first["calls_ms"]},
            prefill_ms={str(n): agg(lambda r, n=n: r[sys_]["prefill_ms"][n]) for n in first["prefill_ms"]},
        )
        if "decode_ms" in first:
            out[sys_]["decode_ms"] = agg(lambda r: r[sys_]["decode_ms"])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench (built from the same source as the Makefile's llama-server)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", default="1024,2048", help="prompt lengths to prefill (comma-separated)")
    ap.add_argument("--widths", type=int, default=9, help="time calls of 1..N rows")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    widths = tuple(range(1, a.widths + 1))
    from specrt import Engine
    from specrt.runtime.backends.base import ThreadConfig
    from specrt.runtime.manifest import load_manifest

    say_machine()
    m = load_manifest(a.engines, verify_hashes=False)
    if not (m.extra.get("gguf") or {}).get("target"):  # llama.cpp's side needs the target's GGUF file
        raise SystemExit(f"kernel_step: {a.engines} was not exported from a GGUF target (no extra.gguf.target); it compares with llama.cpp on that file")
    gguf = str(Path(os.environ.get("SPECRT_GGUF_CACHE") or Path.home() / ".cache/specrt/gguf") / m.extra["gguf"]["target"]["file"])
    prefills = [int(x) for x in a.prefill.split(",") if x.strip()]
    tc = ThreadConfig(intra_op=a.threads)
    engines = {"kernels": Engine(a.engines, threads=tc, backend="kernels", prefix_cache=False)}
    if not m.kernels_only():  # a folder built from GGUF files alone has no ONNX graph to time
        engines["onnx"] = Engine(a.engines, threads=tc, backend="ort-cpu", prefix_cache=False)
    load0 = os.getloadavg()
    rounds = []
    for i in range(a.rounds):
        systems = [*engines, "llama.cpp"]
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        r = {}
        for sys_ in order:
            if sys_ == "llama.cpp":
                if a.llama_bench:
                    r[sys_] = llama_round(a.llama_bench, gguf, a.past, a.threads, prefills, widths)
            else:
                r[sys_] = specrt_round(engines[sys_], a.past, a.reps, prefills, widths)
        rounds.append(r)
        print(f"round {i + 1}/{a.rounds}: " + json.dumps({s: {q: round(v, 1) for q, v in r[s]["calls_ms"].items()} for s in r}), flush=True)
    rec = dict(
        what="exact target step by width (ms per call), decode step, prefill; specrt kernels vs its ONNX graph (where the folder has one) vs llama.cpp",
        engines=str(a.engines),
        gguf=gguf,
        isa=engines["kernels"].target.isa,
        specrt_commit=source_commit(),
        llama_cpp=llama_version(a.llama_bench) if a.llama_bench else None,
        onnx_exact_min_q=engines["onnx"].min_q if "onnx" in engines else None,
        threads=a.threads,
        past=a.past,
        reps=a.reps,
        rounds=a.rounds,
        machine=machine_record(),
        loadavg_end=list(os.getloadavg()),
        loadavg_before=list(load0),
        summary=summarize(rounds),
        raw=rounds,
    )
    if a.out:
        write_json(Path(a.out), rec)
    print(json.dumps(rec["summary"], indent=1))
    return rec


if __name__ == "__main__":
    main()
