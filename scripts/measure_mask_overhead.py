"""What the grammar mask costs per token on text that looks unconstrained: a JSON schema
with one free string field (the model writes prose or code inside it), speculative decoding
at the engine's defaults.

Two measurements, interleaved and repeated:

1. **In the loop**: every method of the constrained acceptor that is not the inner
   acceptor's own work (mask computation in llguidance, the penalty row, the masked copy of
   each row, the matcher's consume/rollback, forced tokens) is timed with
   ``time.perf_counter``; overhead = that time / the generation's total time.
2. **End to end, same tokens**: a constraint that allows every token (regex ``(.|\\n)*``)
   gives exactly the unconstrained output, so the time difference of the two runs is
   the whole cost of running a matcher and masking every row.

    python scripts/measure_mask_overhead.py --engines engines/qwen2.5-coder --out docs/bench/real_pair/structured/mask_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from specrt import Engine, GenerationConfig
from specrt.bench.common import command, emit
from specrt.runtime.chat import engine_chat_ids
from specrt.runtime.constraints import ConstrainedAcceptor, Constraint

ASKS = [
    "Explain in detail how Python's garbage collector handles reference cycles.",
    "Write a long docstring for a function that merges two sorted lists, with examples.",
    "Describe step by step how to set up a CI pipeline for a Python package.",
    "Explain the difference between threads and processes in Python, with code.",
]
FREE_STRING = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False}
TIMED = ("_penalty", "_row", "_settle", "forced", "forced_at", "valid_prefix")


class Clock:
    """Wraps the constrained acceptor's own methods with a shared accumulator (nested calls
    counted once)."""

    def __init__(self):
        self.seconds, self.depth, self.saved = 0.0, 0, {}

    def __enter__(self):
        for name in TIMED:
            fn = getattr(ConstrainedAcceptor, name)
            self.saved[name] = fn
            setattr(ConstrainedAcceptor, name, self._wrap(fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(ConstrainedAcceptor, name, fn)

    def _wrap(self, fn):
        def timed(*a, **k):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - t0

        return timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_out/mask_overhead.json")
    a = ap.parse_args(argv)
    eng = Engine(a.engines)
    eng.grammar_tokenizer()
    free_string, allow_all = Constraint.json_schema(FREE_STRING), Constraint.regex(r"(.|\n)*")
    rows = []
    for rep in range(a.repeats):
        for ask in ASKS:
            ids = engine_chat_ids(eng, [{"role": "user", "content": ask + " Answer as JSON with one field, answer."}])
            cfg = GenerationConfig(max_new_tokens=a.max_new_tokens)
            with Clock() as clock:
                t0 = time.perf_counter()
                r = eng.generate(ids, GenerationConfig(max_new_tokens=a.max_new_tokens, constraint=free_string))
                total = time.perf_counter() - t0
            t0 = time.perf_counter()
            plain = eng.generate(ids, cfg)
            t_plain = time.perf_counter() - t0
            t0 = time.perf_counter()
            same = eng.generate(ids, GenerationConfig(max_new_tokens=a.max_new_tokens, constraint=allow_all))
            t_all = time.perf_counter() - t0
            assert same.tokens == plain.tokens, "a constraint that allows everything changed the output"
            rows.append(
                dict(
                    repeat=rep,
                    ask=ask[:40],
                    tokens=len(r.tokens),
                    forced=r.stats.forced,
                    seconds=total,
                    constraint_seconds=clock.seconds,
                    in_loop_overhead=clock.seconds / total,
                    ms_per_token=1e3 * clock.seconds / len(r.tokens),
                    plain_tokens=len(plain.tokens),
                    plain_seconds=t_plain,
                    allow_all_seconds=t_all,
                    end_to_end_overhead=t_all / t_plain - 1.0,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    out = dict(
        command=command(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        loadavg=os.getloadavg(),
        in_loop_overhead_median=med("in_loop_overhead"),
        ms_per_token_median=med("ms_per_token"),
        end_to_end_overhead_median=med("end_to_end_overhead"),
        end_to_end_overhead_q=statistics.quantiles([r["end_to_end_overhead"] for r in rows], n=4),
        rows=rows,
    )
    emit(out, a.out, hide=("rows",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
