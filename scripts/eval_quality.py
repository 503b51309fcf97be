"""Quality of engine flavors against an fp32 engine folder, without torch.

For each ``--engines`` folder, its target against the ``--reference`` folder's target (the
fp32 standard graph, equal to the PyTorch model to ~1e-5), teacher-forced on two sets
(:mod:`specrt.runtime.lab.quality`):

* the held-out stdlib text of the default pair's training split (64 windows x 256 tokens,
  reproduced from this interpreter's stdlib as ``scripts/train_default_pair.py`` makes it);
* HumanEval outputs: every prompt of ``--prompts`` followed by the reference's own greedy
  continuation (``--new-tokens``), the continuation's positions scored.

Figures per flavor and set: top-1 agreement with the reference's argmax, loss (nats/token)
of both, its change; and whether the bounds of ``specrt.export.quality.QUALITY_BOUNDS``
hold. ``--write`` stores the record as ``extra["quality"]`` in each flavor's manifest.

    python scripts/eval_quality.py --reference engines/default_fp32 --engines engines/default \\
        --engines engines/int8 --out docs/bench/quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from specrt import Engine, GenerationConfig
from specrt.bench.common import write_json
from specrt.runtime.lab.quality import compare, encode_texts, heldout_windows, score_model, stdlib_heldout_texts

QUALITY_BOUNDS = {"min_top1_agreement": 0.95, "max_loss_delta": 0.05}  # = specrt.export.quality (that module needs torch)


def _holds(rec: dict) -> bool:
    sets = [rec[k] for k in ("heldout_stdlib", "humaneval")]
    return all(s["top1_agreement"] >= QUALITY_BOUNDS["min_top1_agreement"] and s["loss_delta"] <= QUALITY_BOUNDS["max_loss_delta"] for s in sets)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="fp32 engine folder (standard graphs)")
    ap.add_argument("--engines", action="append", required=True, help="engine folder to score (repeatable)")
    ap.add_argument("--prompts", default="data/humaneval_dev.jsonl")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts (default: all)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--write", action="store_true", help="store each flavor's record as extra['quality'] in its manifest")
    ap.add_argument("--out", default=None, help="JSON results")
    a = ap.parse_args(argv)
    t0 = time.time()
    ref = Engine(a.reference)
    m = ref.manifest
    vocab = m.vocab_size
    # held-out windows (tokenized with the reference's tokenizer, EOS after each file)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(a.reference) / m.tokenizer_file))
    texts = stdlib_heldout_texts()
    data = encode_texts(lambda t: tok.encode(t, add_special_tokens=False).ids, texts, m.eos_token_id)
    wins = heldout_windows(data, a.windows, min(a.window, m.max_ctx - 1)).tolist()
    # HumanEval: prompt + the reference's greedy continuation (target-only)
    prompts = [json.loads(x)["prompt"] for x in Path(a.prompts).read_text().splitlines() if x.strip()][: a.limit]
    seqs, firsts = [], []
    for p in prompts:
        ids = ref.prompt_ids(p)[: m.max_ctx - a.new_tokens - 1]
        out = ref.generate(ids, GenerationConfig(max_new_tokens=a.new_tokens, speculative=False)).tokens
        seqs.append(ids + out)
        firsts.append(len(ids) - 1)
    print(
        f"sets: {len(wins)} held-out windows ({len(texts)} files, {len(data)} tokens), {len(seqs)} HumanEval outputs ({time.time() - t0:.0f} s)",
        file=sys.stderr,
    )
    ref_h = score_model(ref.target, wins, [0] * len(wins), vocab, m.min_q())
    ref_e = score_model(ref.target, seqs, firsts, vocab, m.min_q())
    result = dict(
        reference=str(a.reference),
        command=" ".join(["python"] + sys.argv),
        heldout=dict(files=len(texts), tokens=int(len(data)), windows=len(wins), window=len(wins[0]) - 1),
        humaneval=dict(prompts=len(seqs), new_tokens=a.new_tokens, file=a.prompts),
        bounds=QUALITY_BOUNDS,
        loadavg=os.getloadavg(),
        flavors={},
    )
    for folder in a.engines:
        e = Engine(folder)
        mm = e.manifest
        rec = dict(
            reference=f"fp32 engine folder {a.reference} (scripts/eval_quality.py)",
            bounds=QUALITY_BOUNDS,
            precision=mm.precision,
            target_graph=mm.target.graph,
            heldout_stdlib=dict(compare(ref_h, score_model(e.target, wins, [0] * len(wins), vocab, mm.min_q())), windows=len(wins)),
            humaneval=dict(compare(ref_e, score_model(e.target, seqs, firsts, vocab, mm.min_q())), prompts=len(seqs), new_tokens=a.new_tokens),
        )
        rec["holds"] = _holds(rec)
        result["flavors"][folder] = rec
        h, he = rec["heldout_stdlib"], rec["humaneval"]
        print(
            f"{folder:<28} {mm.precision:<5} held-out: agree {h['top1_agreement']:.4f} loss {h['loss']:.4f} (fp32 {h['loss_reference']:.4f}) | "
            f"HumanEval: agree {he['top1_agreement']:.4f} loss {he['loss']:.4f} (fp32 {he['loss_reference']:.4f}) | holds {rec['holds']}"
        )
        if a.write:
            from specrt.runtime.manifest import write_defaults

            write_defaults(folder, {}, {"quality": rec})
        e.close()
    result["seconds"] = round(time.time() - t0, 1)
    if a.out:
        write_json(a.out, result, default=float)
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
