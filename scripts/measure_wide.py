"""Measure an exported engine's wide call widths and write the record into its manifest:
``specrt export`` does this itself (:func:`specrt.export.pipeline.measure_exactness`);
this brings an engine exported before it to the same record without re-exporting
(the real pair's export takes many minutes and gigabytes).

The record (``target.exactness["wide"]``, :func:`specrt.runtime.lab.exactness.measure_wide`)
says which call widths above the decode loop's (``k_max + 2`` up to the prefill's widest
call) give the rows of ``k_max + 1``-row calls; with it the prefix cache reuses every
committed row, not only whole aligned prefill calls (:mod:`specrt.runtime.prefix`, "Any
layout"). The manifest's file hashes do not cover ``manifest.json`` itself, so the engine
stays loadable; a copy of the record is also written to ``--out`` when given.

    python scripts/measure_wide.py engines/qwen2.5-coder --out docs/bench/real_pair/wide_widths.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Measure, write the manifest (unless ``--dry-run``) and print the note; returns 0.

    Raises:
        SystemExit: the folder has no manifest, or its target has no measured exact width.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--out", type=Path, help="also write the record (with the machine) here")
    ap.add_argument("--dry-run", action="store_true", help="measure and print; leave the manifest alone")
    a = ap.parse_args(argv)
    from specrt.runtime.lab.exactness import measure_wide_engine
    from specrt.runtime.machine import machine_record
    from specrt.runtime.manifest import load_manifest

    path = a.engine / "manifest.json"
    if not path.is_file():
        raise SystemExit(f"{a.engine}: no manifest.json; give an exported engine folder")
    m = load_manifest(a.engine, verify_hashes=False)
    if not m.target.exact_min_q:
        raise SystemExit(f"{a.engine}: its target has no bit-identical call width (exact_min_q); nothing wider can be")
    t0, last = time.perf_counter(), [0.0]

    def progress(done: int, total: int) -> None:
        if time.perf_counter() - last[0] > 10 or done == total:
            last[0] = time.perf_counter()
            print(f"  {done}/{total} widths, {last[0] - t0:.0f} s", file=sys.stderr, flush=True)

    rec = measure_wide_engine(a.engine, m.target, m.max_ctx, m.vocab_size, m.k_max + 1, progress=progress)
    print(rec["note"])
    if not a.dry_run:
        raw = json.loads(path.read_text())
        raw["target"].setdefault("exactness", {})["wide"] = rec
        path.write_text(json.dumps(raw, indent=2) + "\n")
        print(f"wrote target.exactness.wide into {path}")
    if a.out is not None:
        out = dict(rec, engine=str(a.engine), machine=machine_record(), seconds=round(time.perf_counter() - t0, 1), python=platform.python_version())
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
