"""Which target path is faster on this machine: specrt's kernels or the ONNX graph.

:func:`measure_paths` times the exact target step both ways, interleaved: the kernels at 1
row (every width is exact on them) and the ONNX graph at the width the decode loop calls it
with (its measured ``exact_min_q``: a target-only step recomputes ``exact_min_q - 1``
committed rows). The export records the result per machine in ``extra.kernels.target.measured``
and :func:`specrt.runtime.backends.kernels_choice` keeps the ONNX graph on a kind of machine
where it measured faster.

:func:`measure_draft_paths` times the draft's greedy step on each ISA path the CPU runs; the
export records it in ``extra.kernels.draft.measured``. (What the draft's panels trade for that
speed, acceptance, is the same on every path: the kernels' outputs are the same bits on each.)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

__all__ = ["measure_paths", "measure_draft_paths"]


def _time(model, toks: list[int], start: int) -> float:
    t0 = time.perf_counter()
    model.run(toks, start)
    return (time.perf_counter() - t0) * 1e3


def measure_paths(folder: Path, entry, record: dict, max_ctx: int, threads: int = 2, reps: int = 15, past: int = 128, log=None) -> dict:
    """Ms of the target's exact step on the kernels and on the ONNX graph: the fastest of
    ``reps`` interleaved calls each, the step's cost without interference. An export may run
    beside other jobs; a median there measured a spinning thread team waiting for a core
    (12.3 ms against 1.4 quiet for the embedded target, AMD EPYC Zen 3, a sanitizer build
    beside it), and chose the graph for good.

    Args:
        folder: the engine folder (ONNX target and panels written); entry: the target's
            :class:`~specrt.runtime.manifest.ModelEntry`; record: its kernels record.
        max_ctx: KV rows; threads: threads of both; reps: interleaved repetitions after one
            warm-up each; past: KV rows before the timed step (filled by a prefill).

    Returns:
        ``{"machine", "isa", "threads", "past", "reps", "kernels_ms", "ort_ms", "ort_q",
        "kernels_spread_ms", "ort_spread_ms"}`` (spread: the interquartile range).
    """
    from ..backends import cpu_model
    from ..backends.base import ThreadConfig
    from ..backends.kern import KernelModel
    from ..chunks import feed
    from ..kernels import cpu_isa, start_team
    from ..kernels.weights import KernelWeights
    from ..machine import this_machine

    past = max(1, min(past, max_ctx - 8))
    q_ort = max(1, entry.exact_min_q or 1)
    start_team(threads)
    kern = KernelModel(KernelWeights(Path(folder) / record["file"], record, max_ctx, 64), cpu_isa())
    ort = cpu_model(Path(folder), entry, max_ctx, 64, ThreadConfig(threads), role="target")
    prompt = [5 + (i * 7) % 97 for i in range(past + q_ort)]
    for m in (kern, ort):
        feed(m, prompt[:past], 0)
    tk, to = [], []
    for i in range(reps + 1):
        a = _time(kern, prompt[past : past + 1], past)
        b = _time(ort, prompt[past + 1 - q_ort : past + 1], past + 1 - q_ort)
        if i:
            tk.append(a)
            to.append(b)
    for m in (kern, ort):
        m.close()

    def iqr(x: list[float]) -> float:
        qs = statistics.quantiles(x, n=4)
        return round(qs[2] - qs[0], 2)

    return dict(
        machine=this_machine().to_json(),
        isa=cpu_isa(),
        threads=threads,
        past=past,
        reps=reps,
        kernels_ms=round(min(tk), 2),
        ort_ms=round(min(to), 2),
        ort_q=q_ort,
        kernels_spread_ms=iqr(tk),
        ort_spread_ms=iqr(to),
    )


def measure_draft_paths(folder: Path, record: dict, threads: int = 2, reps: int = 15, past: int = 128, max_ctx: int = 256) -> list[dict]:
    """Median ms of the draft's greedy step as the decode loop makes it (``run_top1``: its
    token and confidence from the reduced head) on every ISA path this CPU runs.

    Args:
        folder: the engine folder (``record["file"]`` written); record: the draft's kernels
            record; threads: the team's; reps: timed steps after one warm-up; past: KV rows
            before each step (filled by a prefill); max_ctx: KV rows allocated.

    Returns:
        ``[{"machine", "isa", "threads", "past", "reps", "step_ms", "spread_ms"}, ...]``, one
        per path from the portable one up (spread: the interquartile range).
    """
    from ..backends.kern import KernelModel
    from ..chunks import feed
    from ..kernels import ISAS, cpu_isa, start_team
    from ..kernels.weights import KernelWeights
    from ..machine import this_machine

    past = max(1, min(past, max_ctx - 2))
    start_team(threads)
    w = KernelWeights(Path(folder) / record["file"], record, max_ctx, 64)
    vocab = int(record["dims"]["n_vocab"])
    prompt = [5 + (i * 7) % 97 for i in range(past + 1)]
    out = []
    for isa in ISAS[: ISAS.index(cpu_isa()) + 1]:
        m = KernelModel(w, isa)
        feed(m, prompt[:past], 0)
        ts = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            m.run_top1(prompt[past:], past, vocab, 1.0)
            if i:
                ts.append((time.perf_counter() - t0) * 1e3)
        m.close()
        qs = statistics.quantiles(ts, n=4)
        out.append(
            dict(
                machine=this_machine().to_json(),
                isa=isa,
                threads=threads,
                past=past,
                reps=reps,
                step_ms=round(statistics.median(ts), 2),
                spread_ms=round(qs[2] - qs[0], 2),
            )
        )
    w.close()
    return out
