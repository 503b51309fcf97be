"""Pick the prompts of a pool on which the draft model agrees least with its target.

Each prompt runs speculative decoding at k 4, threshold 0, fixed k (every step drafted), the
model drafter, 64 greedy tokens, prefix cache off; its acceptance is accepted / proposed
candidates. The ``--n`` lowest are written to ``--out`` in pool order, and every prompt's
figures to ``--record``. How ``data/adversarial_draft.jsonl`` was made (data/README.md)::

    python scripts/pick_adversarial.py --engines engines/qwen2.5-coder --pool data/adversarial_pool.jsonl \\
        --out data/adversarial_draft.jsonl --record docs/bench/real_pair/adversarial_draft_selection_2026-12-05.json
"""

from __future__ import annotations

import argparse
import json

from specrt import Engine, GenerationConfig
from specrt.runtime.lab.bench import load_prompts, prompt_tokens


def main(argv=None) -> int:
    """Measure, pick, write. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--pool", default="data/adversarial_pool.jsonl")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--record", required=True)
    a = ap.parse_args(argv)
    e = Engine(a.engines, prefix_cache=False)
    cfg = GenerationConfig(max_new_tokens=64, k_max=4, threshold=0.0, adaptive=False, drafter="model")
    rows = []
    for i, p in enumerate(load_prompts(a.pool)):
        st = e.generate(prompt_tokens(e, p), cfg).stats
        rows.append(dict(index=i, acceptance=round(st.accepted / max(1, st.proposed), 4), proposed=st.proposed, new_tokens=st.new_tokens, prompt=p))
        print(i, f"{rows[-1]['acceptance']:.3f}", json.dumps(p, ensure_ascii=False)[:70], flush=True)
    pick = sorted(sorted(rows, key=lambda x: x["acceptance"])[: a.n], key=lambda x: x["index"])
    rec = dict(pool=a.pool, config="k 4, threshold 0, fixed k, model drafter, 64 greedy tokens", rows=rows, picked=[x["index"] for x in pick])
    with open(a.record, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1, ensure_ascii=False)
    with open(a.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(x["prompt"], ensure_ascii=False) + "\n" for x in pick)
    print("picked", [(x["index"], x["acceptance"]) for x in pick])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
