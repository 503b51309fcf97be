#!/usr/bin/env python
"""The batch scheduler's policies side by side, in process: N requests queued at once on a
``BatchPool`` of N slots over an engine folder, for each N and each ``--batch-policy``
(``auto``, ``speculate``, ``batched``), one after the other; tokens per second from the
submission to the last result (prefills included), the iterations of each mode, and whether
every output equals the first policy's (on specrt's kernels every policy is exact).

    python -m specrt.bench.batch_policies --engines engines/qwen2.5-coder --sizes 1,2,4,8 \\
        --max-tokens 96 --out docs/bench/real_pair/batching_kernels_2026-12-05/policies.json
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from specrt.bench.common import command, say_machine, write_json

PROMPTS = [
    "def quicksort(arr):\n",
    "class LinkedList:\n    def __init__(self):\n",
    'def parse_csv(path):\n    """Read a CSV file',
    "import json\n\ndef load_config(path):\n",
    "def is_prime(n):\n",
    "def merge_sorted(a, b):\n",
    "def flatten(xs):\n",
    "def word_count(text):\n",
]


def run_pool(engine, n: int, policy: str, max_tokens: int) -> dict:
    """One pool of ``n`` slots, ``n`` requests queued together; returns tok/s, steps, tokens."""
    from specrt import GenerationConfig
    from specrt.runtime.serve.batching import BatchPool
    from specrt.runtime.serve.jobs import Job

    pool = BatchPool(engine, n, policy=policy)
    done, results = threading.Event(), {}

    def emit(i):
        def f(ev):
            if ev[0] in ("done", "cancelled", "error"):
                results[i] = ev
                if len(results) == n:
                    done.set()

        return f

    try:
        jobs = [
            Job(
                ids=engine.prompt_ids(PROMPTS[i % len(PROMPTS)]), config=engine.resolve(GenerationConfig(max_new_tokens=max_tokens)), emit=emit(i), stream=False
            )
            for i in range(n)
        ]
        t0 = time.perf_counter()
        pool.submit_all(jobs)
        if not done.wait(900):
            raise SystemExit(f"{policy} x {n}: not done in 900 s")
        dt = time.perf_counter() - t0
        outs = [results[i][1].tokens for i in range(n)]
        return dict(
            size=n, policy=policy, seconds=round(dt, 3), tokens=sum(map(len, outs)), tok_s=round(sum(map(len, outs)) / dt, 2), steps=pool.steps, outputs=outs
        )
    finally:
        pool.close()


def main(argv=None) -> int:
    """Run every size and policy; print one line each; write the JSON. Returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--policies", default="auto,speculate,batched")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from specrt import Engine
    from specrt.runtime.machine import this_machine

    say_machine()
    engine = Engine(a.engines)
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        first = None
        for policy in a.policies.split(","):
            r = run_pool(engine, n, policy, a.max_tokens)
            first = first or r["outputs"]
            r["equal_to_first_policy"] = r["outputs"] == first
            rows.append(r)
            print(f"{n} rows {policy:9s} {r['tok_s']:8.2f} tok/s  steps {r['steps']}  equal {r['equal_to_first_policy']}", flush=True)
    write_json(
        a.out,
        dict(
            command=command(),
            backend=engine.backend,
            machine=this_machine().to_json(),
            load_average_after=os.getloadavg(),
            rows=[{k: v for k, v in r.items() if k != "outputs"} for r in rows],
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
