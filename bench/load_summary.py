"""Summarize repeated ``specrt.bench.load`` runs: per configuration (the file name after the
``r<k>_`` prefix) the median and range of completion tokens/s and of TTFT p50 over the
repetitions, and per repetition the ratios of a batched run to the one-client run of the
same repetition (runs of one repetition were made back to back, so they saw similar load).

    python -m specrt.bench.load_summary docs/bench/load_batching/reps --base c1_workers1 \\
        --out docs/bench/load_batching/summary.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from specrt.bench.common import emit


def main(argv=None) -> dict:
    """Print (and write with --out) the summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--base", default="c1_workers1", help="the one-client configuration the ratios divide by")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    runs: dict[str, dict[int, dict]] = {}
    for p in sorted(Path(a.folder).glob("r*_*.json")):
        m = re.match(r"r(\d+)_(.+)\.json$", p.name)
        if m:
            runs.setdefault(m.group(2), {})[int(m.group(1))] = json.loads(p.read_text())
    out: dict = {"folder": a.folder, "base": a.base, "configs": {}}
    base = runs.get(a.base, {})
    for name, reps in sorted(runs.items()):
        tps = [r["completion_tokens_per_s"] for r in reps.values()]
        ttft = [r["ttft_s"]["p50"] for r in reps.values() if r.get("ttft_s")]
        rec = dict(
            repetitions=len(reps),
            tokens_per_s=dict(median=statistics.median(tps), min=min(tps), max=max(tps)),
            ttft_p50_s=dict(median=statistics.median(ttft), min=min(ttft), max=max(ttft)) if ttft else None,
            load_avg_1m=[x for r in reps.values() for x in r.get("load_avg_1m", [])],
            mean_batch_size=[r["batching"]["mean_batch_size"] for r in reps.values() if r.get("batching")] or None,
        )
        if name != a.base and base:
            tr = [reps[k]["completion_tokens_per_s"] / base[k]["completion_tokens_per_s"] for k in sorted(reps) if k in base]
            fr = [reps[k]["ttft_s"]["p50"] / base[k]["ttft_s"]["p50"] for k in sorted(reps) if k in base and reps[k].get("ttft_s")]
            rec["throughput_ratio_to_base"] = dict(per_rep=[round(x, 3) for x in tr], median=round(statistics.median(tr), 3)) if tr else None
            rec["ttft_p50_ratio_to_base"] = dict(per_rep=[round(x, 3) for x in fr], median=round(statistics.median(fr), 3)) if fr else None
        out["configs"][name] = rec
    return emit(out, a.out)


if __name__ == "__main__":
    main()
