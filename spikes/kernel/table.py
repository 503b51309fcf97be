"""Markdown tables of a kernel-spike record: median ms per call (q1-q3) per shape, engine and
q, and the q-row / 1-row ratio; with ``--step``, the decode-step estimate of
docs/results/kernel-spike.md (a sum of isolated calls over one target forward, not a
measurement). Usage: python spikes/kernel/table.py docs/bench/kernel_spike/<isa>.json [--cache cold] [--step]"""

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
    ap.add_argument("--step", action="store_true", help="also the per-forward estimate (28 layers + lm_head)")
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
    if a.step:
        step_table(by, qs, a.cache)
    return 0


def step_table(by: dict, qs: list[int], cache: str, layers: int = 28) -> None:
    """Print ms per target forward, estimated from isolated calls: ``layers`` x (2 attn_q-sized
    [attn_q, attn_output] + 2 gate-sized [gate, up] + 1 ffn_down, half the layers Q4_K and half
    Q6_K) and the lm_head; k/v projections (~2% of the weights), attention and the rest left
    out. ggml: the repack buffer for Q4_K (llama.cpp's default), the plain one for Q6_K (no
    x86 repack). onnxruntime: minus its Python run() cost per call (the Identity session);
    its lm_head is not in the record, so its column and the others' are also given without it."""
    aq, gate, d4, d6, head = (
        "attn_q (Q4_K 1536x1536)",
        "ffn_gate (Q4_K 8960x1536)",
        "ffn_down (Q4_K 1536x8960)",
        "ffn_down (Q6_K 1536x8960)",
        "lm_head (Q6_K 151936x1536)",
    )

    def ms(shape, engine, q):
        r = by.get((shape, engine, q, cache))
        return None if r is None else r["median_ms"]

    def body(e4, e6, q, minus=0.0):
        parts = [ms(aq, e4, q), ms(gate, e4, q), ms(d4, e4, q), ms(d6, e6, q)]
        if None in parts:
            return None
        a_, g, x4, x6 = (v - minus for v in parts)
        return layers * (2 * a_ + 2 * g + (x4 + x6) / 2)

    print(f"\nEstimated ms per target forward ({layers} layers; cache {cache}); (ratio to q=1)\n")
    print("| q | kernel | kernel w/o lm_head | ggml w/o lm_head | ggml | ort w/o lm_head (minus run() cost) |")
    print("|---:|---:|---:|---:|---:|---:|")
    base = {}
    for q in qs:
        noop = ms("(none)", "ort-noop", q) or 0.0
        cols = [
            ("k", body("kernel", "kernel", q), ms(head, "kernel", q)),
            ("g", body("ggml-repack", "ggml", q), ms(head, "ggml", q)),
            ("o", body("ort", "ort", q, noop), None),
        ]
        cells = []
        for key, b, h in cols:
            vals = [b + h if (b is not None and h is not None) else None, b] if key != "o" else [b]
            for i, v in enumerate(vals):
                tag = f"{key}{i}"
                base.setdefault(tag, v)
                cells.append("-" if v is None else (f"{v:.0f}" + (f" ({v / base[tag]:.2f}x)" if q > 1 and base[tag] else "")))
        k_full, k_body, g_full, g_body, o_body = cells
        print(f"| {q} | {k_full} | {k_body} | {g_body} | {g_full} | {o_body} |")


if __name__ == "__main__":
    raise SystemExit(main())
