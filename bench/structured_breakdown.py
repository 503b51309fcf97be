"""Where a constrained greedy token's time goes on the real pair (specrt's kernels): the
grammar's mask, the masking of rows, the model calls, the prefill and the rest of the host's
work, per output token; constrained verification reading full logits rows masked in numpy
(the rule before, ``Plan.argmax`` off under a constraint) against the reduced head with
penalty rows (``ConstrainedAcceptor.penalties``), target-only and speculative, and the same
prompts without a constraint; one interleaved run in one process.

Each mode runs the JSON tasks of ``data/structured_tasks.jsonl`` (chat template, greedy,
256 tokens at most, ``Constraint.json_schema``). The constrained outputs of all four modes
are asserted equal. Times are the outermost calls of each kind (a model method calling
another counts once; the prefill's calls count as the prefill); ``host_other`` is the rest
of the wall time (drafting logic, acceptance, matcher, text).

    python -m specrt.bench.structured_breakdown --tasks 3 --repeats 2 --out docs/bench/structured_breakdown/zen3.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from specrt.bench.common import GGUF_CACHE, command, say_machine, write_json
from specrt.runtime.machine import machine_record

ROOT = Path(__file__).resolve().parents[1]
_T: defaultdict = defaultdict(float)
_DEPTH = [0]


def _timed(f, key: str):
    """``f`` counting its time under ``key`` when it is the outermost timed call."""

    def w(*a, **k):
        _DEPTH[0] += 1
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0 or key == "prefill":
                _T[key] += time.perf_counter() - t

    return w


def _instrument(eng) -> None:
    """Time the engine's model calls, its prefill and the constraint's mask work."""
    import specrt.runtime.generation as gen
    from specrt.runtime.constraints import ConstrainedAcceptor as CA

    for m, role in ((eng.target, "target"), (eng.draft, "draft")):
        for name in ("run", "run_argmax", "run_top1", "run_rows"):
            if hasattr(m, name):
                setattr(m, name, _timed(getattr(m, name), f"{role}_call"))
    gen.prefill = _timed(gen.prefill, "prefill")
    CA._penalty = _timed(CA._penalty, "mask")
    CA._row = _timed(CA._row, "mask_add")


def main(argv=None) -> dict:
    """Run the breakdown; returns (and writes to ``--out``) the record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(GGUF_CACHE / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--draft", default=str(GGUF_CACHE / "qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--tasks", type=int, default=3, help="the first N json tasks")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import specrt.runtime.engine as E
    from specrt import Engine, GenerationConfig
    from specrt.export.gguf_engine import engine_for
    from specrt.runtime.backends.base import reduces_head
    from specrt.runtime.chat import chat_ids, load_chat_template, normalize_messages
    from specrt.runtime.constraints import Constraint

    say_machine()
    start = machine_record()
    folder = engine_for(a.target, a.draft, log=lambda *x: None)
    eng = Engine(folder)
    _instrument(eng)
    reduced = E.argmax_only

    def full_rows(cfg, target, observe):  # the rule before: constrained greedy read whole rows
        return cfg.temperature == 0.0 and cfg.logprobs is None and cfg.constraint is None and not cfg.logit_bias and not observe and reduces_head(target)

    tpl = load_chat_template(folder / "chat_template.jinja")
    tasks = [t for t in map(json.loads, (ROOT / "data" / "structured_tasks.jsonl").read_text().splitlines()) if t["kind"] == "json"][: a.tasks]
    modes = [("full rows", full_rows, True), ("reduced rows", reduced, True), ("free", reduced, False)]
    runs: dict = defaultdict(list)
    want = None
    for rep in range(a.repeats):
        for spec in (False, True):
            for name, rule, constrained in modes:
                E.argmax_only = rule
                key = f"{'speculative' if spec else 'target-only'}, {name}"
                _T.clear()
                n, wall, outs = 0, 0.0, []
                for t in tasks:
                    ids = chat_ids(tpl, eng.codec, normalize_messages(t["messages"]))
                    c = Constraint.json_schema(t["schema"]) if constrained else None
                    s = time.perf_counter()
                    r = eng.generate(ids, GenerationConfig(max_new_tokens=256, constraint=c, speculative=spec))
                    wall += time.perf_counter() - s
                    n += len(r.tokens)
                    outs.append(r.tokens)
                if constrained:
                    want = want or outs
                    assert outs == want, f"{key}: constrained outputs differ from the first mode's"
                rec = dict(tokens=n, ms_per_token=1e3 * wall / n, **{k: 1e3 * v / n for k, v in _T.items()})
                rec["host_other"] = rec["ms_per_token"] - sum(1e3 * v / n for v in _T.values())
                runs[key].append(rec)
                print(rep, key, json.dumps({k: round(v, 3) for k, v in rec.items()}), flush=True)
    E.argmax_only = reduced
    per = {
        k: {f: dict(median=statistics.median(r[f] for r in v), spread=max(r[f] for r in v) - min(r[f] for r in v)) for f in v[0] if f != "tokens"}
        for k, v in runs.items()
    }
    out = dict(
        what="per output token (ms): constrained greedy with full rows masked in numpy vs the reduced head with penalty rows, and unconstrained",
        command=command(),
        machine=start,
        load_end=list(__import__("os").getloadavg()),
        engine=str(folder.name),
        tasks=[t["id"] for t in tasks],
        repeats=a.repeats,
        tokens={k: v[0]["tokens"] for k, v in runs.items()},
        constrained_outputs_equal=True,
        per_token_ms=per,
    )
    if a.out:
        write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
