"""The kernels' reduced LM heads against the full head, in one interleaved, repeated run.

Per repetition, in a fixed order, after ``--past`` rows of context:

* draft step, full head: ``draft.run([t], past)`` (the logits row, scattered out of a trimmed
  head into a vocabulary-wide row) and numpy's ``top1`` of it (token and confidence): what a
  greedy draft step cost before the reduced head;
* draft step, reduced head: ``draft.run_top1([t], past, vocab, 1.0)``, the same token
  (checked) and its confidence;
* target at q = 1 and q = 5, full head: ``target.run`` and numpy's argmax of each row; and
  reduced head: ``target.run_argmax`` (the same tokens, checked).

Medians with the interquartile range; the record names the machine and the load average
before and after. Both engines' models must run on specrt's kernels.

    python -m specrt.bench.reduced_heads --engines engines/qwen2.5-coder \\
        --out docs/bench/real_pair/reduced_heads_<date>.json
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from specrt.bench.common import command, say_machine, write_json
from specrt.runtime.machine import machine_record


def stats(ms: list[float]) -> dict:
    """Median and quartiles of ``ms`` (milliseconds), rounded to µs."""
    q25, med, q75 = np.percentile(ms, [25, 50, 75])
    return {"median": round(float(med), 3), "q25": round(float(q25), 3), "q75": round(float(q75), 3), "n": len(ms)}


def measure(engines: str, past: int, reps: int) -> tuple[dict, str]:
    """``({case: [ms, ...]}, the kernels' ISA path)`` of the run described in the module
    docstring (``SPECRT_KERNELS_ISA`` picks a slower path).

    Raises:
        SystemExit: a model of the folder does not run on the kernels.
    """
    from specrt import Engine
    from specrt.runtime.backends.base import DraftsTop1, reduces_head
    from specrt.runtime.speculative import top1

    e = Engine(engines)
    d, t, vocab = e.draft, e.target, e.manifest.vocab_size
    if not isinstance(d, DraftsTop1) or not reduces_head(t):
        raise SystemExit(f"{engines}: both models must run on specrt's kernels (backend {e.backend})")
    toks = [int(x) for x in np.random.default_rng(0).integers(100, 5000, past + 64)]
    d.run_rows(toks[:past], 0, past)
    t.run_rows(toks[:past], 0, past)
    scratch = np.empty(d.vocab, np.float32)
    clock, out = time.perf_counter, {}

    def rec(case: str, t0: float) -> None:
        out.setdefault(case, []).append((clock() - t0) * 1e3)

    for i in range(reps + 2):  # the first two: warm-up, dropped below
        x = toks[past + i % 64]
        t0 = clock()
        want = top1(d.run([x], past)[-1], vocab, scratch, 1.0)
        rec("draft step, full head + numpy top1", t0)
        t0 = clock()
        got = d.run_top1([x], past, vocab, 1.0)
        rec("draft step, reduced head (run_top1)", t0)
        assert got[0] == want[0] and abs(got[1] - want[1]) <= 2e-5 * want[1], (got, want)
        for q in (1, 5):
            t0 = clock()
            full = [int(np.argmax(r[:vocab])) for r in t.run(toks[past : past + q], past)]
            rec(f"target q={q}, full head + numpy argmax", t0)
            t0 = clock()
            ids = t.run_argmax(toks[past : past + q], past, vocab)
            rec(f"target q={q}, argmax head (run_argmax)", t0)
            assert list(ids) == full
    return {k: v[2:] for k, v in out.items()}, t.isa


def main(argv=None) -> int:
    """Run, print a table, write the JSON record. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--past", type=int, default=256, help="KV rows before every timed call")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default="bench_out/reduced_heads.json")
    a = ap.parse_args(argv)
    say_machine()
    load0 = os.getloadavg()
    times, isa = measure(a.engines, a.past, a.reps)
    summary = {k: stats(v) for k, v in times.items()}
    for k, v in summary.items():
        print(f"{k:42s} {v['median']:8.3f} ms  [{v['q25']:.3f}, {v['q75']:.3f}]")
    draft = summary["draft step, reduced head (run_top1)"]["median"]
    target = summary["target q=1, argmax head (run_argmax)"]["median"]
    print(f"draft step / target 1-row step: {draft / target:.3f} (kernels' {isa} path)")
    rec = dict(
        what="reduced LM heads (sk_step_argmax) vs full heads: draft step and target steps, ms per call",
        command=command(),
        engines=a.engines,
        past=a.past,
        reps=a.reps,
        machine=machine_record(),
        isa=isa,
        loadavg_before=load0,
        loadavg_after=os.getloadavg(),
        summary=summary,
        draft_over_target_1row=round(draft / target, 4),
        ms=times,
    )
    write_json(a.out, rec)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
