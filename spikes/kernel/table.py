"""Markdown tables of a kernel-spike record: median ms per call (q1-q3) per shape, engine and
q, and the q-row / 1-row ratio. Usage: python spikes/kernel/table.py docs/bench/kernel_spike/<isa>.json [--cache cold]"""

from __future__ import annotations

import argparse
import json

ENGINES = ("kernel", "ggml-repack", "ggml", "ort")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("record")
    ap.add_argument("--cache", default="cold")
    ap.add_argument("--qs", default="1,2,3,4,5,6,7,8,9")
    ap.add_argument("--iqr", action="store_true", help="add the quartiles")
    a = ap.parse_args(argv)
    rec = json.load(open(a.record))
    qs = [int(q) for q in a.qs.split(",")]
    by = {(r["shape"], r["engine"], r["q"], r["cache"]): r for r in rec["rows"]}
    shapes = list(rec["shapes"])
    print(f"ms per call, median over {rec['reps']} interleaved repetitions, cache {a.cache}; (ratio to the same engine's q=1)\n")
    print("| shape | engine | " + " | ".join(f"q={q}" for q in qs) + " |")
    print("|---|---|" + "---:|" * len(qs))
    for s in shapes:
        for e in ENGINES:
            if (s, e, 1, a.cache) not in by:
                continue
            base = by[(s, e, 1, a.cache)]["median_ms"]
            cells = []
            for q in qs:
                r = by.get((s, e, q, a.cache))
                if r is None:
                    cells.append("")
                    continue
                c = f"{r['median_ms']:.2f}"
                if a.iqr:
                    c += f" ({r['q1_ms']:.2f}-{r['q3_ms']:.2f})"
                if q > 1:
                    c += f" ({r['median_ms'] / base:.2f}x)"
                cells.append(c)
            print(f"| {s} | {e} | " + " | ".join(cells) + " |")
    noop = [by.get(("(none)", "ort-noop", q, a.cache)) for q in qs]
    if all(noop):
        print("\nonnxruntime Python run() overhead (Identity session), ms: " + ", ".join(f"q={q} {r['median_ms']:.3f}" for q, r in zip(qs, noop)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
