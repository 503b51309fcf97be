#!/usr/bin/env python
"""Engine load + first token of ``specrt generate`` for several engine folders, interleaved.

Each round runs ``specrt generate --engines F --prompt P --max-new-tokens 32`` once per
folder (order alternating between rounds, so a noisy moment hits every folder alike) and
reads ``load_plus_ttft_s`` (engine load with the integrity checks + prefill + first token;
Python start-up and imports not included) from its statistics line; the process wall time is
recorded beside it. Medians per folder.

    python -m specrt.bench.load_ttft --engines before=engines/fp32 --engines after=engines/default \
        --rounds 7 --out docs/bench/load_ttft_flavors.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from specrt.bench.common import write_json


def main(argv=None) -> int:
    """Run the rounds, print the medians per folder, write the JSON to ``--out``. Returns 0.

    Raises:
        SystemExit: a ``specrt generate`` run failed.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", action="append", required=True, help="LABEL=FOLDER (repeatable)")
    ap.add_argument("--prompt", default="def fib(n):")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    folders = dict(e.split("=", 1) for e in a.engines)
    specrt = shutil.which("specrt") or os.path.join(os.path.dirname(sys.executable), "specrt")
    names = list(folders)
    ttft: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            p = subprocess.run([specrt, "generate", "--engines", folders[n], "--prompt", a.prompt, "--max-new-tokens", "32"], capture_output=True, text=True)
            wall[n].append(time.perf_counter() - t0)
            if p.returncode:
                raise SystemExit(f"{n}: specrt generate failed: {p.stderr.strip().splitlines()[-1:]}")
            stats = json.loads([line for line in p.stderr.splitlines() if line.strip().startswith("{")][-1])
            ttft[n].append(stats["load_plus_ttft_s"])
    out = {
        "command": " ".join(["python -m specrt.bench.load_ttft", *(f"--engines {e}" for e in a.engines), f"--rounds {a.rounds}"]),
        "load_average_after": os.getloadavg(),
        "rows": {
            n: {"folder": folders[n], "load_plus_ttft_s": ttft[n], "median": statistics.median(ttft[n]), "process_wall_s_median": statistics.median(wall[n])}
            for n in names
        },
    }
    for n in names:
        print(f"{n:20s} load+first token median {out['rows'][n]['median']:.3f} s  (process wall {out['rows'][n]['process_wall_s_median']:.2f} s)")
    if a.out:
        write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
