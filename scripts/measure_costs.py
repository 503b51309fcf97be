"""Per-call latency of the draft and the target of one or more engine folders (flavors) on
onnxruntime CPU, at every width q = 1..k_max+1 and per thread count.

All cases (folder x model x threads x q) are interleaved: every repetition runs each case
once, in a fresh random order, so load changes on a shared machine land on all of them
alike; medians and quartiles in milliseconds. Each call reads ``--past`` KV rows and writes
q rows after them (what a verification pass does). Also per model: the Python + binding
cost of one call (the model's ``run`` with onnxruntime's run replaced by a no-op), in
microseconds, and the 1-min load average before and after.

    python scripts/measure_costs.py --engines engines/default_fp32 --engines engines/default \\
        --threads 1,2 --reps 60 --out docs/bench/costs_flavors.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from specrt.runtime.backends import cpu_model
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.manifest import load_manifest


def overhead_us(model, q: int, past: int, calls: int = 2000) -> float:
    """Median microseconds of ``model.run`` with onnxruntime's run swapped for a no-op
    (the Python and binding work per call)."""
    real = model._run
    model._run = lambda: None
    try:
        t = []
        for _ in range(calls):
            t0 = time.perf_counter()
            model.run([5] * q, past)
            t.append(time.perf_counter() - t0)
    finally:
        model._run = real
    return float(np.median(t) * 1e6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", action="append", default=None, help="engine folder (repeatable; default engines/default)")
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", default="1,2", help="comma list of intra-op thread counts (both models)")
    ap.add_argument("--k-max", type=int, default=None, help="widths 1..k_max+1 (default: each folder's manifest k_max)")
    ap.add_argument("--spinning", action="store_true", help="let idle pool threads spin (default off, as the runtime)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    folders = a.engines or ["engines/default"]
    threads = [int(t) for t in a.threads.split(",")]
    load0 = os.getloadavg()
    cases, models, rows_overhead = [], {}, []
    for f in folders:
        m = load_manifest(f)
        k = a.k_max or m.k_max
        widths = list(range(1, k + 2))
        for t in threads:
            for role, entry in (("draft", m.draft), ("target", m.target)):
                mdl = cpu_model(f, entry, m.max_ctx, max(16, k + 1), ThreadConfig(t, a.spinning, t))
                for s in range(0, a.past, 16):  # fill the past rows (values do not matter for timing)
                    mdl.run([1] * min(16, a.past - s), s)
                models[(f, role, t)] = mdl
                for q in widths:
                    cases.append((f, role, t, q))
                if t == threads[0]:
                    rows_overhead.append(
                        dict(
                            engines=f,
                            model=role,
                            graph=entry.graph,
                            precision=entry.precision,
                            q1_us=overhead_us(mdl, 1, a.past),
                            q9_us=overhead_us(mdl, 9, a.past),
                        )
                    )
    times = [[] for _ in cases]
    rng = np.random.default_rng(0)
    for c in cases:  # warm-up
        models[c[:3]].run([5] * c[3], a.past)
    for _ in range(a.reps):
        for i in rng.permutation(len(cases)):
            f, role, t, q = cases[i]
            mdl = models[(f, role, t)]
            t0 = time.perf_counter()
            mdl.run([5] * q, a.past)
            times[i].append(time.perf_counter() - t0)
    rows = []
    for (f, role, t, q), x in zip(cases, times):
        x = np.array(x) * 1000
        e = getattr(load_manifest(f, verify_hashes=False), role)
        rows.append(
            dict(
                engines=f,
                model=role,
                graph=e.graph,
                precision=e.precision,
                threads=t,
                q=q,
                median_ms=float(np.median(x)),
                q25_ms=float(np.percentile(x, 25)),
                q75_ms=float(np.percentile(x, 75)),
            )
        )
    load1 = os.getloadavg()
    for f in folders:
        for role in ("draft", "target"):
            for t in threads:
                rr = [r for r in rows if r["engines"] == f and r["model"] == role and r["threads"] == t]
                cells = " ".join(f"q{r['q']}={r['median_ms']:.2f}" for r in rr)
                print(f"{f:<26} {role:<6} {rr[0]['precision']:<5} {rr[0]['graph']:<8} t{t}: {cells}")
    for r in rows_overhead:
        print(f"python+binding per call {r['engines']:<26} {r['model']:<6}: q=1 {r['q1_us']:.1f} us, q=9 {r['q9_us']:.1f} us")
    print(f"load average (1, 5, 15 min): before {load0}, after {load1}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(
                dict(
                    command="python scripts/measure_costs.py " + " ".join(argv if argv is not None else os.sys.argv[1:]),
                    past=a.past,
                    reps=a.reps,
                    spinning=a.spinning,
                    loadavg_before=load0,
                    loadavg_after=load1,
                    cpus=os.cpu_count(),
                    rows=rows,
                    overhead=rows_overhead,
                ),
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
