#!/usr/bin/env python3
"""Throughput of N threads over one engine folder: one shared Engine (its lock serialises
the calls), one ``Engine.fork()`` per thread (shared sessions, own KV buffers), and one
thread alone; whether every thread's outputs equal the sequential ones is reported
(tests/test_hardening.py asserts it).

Usage::

    python scripts/measure_concurrency.py --engines /tmp/sizes/engine --threads 2 --intra-op 1

Prints one JSON object (tokens/s per arrangement, extra memory per fork).
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--threads", type=int, default=2, help="concurrent generator threads")
    ap.add_argument("--intra-op", type=int, default=1, help="onnxruntime intra-op threads per session")
    ap.add_argument("--jobs", type=int, default=8, help="generations per thread")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    from specrt import Engine, GenerationConfig
    from specrt.runtime.backends.ort import ThreadConfig

    engine = Engine(args.engines, threads=ThreadConfig(intra_op=args.intra_op))
    prompts = ["def add(a, b):", "for i in range(10):\n", "class Foo:\n", "import os\n"]
    cfgs = [GenerationConfig(max_new_tokens=args.max_new_tokens), GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.8, seed=1)]
    jobs = [(prompts[j % len(prompts)], cfgs[j % 2]) for j in range(args.jobs)]
    want = [engine.generate(p, c).tokens for p, c in jobs]  # also warms up

    equal = {}  # reported, not asserted: tests/test_hardening.py::test_threads_give_the_same_outputs_as_sequential_runs asserts it

    def run(engines):
        got = {}

        def work(t):
            for j, (p, c) in enumerate(jobs):
                got[t, j] = engines[t].generate(p, c).tokens

        ths = [threading.Thread(target=work, args=(t,)) for t in range(len(engines))]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        dt = time.perf_counter() - t0
        equal[len(engines), engines[0] is engines[-1]] = all(got[t, j] == want[j] for t in range(len(engines)) for j in range(len(jobs)))
        return sum(len(v) for v in got.values()) / dt

    n = args.threads
    k = engine.target
    fork_bytes = sum(a.nbytes for m in (engine.target, engine.draft) for a in (*m.keys, *m.values, m.logits))
    report = {
        "engines": args.engines,
        "threads": n,
        "intra_op": args.intra_op,
        "one_thread_tok_s": round(run([engine]), 1),
        "shared_engine_tok_s": round(run([engine] * n), 1),
        "forks_tok_s": round(run([engine.fork() for _ in range(n)]), 1),
        "fork_buffer_mib": round(fork_bytes / 2**20, 2),
        "max_ctx": k.max_ctx,
        "outputs_equal_sequential": all(equal.values()),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
