"""Per-call costs on this machine, timed the one way every caller uses: the tuner
(:func:`specrt.runtime.lab.tune.tune`), adaptive k (:meth:`Engine.adaptive_costs`), the
batch scheduler's load-aware rule, ``bench/ceiling.py``,
``scripts/measure_costs.py`` and the bench workers.

How a call is timed (:func:`measure_call_times`): every case (engine x model x width) runs
once per repetition in a fresh random order, after warm-up calls, so load changes on a
shared machine land on all cases alike; a target call of width q is timed as the decode
loop makes it, at least ``min_q`` rows wide (the extra rows recompute committed tokens
before it, :func:`specrt.runtime.decode.call_start`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from .errors import InputError
from .machine import differs, this_machine

__all__ = ["Costs", "loop_call", "measure_call_times", "measure_costs", "BatchCosts", "measure_step_costs", "recorded_costs", "recorded_call_costs", "EMA"]

EMA = 0.2  # weight of the newest observation in the batch scheduler's running means


@dataclass(frozen=True)
class Costs:
    """Per-call costs of an engine on one machine, the inputs of the cost model.

    Attributes:
        draft_s_per_call: seconds of one draft call (q = 1; every draft step is one call).
        target_s_by_q: seconds of one target pass of width q (q = 1: a target-only decode
            step; q = n + 1: verifying n candidates), by q.
        past: KV length the costs were measured at (None: unknown).
        source: how they were obtained (``"measured"`` by :func:`specrt.runtime.tune.measure_costs`,
            or ``"trace timings"`` by :func:`costs_from_rounds`).
        machine: where they were measured (:meth:`specrt.runtime.machine.Machine.to_json`;
            None: not recorded).
    """

    draft_s_per_call: float
    target_s_by_q: dict[int, float]
    past: int | None = None
    source: str = "measured"
    machine: dict | None = None

    def target(self, q: int) -> float:
        """Seconds of a target pass of width ``q``: the recorded value, else a least-squares
        line a + b q through the recorded widths (the cost of a small-q pass is nearly
        linear in q on a CPU).

        Raises:
            InputError: ``q`` is not recorded and fewer than two widths are.
        """
        t = self.target_s_by_q.get(q)
        if t is not None:
            return t
        qs = sorted(self.target_s_by_q)
        if len(qs) < 2:
            raise InputError(
                f"the costs have the target's pass time only for q={qs}; predicting q={q} needs at least two widths "
                "(record the trace with `specrt tune --trace FILE`, which measures q = 1..k_max+1)"
            )
        b, a = np.polyfit(np.array(qs, float), np.array([self.target_s_by_q[x] for x in qs]), 1)
        return float(a + b * q)

    def to_json(self) -> dict:
        """JSON-ready dict (q keys as strings)."""
        return dict(
            draft_s_per_call=self.draft_s_per_call,
            target_s_by_q={str(q): t for q, t in sorted(self.target_s_by_q.items())},
            past=self.past,
            source=self.source,
            machine=self.machine,
        )

    @staticmethod
    def from_json(d: dict, where: str = "costs") -> "Costs":
        """Inverse of :meth:`to_json`.

        Raises:
            InputError: a missing field or a value that is not a positive finite number.
        """
        try:
            d_s = float(d["draft_s_per_call"])
            by_q = {int(q): float(t) for q, t in d["target_s_by_q"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"{where}: malformed costs ({e!r}); need draft_s_per_call and target_s_by_q {{q: seconds}}") from None
        vals = [d_s, *by_q.values()]
        if not by_q or not all(math.isfinite(v) and v > 0 for v in vals) or min(by_q) < 1:
            raise InputError(f"{where}: costs must be positive finite seconds with widths q >= 1; got {d!r}")
        return Costs(d_s, by_q, d.get("past"), d.get("source", "measured"), d.get("machine") if isinstance(d.get("machine"), dict) else None)


def loop_call(model, role: str, vocab: int) -> Callable:
    """``call(tokens, start)``: the model call a greedy round makes, to be timed: a draft
    step's ``run_top1`` (its token and confidence) and a verification's ``run_argmax`` where
    the model offers them (specrt's kernels: :class:`~specrt.runtime.backends.kern.KernelModel`),
    else ``run`` (logits rows). ``role``: ``"draft"`` or ``"target"``; ``vocab``: the
    tokenizer's ids. Sampled, constrained and logprob runs read full rows, which cost a little
    more (on the real pair's draft 0.4-0.5 ms a step, docs/bench/real_pair/reduced_heads_*):
    adaptive k uses these greedy costs for them too."""
    from .backends.base import DraftsTop1, reduces_head

    if role == "draft" and isinstance(model, DraftsTop1):
        return lambda toks, start: model.run_top1(toks, start, vocab, 1.0)
    if role == "target" and reduces_head(model):
        return lambda toks, start: model.run_argmax(toks, start, vocab)
    return model.run


def measure_call_times(
    engines: Mapping[str, object], widths: Sequence[int], past: int, reps: int = 50, seed: int = 0, warmup: int = 3, progress: Callable | None = None
) -> dict[tuple[str, str, int], np.ndarray]:
    """Seconds of every timed call, per case ``(label, "draft" | "target", q)``.

    Cases: per engine, the draft's q = 1 call and the target's call at each width q
    (module docstring: at least the manifest's ``min_q`` rows), each as the greedy loop makes
    it (:func:`loop_call`: on specrt's kernels, reduced heads). Calls read ``past`` KV rows
    (whatever they hold) and write the rows after them; a later generation starts from KV
    length 0, so nothing is disturbed.

    Args:
        engines: label -> loaded :class:`~specrt.runtime.engine.Engine` (or anything with
            ``manifest``, ``draft`` and ``target``).
        widths: target widths q (each 1 <= q <= k_max + 1 of every engine).
        past: KV length of every call (``min_q - 1 <= past``, ``past + q <= max_ctx``).
        reps: repetitions per case. seed: seed of the orders. warmup: untimed calls per case.
        progress: ``progress("costs", done, total)`` after each repetition.

    Returns:
        ``{case: float64 [reps] seconds}``.

    Raises:
        InputError: reps < 1, or a width or past an engine cannot run.
    """
    widths = sorted({int(q) for q in widths})
    if reps < 1:
        raise InputError(f"cost repetitions {reps}; need >= 1")
    cases: list[tuple[tuple[str, str, int], object, list[int], int]] = []  # (case, model, tokens run, start)
    for label, eng in engines.items():
        eng.cached = None  # these calls overwrite KV rows a prefix cache may hold
        manifest = eng.manifest
        min_q = getattr(eng, "min_q", None) or manifest.min_q()  # the Engine's: 1 for a width-exact target
        for q in widths:
            if not 1 <= q <= manifest.k_max + 1 or past + q > manifest.max_ctx or past < min_q - 1:
                raise InputError(f"cost case q={q} at past={past}; need 1 <= q <= {manifest.k_max + 1}, past >= {min_q - 1} and past + q <= {manifest.max_ctx}")
        tok, vocab = min(5, manifest.vocab_size - 1), manifest.vocab_size
        cases.append(((label, "draft", 1), loop_call(eng.draft, "draft", vocab), [tok], past))
        cases += [((label, "target", q), loop_call(eng.target, "target", vocab), [tok] * max(q, min_q), past - max(0, min_q - q)) for q in widths]
    for _, call, toks, start in cases:
        for _ in range(warmup):
            call(toks, start)
    times: list[list[float]] = [[] for _ in cases]
    rng = np.random.default_rng(seed)
    clock = time.perf_counter
    for r in range(reps):
        for i in rng.permutation(len(cases)):
            _, call, toks, start = cases[i]
            t0 = clock()
            call(toks, start)
            times[i].append(clock() - t0)
        if progress:
            progress("costs", r + 1, reps)
    return {case: np.asarray(t) for (case, *_), t in zip(cases, times)}


def measure_costs(engine, widths: Sequence[int], past: int, reps: int = 50, seed: int = 0, progress: Callable | None = None):
    """Median per-call seconds of one engine (:func:`measure_call_times`) as
    :class:`Costs` (``source="measured"``).

    Raises:
        InputError: as :func:`measure_call_times`.
    """
    t = measure_call_times({"": engine}, widths, past, reps, seed, progress=progress)
    target = {q: float(np.median(x)) for (_, role, q), x in t.items() if role == "target"}
    return Costs(float(np.median(t[("", "draft", 1)])), target, past, "measured", this_machine().to_json())


@dataclass
class BatchCosts:
    """Measured seconds of one batched step per batch size (index n, n = 1..max_batch;
    index 0 unused) and a running mean per size updated by the real steps."""

    step_s: list[float]

    def observe(self, n: int, seconds: float) -> None:
        """Update the running mean of size ``n`` with one measured step."""
        self.step_s[n] += EMA * (seconds - self.step_s[n])

    def as_dict(self) -> dict:
        """JSON-ready ``{"n": seconds}``."""
        return {str(n): round(s, 6) for n, s in enumerate(self.step_s) if n}


def measure_step_costs(batched, length: int = 64, reps: int = 5, vocab: int | None = None, seed: int = 0) -> BatchCosts:
    """Time one batched step (a :class:`~specrt.runtime.backends.ort_gqa_batch.BatchedGqaModel`)
    at each batch size 1..max_batch (median of ``reps``), every row at past length
    ``length`` over random KV (writes the slots' rows ``[0, length]``: call it before any
    request holds a slot).

    Raises:
        ValueError: ``length + 1 > max_ctx`` or ``reps < 1``.
    """
    if length + 1 > batched.max_ctx or reps < 1:
        raise ValueError(f"length {length} must leave a row in max_ctx {batched.max_ctx}; reps {reps} >= 1")
    rng = np.random.default_rng(seed)
    v = vocab or batched.vocab
    step = [0.0]
    for n in range(1, batched.max_batch + 1):
        times = []
        for _ in range(reps + 1):  # the first call of a size binds (warm-up)
            toks = rng.integers(0, v, size=n)
            t0 = time.perf_counter()
            batched.step(toks, [length] * n)
            times.append(time.perf_counter() - t0)
        step.append(float(np.median(times[1:])))
    return BatchCosts(step)


def recorded_call_costs(manifest, backend: str = "ort-cpu"):
    """The per-call :class:`Costs` ``specrt tune`` recorded in the
    manifest (``extra["tune"]["costs"]``) when they were measured on this kind of machine
    (the record's own machine, else the tune's: :func:`specrt.runtime.machine.differs`) and
    on ``backend`` (the record's ``backend``; one without it predates the kernels: ort-cpu);
    else None (the caller measures them here). A target on specrt's kernels costs a third of
    its ONNX graph's step: costs of the other backend would mislead adaptive k.

    Raises:
        InputError: a malformed record.
    """
    tune = (manifest.extra or {}).get("tune") or {}
    rec = tune.get("costs")
    if not rec or differs(rec.get("machine") or tune.get("machine")) is not None or rec.get("backend", "ort-cpu") != backend:
        return None
    return Costs.from_json(rec, "manifest extra.tune.costs")


def recorded_costs(manifest, max_batch: int, backend: str = "ort-cpu") -> BatchCosts | None:
    """The batched step costs ``specrt tune --batch-costs N`` recorded in the manifest
    (``extra["tune"]["batch_step_costs"]``, ``{"n": seconds, "backend": name}``), when they
    were measured on this kind of machine (:func:`specrt.runtime.machine.differs`) and on
    ``backend`` (a record without ``backend`` predates the kernels: ort-cpu), and cover batch
    sizes 1..max_batch with positive numbers; else None (the caller measures them here)."""
    tune = (manifest.extra or {}).get("tune") or {}
    if differs(tune.get("machine")) is not None:
        return None
    rec = tune.get("batch_step_costs") or {}
    if rec.get("backend", "ort-cpu") != backend:
        return None
    try:
        step = [0.0] + [float(rec[str(n)]) for n in range(1, max_batch + 1)]
    except (KeyError, TypeError, ValueError):
        return None
    return BatchCosts(step) if min(step[1:]) > 0 else None
