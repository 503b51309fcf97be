"""Compare the greedy response texts of ``specrt.bench.load`` runs (``--save-texts``) with a
reference run (one client, one worker): request i's prompt is ``prompts[i % n_prompts]``,
so every response is compared with the reference's response to the same prompt.

    python -m specrt.bench.compare_load_texts docs/bench/load_batching/c1_workers1.json \\
        docs/bench/load_batching/c8_*.json --out docs/bench/load_batching/texts_compared.json
"""

from __future__ import annotations

import argparse
import json

from specrt.bench.common import emit


def main(argv=None) -> dict:
    """Print (and write with --out) per run: responses equal to the reference, and the
    prompt numbers whose responses differ."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--prompts", type=int, default=10, help="built-in prompts of specrt.bench.load")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    with open(a.reference) as f:
        ref = {int(i) % a.prompts: t for i, t in json.load(f)["texts"].items()}
    out = {"reference": a.reference, "runs": {}}
    for path in a.runs:
        with open(path) as f:
            texts = json.load(f)["texts"]
        diff = sorted({int(i) % a.prompts for i, t in texts.items() if ref.get(int(i) % a.prompts) != t})
        out["runs"][path] = dict(equal=sum(ref.get(int(i) % a.prompts) == t for i, t in texts.items()), responses=len(texts), prompts_differing=diff)
    return emit(out, a.out)


if __name__ == "__main__":
    main()
