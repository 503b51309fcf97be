"""A trimmed draft vocabulary on the real pair: acceptance lost against draft cost saved.

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling", Sec. 3) keeps only the most frequent ids in the
draft's LM head; the draft proposes among them and the target verifies as always, so the
output is unchanged and only acceptance can drop. This script measures both sides for head
sizes N, without changing the engine:

- **acceptance**: the target's own greedy outputs on held-out prompts (completion and chat
  form, generated here with the engine, target-only), then the draft teacher-forced along
  each sequence; per position, does the draft's argmax (over all ids, or over the N kept ids)
  equal the target's token? That is greedy speculation's per-candidate acceptance test.
  Ids are ranked by their count on text the held-out prompts are not in: the stdlib files
  the quality record does not hold out, and the tuning HumanEval prompts (before ``--first``).
- **cost**: the draft graph with its ``lm_head`` MatMulNBits cut to the N kept rows (the
  same packed int4 blocks, scales and zero points, row-gathered), one-token calls after
  ``--past`` rows, every variant interleaved, medians.

Writes ``--out`` (JSON). Run on a quiet machine; the real pair needs ``make real-pair``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from specrt.bench.common import emit

ROOT = Path(__file__).resolve().parents[1]


def trimmed_draft(src: Path, keep: np.ndarray, dst: Path) -> None:
    """Write ``src`` (a builder draft graph) with its LM head cut to rows ``keep`` to ``dst``.

    The head is the MatMulNBits node whose output is ``logits``: ``qweight`` [N, blocks, blob],
    ``scales`` [N * blocks], ``qzeros`` [N * ceil(blocks / 2)] are row-gathered, ``N`` and the
    ``logits`` output's last dim set to ``len(keep)``.
    """
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(src))
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and "logits" in n.output)
    n_rows = next(a.i for a in head.attribute if a.name == "N")
    inits = {i.name: i for i in m.graph.initializer}
    for name in head.input[1:]:
        arr = numpy_helper.to_array(inits[name])
        rows = arr.reshape(n_rows, -1)[keep].reshape((len(keep),) + arr.shape[1:]) if arr.ndim > 1 else arr.reshape(n_rows, -1)[keep].reshape(-1)
        inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(rows), name))
    for a in head.attribute:
        if a.name == "N":
            a.i = len(keep)
    out = next(o for o in m.graph.output if o.name == "logits")
    out.type.tensor_type.shape.dim[-1].dim_value = len(keep)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst), save_as_external_data=True, location=dst.name + ".data")


def ranked_ids(tok, first: int, prompts: list[str], vocab: int, eos: set[int]) -> tuple[np.ndarray, int]:
    """(every id by descending count on the counting text, end ids first since they must stay
    proposable; the number of distinct ids counted)."""
    from specrt.runtime.lab.quality import HELDOUT_EVERY, stdlib_files

    counts: Counter = Counter()
    for i, p in enumerate(stdlib_files()):
        if i % HELDOUT_EVERY == 0:
            continue  # the quality record's held-out files
        try:
            counts.update(tok.encode(p.read_text(encoding="utf-8"), add_special_tokens=False).ids)
        except (UnicodeDecodeError, OSError):
            continue
    for p in prompts[:first]:
        counts.update(tok.encode(p, add_special_tokens=False).ids)
    order = [t for t in sorted(eos)] + [t for t, _ in counts.most_common() if t not in eos]
    seen = set(order)
    order += [t for t in range(vocab) if t not in seen]
    return np.asarray(order, dtype=np.int64), len(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--prompts", default="data/humaneval_dev.jsonl")
    ap.add_argument("--first", type=int, default=20, help="first held-out prompt (those before it are counted)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sizes", default="8192,16384,32768,65536")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default="docs/bench/real_pair/draft_vocab.json")
    a = ap.parse_args()

    from specrt import Engine, GenerationConfig
    from specrt.runtime.backends.base import ThreadConfig
    from specrt.runtime.backends.ort_gqa import OrtGqaModel

    eng_dir = ROOT / a.engines
    from specrt.bench.real import prompt_sets

    e = Engine(eng_dir, verify_hashes=False)
    man = e.manifest
    eos = set(man.stop_ids())
    lines = [json.loads(x)["prompt"] for x in (ROOT / a.prompts).read_text().splitlines()]
    order, counted = ranked_ids(e.codec.tokenizer, a.first, lines, man.vocab_size, eos)
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    sizes = [int(s) for s in a.sizes.split(",")]

    labels, ids = prompt_sets(eng_dir, ROOT / a.prompts, a.first, a.n)
    entry = man.draft
    threads = ThreadConfig().for_draft(entry.params)  # the engine's own draft threads
    draft = OrtGqaModel(eng_dir / entry.file, entry, max_ctx=2048, max_q=512, threads=threads)
    per_form: dict[str, dict] = {}
    for lab, p in zip(labels, ids):
        res = e.generate(p, GenerationConfig(max_new_tokens=a.max_new_tokens, speculative=False))
        out = list(res.tokens)
        seq = list(p) + out
        logits = np.concatenate([draft.run(seq[lo : lo + 512], lo).copy() for lo in range(0, len(seq) - 1, 512)])[: len(seq) - 1]
        rows = logits[len(p) - 1 : len(seq) - 1, : man.vocab_size]
        truth = np.asarray(out)
        form = lab.split()[0]
        d = per_form.setdefault(form, dict(positions=0, full=0, **{str(n): 0 for n in sizes}, target_in_kept={str(n): 0 for n in sizes}))
        d["positions"] += len(truth)
        d["full"] += int((rows.argmax(1) == truth).sum())
        for n in sizes:
            kept = order[:n]
            d[str(n)] += int((kept[rows[:, kept].argmax(1)] == truth).sum())
            d["target_in_kept"][str(n)] += int((rank[truth] < n).sum())
        print(f"{lab}: {len(truth)} tokens", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="dvtrim", dir=os.environ.get("TMPDIR", "/tmp")))
    models = {"full": draft}
    for n in sizes:
        path = tmp / str(n) / "draft.onnx"
        trimmed_draft(eng_dir / entry.file, order[:n], path)
        models[str(n)] = OrtGqaModel(path, dataclasses.replace(entry, vocab_size=n), max_ctx=2048, max_q=4, threads=threads)
    times: dict[str, list] = {k: [] for k in models}
    ctx = list(ids[0][: a.past])
    for m in models.values():
        for lo in range(0, len(ctx), 4):
            m.run(ctx[lo : lo + 4], lo)
    for _ in range(a.reps):
        for k, m in models.items():
            t0 = time.perf_counter()
            m.run([ctx[-1]], len(ctx))
            times[k].append((time.perf_counter() - t0) * 1e3)
    cost = {k: dict(median_ms=statistics.median(v), p10=float(np.percentile(v, 10)), p90=float(np.percentile(v, 90))) for k, v in times.items()}
    for path in tmp.rglob("*"):
        path.unlink() if path.is_file() else None

    result = dict(
        command="python scripts/draft_vocab_trim.py " + " ".join(sys.argv[1:]),
        engines=a.engines,
        counted_on=f"stdlib files not held out + HumanEval prompts 0..{a.first - 1}: {counted} distinct ids",
        heldout=f"HumanEval prompts {a.first}..{a.first + a.n - 1}, completion and chat form, {a.max_new_tokens} new tokens, target-only greedy",
        acceptance={
            f: {k: (v / d["positions"] if k not in ("positions", "target_in_kept") else v) for k, v in d.items()}
            | {"target_in_kept": {k: v / d["positions"] for k, v in d["target_in_kept"].items()}}
            for f, d in per_form.items()
        },
        draft_call_ms=cost,
        past=a.past,
        threads=dataclasses.asdict(threads),
        load=os.getloadavg(),
    )
    emit(result, a.out)


if __name__ == "__main__":
    main()
