"""Per-call latency of the draft and the target of one or more engine folders (flavors) on
onnxruntime CPU, at every width q = 1..k_max+1 and per thread count.

Timed by the library (:func:`specrt.runtime.costs.measure_call_times`, as the tuner and
adaptive k time them): all cases (folder x threads x model x q) interleaved, each
repetition in a fresh random order; the draft's q = 1 call, the target's calls as the
decode loop makes them; medians and quartiles in milliseconds. Each call reads ``--past``
KV rows. Also per model: the Python + binding cost of one call (the model's ``run`` with
onnxruntime's run replaced by a no-op), in microseconds, and the load average before and after.

    python scripts/measure_costs.py --engines engines/default_fp32 --engines engines/default \\
        --threads 1,2 --reps 60 --out docs/bench/costs_flavors.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from specrt import Engine
from specrt.bench.common import say_machine, write_json
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.costs import measure_call_times
from specrt.runtime.machine import machine_record


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
    ap.add_argument("--k-max", type=int, default=None, help="widths 1..k_max+1 (default: the smallest manifest k_max)")
    ap.add_argument("--spinning", action="store_true", help="let idle pool threads spin (default off, as the runtime)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    say_machine()  # every figure below holds on this kind of CPU
    folders = a.engines or ["engines/default"]
    threads = [int(t) for t in a.threads.split(",")]
    load0 = os.getloadavg()
    engines = {f"{f}|{t}": Engine(f, threads=ThreadConfig(t, a.spinning, t)) for f in folders for t in threads}
    k = a.k_max or min(e.manifest.k_max for e in engines.values())
    times = measure_call_times(engines, range(1, k + 2), a.past, a.reps)  # the library's timing: interleaved, as the decode loop calls
    rows = []
    for (label, role, q), x in times.items():
        f, t = label.rsplit("|", 1)
        e, x = getattr(engines[label].manifest, role), x * 1000
        rows.append(dict(engines=f, model=role, graph=e.graph, precision=e.precision, threads=int(t), q=q, median_ms=float(np.median(x))))
        rows[-1].update(q25_ms=float(np.percentile(x, 25)), q75_ms=float(np.percentile(x, 75)))
    overhead = [
        dict(engines=f, model=role, q1_us=overhead_us(getattr(engines[f"{f}|{threads[0]}"], role), 1, a.past)) for f in folders for role in ("draft", "target")
    ]
    load1 = os.getloadavg()
    for label in engines:
        for role in ("draft", "target"):
            cells = " ".join(f"q{r['q']}={r['median_ms']:.2f}" for r in rows if f"{r['engines']}|{r['threads']}" == label and r["model"] == role)
            print(f"{label:<30} {role:<6}: {cells}")
    for r in overhead:
        print(f"python+binding per call {r['engines']:<26} {r['model']:<6}: q=1 {r['q1_us']:.1f} us")
    print(f"load average (1, 5, 15 min): before {load0}, after {load1}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        command = "python scripts/measure_costs.py " + " ".join(argv if argv is not None else sys.argv[1:])
        rec = dict(
            command=command,
            machine=machine_record(),
            past=a.past,
            reps=a.reps,
            spinning=a.spinning,
            loadavg_before=load0,
            loadavg_after=load1,
            cpus=os.cpu_count(),
        )
        write_json(a.out, dict(rec, rows=rows, overhead=overhead))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
