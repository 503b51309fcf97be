"""Greedy outputs under continuous batching vs the same requests served one at a time.

All requests are submitted at once to an in-process
:class:`~specrt.runtime.serve.batching.BatchPool` (so they queue, join between rounds and
share batched steps), then each is generated alone with ``Engine.generate``. Reports, per
policy, the requests whose tokens differ and, for each, the first differing position and
the target's top-2 logit margin there (:func:`specrt.runtime.lab.bench.divergences`): a
batched step's rows differ from batch-1 rows by the kernels' rounding (docs/guide/serving.md),
so a divergence is expected only where the margin is of that order.

    python scripts/batch_equality.py --engines engines/default --requests 24 \\
        --out docs/bench/batch_equality.json
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from specrt import Engine, GenerationConfig
from specrt.bench.common import emit
from specrt.bench.load import PROMPTS as LOAD_PROMPTS  # the same built-in prompts as the load runs (specrt.bench.load)
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.lab.bench import divergences
from specrt.runtime.serve.batching import BatchPool
from specrt.runtime.serve.jobs import Job


def run_pool(eng: Engine, pool: BatchPool, ids: list, cfg) -> list:
    """Submit every request at once; return each one's GenerationResult."""
    results: list = [None] * len(ids)
    done = [threading.Event() for _ in ids]

    def emitter(i):
        def emit(ev):
            if ev[0] in ("done", "error", "cancelled"):
                results[i] = ev[1]
                done[i].set()

        return emit

    for i, x in enumerate(ids):
        pool.submit(Job(ids=x, config=cfg, emit=emitter(i)))
    for d in done:
        d.wait(600)
    return results


def main(argv=None) -> dict:
    """Run and print (and write with --out) the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policies", default="auto,batched,speculate")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    eng = Engine(a.engines, threads=ThreadConfig(a.threads))
    prompts = list(LOAD_PROMPTS)
    with open("data/humaneval_dev.jsonl") as f:
        prompts += [json.loads(line)["prompt"] for line in f]
    prompts = prompts[: a.requests]
    ids = [eng.prompt_ids(p) for p in prompts]
    cfg = eng.resolve(GenerationConfig(max_new_tokens=a.max_tokens))
    alone = {i: eng.generate(x, cfg).tokens for i, x in enumerate(ids)}
    rec = dict(engines=a.engines, requests=len(ids), max_batch=a.max_batch, max_tokens=a.max_tokens, threads=a.threads, policies={})
    for policy in a.policies.split(","):
        pool = BatchPool(eng.fork(), a.max_batch, max_queue=len(ids) + 1, policy=policy)
        t0 = time.perf_counter()
        res = run_pool(eng, pool, ids, cfg)
        wall = time.perf_counter() - t0
        pool.close()
        got = {i: r.tokens for i, r in enumerate(res)}
        divs = divergences(eng, ids, alone, got)
        rec["policies"][policy] = dict(
            equal=sum(got[i] == alone[i] for i in got),
            divergences=divs,
            max_divergence_margin=max((d["target_top2_margin"] for d in divs if d["target_top2_margin"] is not None), default=None),
            iterations=dict(pool.steps),
            mean_batch_size=round(pool.metrics.value("specrt_batch_size_sum") / n, 3) if (n := pool.metrics.value("specrt_batch_size_count")) else None,
            wall_s=round(wall, 3),
            tokens_per_s=round(sum(len(t) for t in got.values()) / wall, 1),
        )
    rec["load_avg_1m"] = os.getloadavg()[0]
    return emit(rec, a.out)


if __name__ == "__main__":
    main()
