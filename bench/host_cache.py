"""Six 3-turn chats on 2 slots, with and without the host prompt cache (issue 53 item 5):
how much of its previous prompt each follow-up reuses, and whether every output equals a
cold Engine's (tokens and logprobs; one chat seeded-sampled).

Each turn's six requests are queued together on a pool of 2 workers (or 2 ``--max-batch``
slots, policy speculate); the next turn (the previous prompt, the reply and the next HumanEval
prompt) once all six are answered. Without the host cache a follow-up gets its history only
when a free slot still holds it; with it (``--cache-ram``), every history a request
overwrote comes back from host RAM.

    python -m specrt.bench.host_cache --out docs/bench/host_cache/RUN.json    # the real pair from its GGUF files
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specrt.runtime.machine import machine_record

from .common import command, emit, say_machine

ROOT = Path(__file__).resolve().parents[1]
GGUF_CACHE = Path.home() / ".cache" / "specrt" / "gguf"


def six_chats(engine, kind: str, cache_ram_mib: int, cold, max_tokens: int) -> list[dict]:
    """Run the six chats on a new pool over ``engine``; per follow-up: chat, turn, rows
    reused, previous prompt's length, equal to ``cold`` (tokens and logprobs)."""
    from specrt import GenerationConfig
    from specrt.runtime.serve.jobs import Job, WorkerPool

    cfgs = [GenerationConfig(max_new_tokens=max_tokens, **kw) for kw in ({}, dict(logprobs=2), dict(temperature=0.8, seed=5), {}, {}, {})]
    prompts = [json.loads(x)["prompt"] for x in (ROOT / "data" / "humaneval_dev.jsonl").read_text().splitlines()[:24]]
    if kind == "workers":
        pool = WorkerPool([engine, engine.fork()], cache_ram_mib=cache_ram_mib)
    else:
        from specrt.runtime.serve.batching import BatchPool

        pool = BatchPool(engine, 2, policy="speculate", cache_ram_mib=cache_ram_mib)
    texts = [prompts[i] for i in range(6)]
    prev: list = [None] * 6
    out = []
    try:
        for turn in range(3):
            ids = [engine.prompt_ids(t) for t in texts]
            evs = [_Events() for _ in texts]
            pool.submit_all([Job(ids=i, config=engine.resolve(c), emit=ev) for i, c, ev in zip(ids, cfgs, evs)])
            for c, ev in enumerate(evs):
                r = ev.result(1800)
                ref = cold.generate(ids[c], cfgs[c])
                if prev[c] is not None:
                    out.append(
                        dict(chat=c, turn=turn, reused=r.stats.cached_tokens, previous=prev[c], equal=r.tokens == ref.tokens and r.logprobs == ref.logprobs)
                    )
                prev[c] = len(ids[c])
                texts[c] += r.text + "\n\n" + prompts[6 * (turn + 1) + c]
            while pool.busy or pool.queued:
                time.sleep(0.01)
    finally:
        pool.close()
    return out


class _Events:
    """A job's ``emit``: keeps the last event; ``done`` set by the final one."""

    def __init__(self):
        import threading

        self.done, self.last = threading.Event(), None

    def __call__(self, ev):
        self.last = ev
        if ev[0] in ("done", "cancelled", "error"):
            self.done.set()

    def result(self, timeout: float):
        """The generation's result.

        Raises:
            RuntimeError: no result within ``timeout`` seconds, or the job ended otherwise."""
        if not self.done.wait(timeout) or self.last[0] != "done":
            raise RuntimeError(f"the job ended with {self.last}")
        return self.last[1]


def main(argv=None) -> dict:
    """Run both pools with and without the host cache; returns (and writes to ``--out``) the record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default=None, help="an engine folder (default: the real pair from its GGUF files)")
    ap.add_argument("--target", default=str(GGUF_CACHE / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--draft", default=str(GGUF_CACHE / "qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--kinds", default="workers,max-batch")
    ap.add_argument("--cache-ram", type=int, default=512, help="MiB for the runs with the host cache")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from specrt import Engine

    say_machine()
    start = machine_record()
    if a.engines is None:
        from specrt.export.gguf_engine import engine_for

        folder = engine_for(a.target, a.draft, log=lambda *x: None)
    else:
        folder = Path(a.engines)
    cold = Engine(folder, prefix_cache=False)
    runs = {}
    for kind in a.kinds.split(","):
        for mib in (0, a.cache_ram):
            t0 = time.perf_counter()
            follow = six_chats(Engine(folder), kind, mib, cold, a.max_tokens)
            frac = [f["reused"] / f["previous"] for f in follow]
            runs[f"{kind}, cache_ram {mib}"] = dict(
                seconds=round(time.perf_counter() - t0, 1),
                follow_ups=len(follow),
                equal_to_cold=sum(f["equal"] for f in follow),
                reused_over_previous_median=round(statistics.median(frac), 3),
                reused_over_previous_min=round(min(frac), 3),
                follow=follow,
            )
            print(kind, mib, json.dumps({k: v for k, v in runs[f"{kind}, cache_ram {mib}"].items() if k != "follow"}), flush=True)
    return emit(dict(command=command(), date=time.strftime("%Y-%m-%d %H:%M UTC"), machine=start, engines=str(folder), runs=runs), a.out, hide=("follow",))


if __name__ == "__main__":
    main()
