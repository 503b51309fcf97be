"""Compare the greedy response texts of load_test.py runs (``--save-texts``) with a
reference run (one client, one worker): request i's prompt is ``prompts[i % n_prompts]``,
so every response is compared with the reference's response to the same prompt.

    python scripts/compare_load_texts.py docs/bench/load_batching/c1_workers1.json \\
        docs/bench/load_batching/c8_*.json --out docs/bench/load_batching/texts_compared.json
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> dict:
    """Print (and write with --out) per run: responses equal to the reference, and the
    prompt numbers whose responses differ."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--prompts", type=int, default=10, help="built-in prompts of load_test.py")
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
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
