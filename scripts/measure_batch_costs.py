"""Costs behind the batch scheduler's load-aware rule (runtime/serve/batching.py): seconds of
one batched target step (q = 1 per row) at each batch size n = 1..--max-batch, and of one
speculative round of a request alone (draft + batch-1 verification), with its tokens per
round, so tokens per second of both modes can be compared per batch size.

    python scripts/measure_batch_costs.py --engines engines/default --max-batch 8 \\
        --out docs/bench/batch_costs.json
"""

from __future__ import annotations

import argparse
import os
import time

from specrt import Engine, GenerationConfig
from specrt.bench.common import emit
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.backends.ort_gqa_batch import BatchedGqaModel
from specrt.runtime.costs import measure_step_costs

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Foo:", "import os\nimport sys\n", "def fib(n):", "while True:"]


def main(argv=None) -> dict:
    """Measure and print (and write with --out) the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--past", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    eng = Engine(a.engines, threads=ThreadConfig(a.threads))
    load0 = os.getloadavg()[0]
    b = BatchedGqaModel(eng.target, a.max_batch, eng.target.max_q)
    steps = measure_step_costs(b, length=a.past, reps=a.reps, vocab=eng.manifest.vocab_size)
    rounds = {}
    for k in (0, 1, 2, 3, 4):
        tok = sec = passes = 0.0
        for p in PROMPTS:
            r = eng.generate(p, GenerationConfig(max_new_tokens=a.new_tokens, k_max=max(k, 1), speculative=k > 0))
            st = r.stats
            tok += st.new_tokens - 1
            sec += st.total_seconds - st.prefill_seconds
            passes += st.passes
        rounds[f"k{k}" if k else "target_only"] = dict(seconds_per_round=sec / passes, tokens_per_round=tok / passes, tokens_per_second=tok / sec)
    best = max(v["tokens_per_second"] for v in rounds.values())
    by_n = {
        n: dict(step_s=s, batched_tokens_per_second=n / s, speculative_tokens_per_second=best, choice="batched" if n >= 2 and n / s > best else "speculate")
        for n, s in enumerate(steps.step_s)
        if n
    }
    rec = dict(
        engines=a.engines,
        threads=a.threads,
        past=a.past,
        batched_step=by_n,
        speculative_round=rounds,
        load_avg_1min=[load0, os.getloadavg()[0]],
        note="step_s: median seconds of one batched q=1 target call over n rows (random KV at past length --past); speculative rounds: a request alone, greedy, mean over prompts (prefill excluded); choice: the load-aware rule's pick when every row speculates at the best k",
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    return emit(rec, a.out)


if __name__ == "__main__":
    main()
