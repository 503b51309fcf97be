"""Benchmark worker: specrt (onnxruntime, IO-bound KV), target-only or speculative.

Runs in the main venv. Besides ``run`` it answers three analysis operations, used by
``specrt.bench.compare`` on its target-only worker:

- ``sweep``: ``specrt.runtime.lab.bench.run_bench`` over k_max x threshold (interleaved with
  target-only inside this process): acceptance rate, speedup, accepted-length histograms;
- ``costs``: per-call latency of the draft (q=1) and the target (q=1..k_max+1, each as the
  decode loop calls it) at a fixed past length: ``specrt.runtime.costs.measure_call_times``;
- ``profile``: the speculative loop under cProfile, time split into onnxruntime's
  ``run_with_iobinding``, binding, numpy and the rest (Python).

``--pyspy SETTINGS.json`` runs the speculative loop once, standalone, for py-spy to sample
(see ``pyspy_breakdown``), and exits.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

try:  # imported as specrt.bench.workers.specrt_worker (the harness, the tests)
    from ._protocol import error_text, serve, set_thread_env
except ImportError:  # run as a file by a venv's python: Python puts this folder first on sys.path
    from _protocol import error_text, serve, set_thread_env


def _load(init: dict):
    set_thread_env(int(init["threads"]))
    from specrt import Engine
    from specrt.runtime.backends.base import ThreadConfig

    # prefix cache off: every request of the bench runs cold, as the other runtimes' rows do
    tc = ThreadConfig(intra_op=int(init["threads"]), spinning=bool(init.get("spinning", False)))
    return Engine(init["engines"], threads=tc, prefix_cache=False, backend=init.get("backend"))  # backend None: the folder's choice


def _config(init: dict, max_new_tokens: int):
    from specrt import GenerationConfig

    v = init["variant"]
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        k_max=v.get("k_max"),
        threshold=v.get("threshold"),
        speculative=bool(v["speculative"]),
        exact_widths=bool(v.get("exact_widths", True)),  # False: target-only at its fastest (1-row) width
        drafter=v.get("drafter"),
        adaptive=v.get("adaptive"),
    )


def setup(init: dict):
    """The protocol's setup: load the engine of ``init`` with its variant's settings and warm up; returns (generate, info, extra ops: sweep, costs, profile)."""
    import numpy as np
    import onnxruntime as ort

    from specrt import GenerationConfig

    t0 = time.perf_counter()
    engine = _load(init)
    load_s = time.perf_counter() - t0
    clock = time.perf_counter
    cfg0 = engine.resolve(_config(init, 8))
    for ids in init.get("warmup", [])[:2]:
        engine.generate(ids, cfg0)

    def run(ids, max_new_tokens):
        cfg = _config(init, max_new_tokens)
        t = clock()
        res = engine.generate(ids, cfg)
        seconds = clock() - t
        s = res.stats
        extra = dict(
            proposed=s.proposed,
            accepted=s.accepted,
            passes=s.passes,
            draft_calls=s.draft_calls,
            hist=list(s.accepted_hist),
            draft_seconds=s.draft_seconds,
            target_seconds=s.target_seconds,
            prefill_seconds=s.prefill_seconds,
            loop_seconds=s.total_seconds,
        )
        return res.tokens, seconds, s.ttft_seconds, extra

    def sweep(msg):
        from specrt.runtime.lab.bench import BenchConfig, run_bench

        n = int(msg["max_new_tokens"])
        configs = [BenchConfig("target-only", GenerationConfig(max_new_tokens=n, speculative=False))]
        for k in msg["k_values"]:
            for th in msg["thresholds"]:
                configs.append(BenchConfig(f"k={k} th={th:g}", engine.resolve(GenerationConfig(max_new_tokens=n, k_max=int(k), threshold=float(th)))))
        prompts = [{"prompt": ids} for ids in msg["prompts"]]
        res = run_bench(engine, prompts, configs, repeats=int(msg.get("repeats", 1)))
        return {"sweep": res}

    def costs(msg):
        from specrt.runtime.costs import measure_call_times

        m = engine.manifest
        widths = list(range(1, m.k_max + 2))
        past = max(m.min_q() - 1, 1, min(int(msg["past"]), m.max_ctx - max(widths) - 1))
        reps = int(msg.get("reps", 100))
        times = measure_call_times({"": engine}, widths, past, reps, warmup=5)
        rows = []
        for (_, who, q), x in times.items():
            x = x * 1000
            rows.append(dict(model=who, q=q, median_ms=float(np.median(x)), q25_ms=float(np.percentile(x, 25)), q75_ms=float(np.percentile(x, 75))))
        return {"costs": dict(past=past, reps=reps, threads=int(init["threads"]), rows=rows)}

    def profile(msg):
        return {"profile": cprofile_breakdown(engine, msg)}

    info = dict(
        system="specrt",
        backend=engine.backend,
        onnxruntime=ort.__version__,
        numpy=np.__version__,
        load_seconds=load_s,
        variant=init["variant"],
        resolved=dict(k_max=cfg0.k_max, threshold=cfg0.threshold, speculative=cfg0.speculative),
        manifest_defaults=engine.manifest.defaults,
        manifest_k_max=engine.manifest.k_max,
        threads=int(init["threads"]),
        spinning=bool(init.get("spinning", False)),
    )
    return run, info, {"sweep": sweep, "costs": costs, "profile": profile}


# ---- profiling -------------------------------------------------------------------------


def _category_cprofile(key) -> str:
    filename, _, name = key
    if "run_with_iobinding" in name:
        return "onnxruntime run_with_iobinding"
    if "bind_input" in name or "bind_output" in name or (filename.endswith("backends/ort.py") and name in ("bind_in", "bind_out")):
        return "binding (bind_input/bind_output)"
    if "numpy" in name or "/numpy/" in filename:
        return "numpy"
    return "Python (loop, bookkeeping, calls)"


def cprofile_breakdown(engine, msg: dict) -> dict:
    """Wall time of the speculative loop on the given prompts, then the same under cProfile,
    its own-time (tottime) split by category, and the top functions."""
    import cProfile
    import pstats

    from specrt import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=int(msg["max_new_tokens"]), k_max=msg.get("k_max"), threshold=msg.get("threshold"), speculative=True)
    prompts = msg["prompts"]
    engine.generate(prompts[0], cfg)  # warm
    clock = time.perf_counter
    t0 = clock()
    tokens = 0
    for ids in prompts:
        tokens += engine.generate(ids, cfg).stats.new_tokens
    wall = clock() - t0
    prof = cProfile.Profile()
    t0 = clock()
    prof.enable()
    for ids in prompts:
        engine.generate(ids, cfg)
    prof.disable()
    wall_prof = clock() - t0
    st = pstats.Stats(prof)
    cats: dict[str, float] = {}
    calls: dict[str, int] = {}
    total = 0.0
    top = []
    for key, (cc, nc, tt, ct, _) in st.stats.items():
        c = _category_cprofile(key)
        cats[c] = cats.get(c, 0.0) + tt
        calls[c] = calls.get(c, 0) + nc
        total += tt
        top.append((tt, nc, f"{Path(key[0]).name}:{key[1]}({key[2]})"))
    top.sort(reverse=True)
    return dict(
        tool="cProfile",
        config=dict(k_max=cfg.k_max, threshold=cfg.threshold, max_new_tokens=cfg.max_new_tokens),
        prompts=len(prompts),
        new_tokens=tokens,
        wall_seconds=wall,
        wall_seconds_profiled=wall_prof,
        profiled_total_tottime=total,
        categories={c: dict(seconds=s, share=s / total if total else None, calls=calls[c]) for c, s in sorted(cats.items(), key=lambda x: -x[1])},
        top=[dict(tottime=t, calls=n, function=f) for t, n, f in top[:15]],
        note="tottime shares from cProfile, which inflates Python-level costs (every Python call is instrumented); "
        "compare wall_seconds (no profiler) with wall_seconds_profiled, and see the py-spy breakdown (sampling, no such bias)",
    )


def _raw_run_line() -> int | None:
    """Line of ``raw_run(raw, None)`` in backends/ort.py (where run_with_iobinding is called)."""
    import specrt.runtime.backends.ort as ob

    for no, line in enumerate(Path(ob.__file__).read_text().splitlines(), 1):
        if "raw_run(raw, None)" in line:
            return no
    return None


_PY_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>.*\.py):(?P<line>\d+)\)$")
_NATIVE_FRAME = re.compile(r"^(?P<name>.*) \((?P<lib>[^()]*)\)$")
_SYNC = ("pthread_cond", "futex", "sched_yield", "__lll_lock", "pthread_mutex", "nanosleep", "syscall")


def _native_category(leaf: str) -> str:
    m = _NATIVE_FRAME.match(leaf)
    name, lib = (m["name"], m["lib"]) if m else (leaf, "")
    if "libc" in lib or "libpthread" in lib:
        if any(k in name for k in _SYNC):
            return "ort: thread hand-over (pthread_cond/futex: wake and wait for pool threads)"
        if name in ("malloc", "free", "calloc", "realloc") or "malloc" in name:
            return "ort: allocation (malloc/free)"
        return "ort: libc other (memcpy etc., unnamed)"
    if "onnxruntime" in lib:
        return "ort: kernels and executor (onnxruntime .so, stripped)"
    return f"ort: other native ({Path(lib).name or name})"


def pyspy_breakdown(raw_file: str, marker: str = "_profiled_section") -> dict:
    """Split py-spy raw (collapsed) stacks of the main thread.

    Only stacks inside ``marker`` count. The innermost Python frame decides the category:
    the line of backends/ort.py that calls ``run_with_iobinding`` = onnxruntime, the bind
    closures = binding, numpy / speculative.py = numpy, the rest = Python. With ``--native``
    stacks, time inside ``run_with_iobinding`` is split further by the innermost native
    frame: libc thread synchronisation (pthread_cond_signal/wait, futex: handing work to the
    intra-op pool and waiting for it), malloc/free, and onnxruntime's own code.
    """
    run_line = _raw_run_line()
    cats: dict[str, int] = {}
    lines_count: dict[str, int] = {}
    total = 0
    native = False
    for line in Path(raw_file).read_text().splitlines():
        if marker not in line:
            continue
        stack, _, n = line.rpartition(" ")
        try:
            n = int(n)
        except ValueError:
            continue
        frames = stack.split(";")
        py_idx = max((i for i, f in enumerate(frames) if _PY_FRAME.match(f)), default=None)
        if py_idx is None:
            continue
        m = _PY_FRAME.match(frames[py_idx])
        name, file, lno = m["name"], m["file"], int(m["line"])
        short = name.split(".")[-1]
        below = frames[py_idx + 1 :]
        native = native or bool(below)
        if file.endswith("backends/ort.py") and lno == run_line:
            c = _native_category(below[-1]) if below else "onnxruntime run_with_iobinding"
        elif file.endswith("backends/ort.py") and short in ("bind_in", "bind_out"):
            c = "binding (bind_input/bind_output)"
        elif "/numpy/" in file or any("numpy" in f for f in below[-1:]):
            c = "numpy"
        elif file.endswith("speculative.py"):
            c = "token selection (numpy calls in speculative.py)"
        else:
            c = "Python (loop, bookkeeping, calls)"
        cats[c] = cats.get(c, 0) + n
        key = f"{Path(file).name}:{lno} {name}"
        lines_count[key] = lines_count.get(key, 0) + n
        total += n
    top = sorted(lines_count.items(), key=lambda x: -x[1])[:15]
    ort = sum(v for k, v in cats.items() if k.startswith("ort") or k.startswith("onnxruntime"))
    return dict(
        tool="py-spy record --idle" + (" --native" if native else "") + " (sampling, main thread)",
        samples=total,
        categories={c: dict(samples=s, share=s / total if total else None) for c, s in sorted(cats.items(), key=lambda x: -x[1])},
        inside_run_with_iobinding_share=ort / total if total else None,
        top_python_lines=[dict(samples=s, share=s / total if total else None, line=k) for k, s in top],
        run_with_iobinding_line=run_line,
    )


def _profiled_section(engine, prompts, cfg) -> int:
    n = 0
    for ids in prompts:
        n += engine.generate(ids, cfg).stats.new_tokens
    return n


def pyspy_main(settings_file: str) -> int:
    """The ``--pyspy SETTINGS`` mode, run under py-spy: the speculative loop on the settings' prompts (repeated); writes the wall time and tokens to the settings' result file. Returns 0."""
    from specrt import GenerationConfig

    s = json.loads(Path(settings_file).read_text())
    engine = _load(s)
    cfg = GenerationConfig(max_new_tokens=int(s["max_new_tokens"]), k_max=s.get("k_max"), threshold=s.get("threshold"), speculative=True)
    for ids in s["prompts"][:1]:
        engine.generate(ids, cfg)
    t0 = time.perf_counter()
    n = _profiled_section(engine, s["prompts"] * int(s.get("repeats", 1)), cfg)
    wall = time.perf_counter() - t0
    Path(s["result"]).write_text(json.dumps(dict(wall_seconds=wall, new_tokens=n)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--pyspy":
        try:
            raise SystemExit(pyspy_main(sys.argv[2]))
        except Exception as e:  # noqa: BLE001
            print(error_text(e), file=sys.stderr)
            raise
    raise SystemExit(serve(setup))
