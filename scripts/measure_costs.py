"""Measure per-call latency of an engine folder's draft and target on onnxruntime.

Interleaved (A B A B ...) and repeated; reports medians and quartiles in milliseconds for
decode (q=1) and verification widths q=1..k_max+1 at a fixed past length, per thread
setting. Used to pick the default thread settings and to check the draft/target cost
ratio of the default pair.

    python scripts/measure_costs.py --engines engines/default --past 200 --reps 200
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from specrt.runtime.backends.ort import OrtModel, ThreadConfig
from specrt.runtime.manifest import load_manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", default="1,2", help="comma list of intra-op thread counts")
    ap.add_argument("--spinning", default="0,1", help="comma list of spinning settings (0/1)")
    ap.add_argument("--widths", default="1,2,3,5,9", help="target q widths")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    m = load_manifest(a.engines)
    settings = [ThreadConfig(int(t), bool(int(s))) for t in a.threads.split(",") for s in a.spinning.split(",")]
    widths = [int(w) for w in a.widths.split(",")]
    cases = []
    for tc in settings:
        d = OrtModel(f"{a.engines}/{m.draft.file}", m.draft, m.max_ctx, 16, tc)
        t = OrtModel(f"{a.engines}/{m.target.file}", m.target, m.max_ctx, 16, tc)
        for mdl in (d, t):
            mdl.run([1] * 16, 0)
            for s in range(16, a.past, 16):
                mdl.run([1] * 16, s)
        cases.append((tc, "draft", 1, d))
        for w in widths:
            cases.append((tc, "target", w, t))
    times = {i: [] for i in range(len(cases))}
    rng = np.random.default_rng(0)
    for _ in range(a.reps):
        for i in rng.permutation(len(cases)):
            tc, who, q, mdl = cases[i]
            t0 = time.perf_counter()
            mdl.run([5] * q, a.past)
            times[i].append(time.perf_counter() - t0)
    rows = []
    for i, (tc, who, q, _) in enumerate(cases):
        x = np.array(times[i]) * 1000
        rows.append(
            dict(
                threads=tc.intra_op,
                spinning=tc.spinning,
                model=who,
                q=q,
                median_ms=float(np.median(x)),
                q25_ms=float(np.percentile(x, 25)),
                q75_ms=float(np.percentile(x, 75)),
            )
        )
        print(
            f"threads={tc.intra_op} spin={int(tc.spinning)} {who:<6} q={q:<2} median {np.median(x):7.3f} ms  [{np.percentile(x, 25):.3f}, {np.percentile(x, 75):.3f}]"
        )
    for tc in settings:
        d = [r for r in rows if r["threads"] == tc.intra_op and r["spinning"] == tc.spinning]
        dm = next(r["median_ms"] for r in d if r["model"] == "draft")
        tm = next(r["median_ms"] for r in d if r["model"] == "target" and r["q"] == 1)
        print(f"threads={tc.intra_op} spin={int(tc.spinning)}: target(q=1)/draft(q=1) = {tm / dm:.2f}")
    if a.out:
        import os

        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(engines=a.engines, past=a.past, reps=a.reps, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
