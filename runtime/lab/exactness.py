"""Width exactness of an exported graph: from which call width q are logits rows
bit-identical, whatever the width and the row offset inside the call?

Why it matters: speculative decoding computes a position's logits inside a verification
call of q = n + 1 rows, target-only decoding one row at a time. If a kernel rounds
differently at some width (onnxruntime's MatMul takes a GEMV path for one row and a GEMM
path for more; the int4/int8 MatMulNBits kernels with ``accuracy_level`` 4 quantize the
activations per call), a near-tie between the top two tokens can flip and the speculative
output would differ from the target's own greedy output. Research r14 found, for every
flavor on onnxruntime 1.32 CPU, that every q >= 2 gives bit-identical rows and only q = 1
differs (about 1e-5 in fp32, up to 0.09 in int4 accuracy level 4). This module measures
it on the graph actually exported, so the decode loop can avoid the odd widths
(:mod:`specrt.runtime.decode`, ``Plan.min_q``) and the manifest says what was found.

Method (:func:`measure`): random token sequences are run through the model in several
*patterns* of calls: every call exactly 1 token (q = 1), or a first call of ``q + o``
tokens then calls of ``q`` (the tail folded into the last call, so no call is narrower
than q) for each width q and offset o. Each pattern rewrites the KV cache from position 0,
so both the logits and the KV rows behind later positions are compared. The reference is
the widest pattern; ``exact_min_q`` is the smallest measured width q such that every
pattern with all calls >= q is bit-identical to it (also across the thread counts given).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

__all__ = ["pattern_bounds", "run_pattern", "measure", "measure_wide", "measure_wide_engine", "DEFAULT_OFFSETS"]

DEFAULT_OFFSETS = (0, 1, 2)


def pattern_bounds(n: int, q: int, offset: int = 0) -> list[tuple[int, int]]:
    """``[lo, hi)`` calls covering ``0..n``: a first call of ``q + offset`` tokens, then calls
    of ``q``; a tail narrower than ``q`` is folded into the call before it (so every call is
    at least ``q`` wide when ``n >= q``). ``q = 1`` with offset 0 is one call per token."""
    first = min(n, q + offset)
    out = [(0, first)]
    i = first
    while i < n:
        hi = min(n, i + q)
        if 0 < n - hi < q:
            hi = n
        out.append((i, hi))
        i = hi
    return out


def run_pattern(model, tokens: Sequence[int], bounds: list[tuple[int, int]]) -> np.ndarray:
    """Logits rows float32 ``[len(tokens), vocab]`` of ``tokens`` computed by ``model`` (a
    :class:`~specrt.runtime.backends.base.Model`) in the calls ``bounds`` (from position 0)."""
    out = np.empty((len(tokens), model.vocab), np.float32)
    for lo, hi in bounds:
        out[lo:hi] = model.run(tokens[lo:hi], lo)
    return out


def exact_min_q(by_width: dict[int, list[float]]) -> int | None:
    """The smallest width q such that every measured width >= q gave bit-identical rows
    (all its differences 0.0), or None when the widest did not."""
    exact = None
    for q in sorted(by_width, reverse=True):
        if max(by_width[q]) != 0.0:
            break
        exact = q
    return exact


def _check_measure(models, widths: Sequence[int], offsets: Sequence[int], length: int) -> tuple[list[int], list[int]]:
    """:func:`measure`'s widths (1 added) and offsets (0 added), sorted, after checking
    every model can run them; raises ValueError as :func:`measure` says."""
    if not models:
        raise ValueError("no model to measure")
    widths = sorted({1, *(int(q) for q in widths)})
    offsets = sorted({0, *(int(o) for o in offsets)})
    widest = widths[-1]
    if length <= widest + max(offsets):
        raise ValueError(f"length {length} must exceed the widest call {widest} + offset {max(offsets)}")
    need_q = 2 * widest + max(offsets)  # a folded tail makes a call up to 2q - 1 wide
    for _, m in models:
        if m.max_q < need_q or m.max_ctx < length:
            raise ValueError(f"a model with max_q {m.max_q} / max_ctx {m.max_ctx} cannot run calls of up to {need_q} over {length} tokens")
    return widths, offsets


def measure(
    models: Sequence[tuple[str, object]],
    vocab_size: int,
    widths: Sequence[int],
    offsets: Sequence[int] = DEFAULT_OFFSETS,
    length: int = 40,
    sequences: int = 2,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Measure the width exactness of one graph (see the module docstring).

    Args:
        models: ``(label, model)`` pairs over the same graph, e.g. one per thread count; the
            first one runs every pattern, the others the reference pattern and the
            narrowest one of each width (thread counts must not change bits either).
        vocab_size: token ids are drawn from ``0..vocab_size-1`` (the tokenizer's ids).
        widths: call widths q to measure (every model's ``max_q`` >= 2 * the widest +
            the largest offset); 1 is always measured as well.
        offsets: extra tokens of the first call (row offsets inside the later calls).
        length: tokens per sequence (<= ``max_ctx``; > the widest width + offset).
        sequences: random sequences.
        seed: numpy seed of the sequences.
        progress: called after each pattern as ``progress(patterns done, patterns)`` (the
            reference first; a real model's pattern takes seconds), or None.

    Returns:
        A JSON-ready record: ``exact_min_q`` (int, or None when no measured width is
        bit-identical), ``widths``, ``offsets``, ``sequences``, ``length``, ``models``
        (labels), ``max_abs_diff`` per pattern label (``"q1"``, ``"q2+o1"``, ``"q9 [t1]"``,
        ...) against the reference, and ``reference``.

    Raises:
        ValueError: no models, or a width wider than a model's ``max_q`` / longer than the
            sequence.
    """
    widths, offsets = _check_measure(models, widths, offsets, length)
    widest = widths[-1]
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab_size, size=length).tolist() for _ in range(sequences)]
    patterns = [("q1", 1, 0)] + [(f"q{q}" + (f"+o{o}" if o else ""), q, o) for q in widths if q > 1 for o in offsets]
    ref_label = f"q{widest}"
    label0, model0 = models[0]
    total = 1 + len(patterns) + len(widths) * (len(models) - 1)

    def tick(done: int) -> None:
        if progress is not None:
            progress(done, total)

    ref = [run_pattern(model0, s, pattern_bounds(length, widest)) for s in seqs]
    tick(1)
    diffs: dict[str, float] = {}
    by_width: dict[int, list[float]] = {q: [] for q in widths}
    for lab, q, o in patterns:
        d = max(float(np.abs(run_pattern(model0, s, pattern_bounds(length, q, o)) - r).max()) for s, r in zip(seqs, ref))
        diffs[lab] = d
        by_width[q].append(d)
        tick(len(diffs) + 1)
    for lab, m in models[1:]:  # other thread counts: the reference pattern and each width at offset 0
        for q in widths:
            d = max(float(np.abs(run_pattern(m, s, pattern_bounds(length, q)) - r).max()) for s, r in zip(seqs, ref))
            diffs[f"q{q} [{lab}]"] = d
            by_width[q].append(d)
            tick(len(diffs) + 1)
    exact = exact_min_q(by_width)
    labels = [lab for lab, _ in models]
    return dict(
        exact_min_q=exact,
        widths=widths,
        offsets=offsets,
        sequences=sequences,
        length=length,
        models=labels,
        reference=f"{ref_label} [{label0}]",
        max_abs_diff=diffs,
        note=_note(exact, labels, diffs),
    )


def _note(exact: int | None, labels: list[str], diffs: dict[str, float]) -> str:
    """The one-line summary of a :func:`measure` record."""
    if exact:
        return f"rows are bit-identical for every call width >= {exact} (any offset, thread counts {', '.join(labels)})"
    return f"no measured width gives bit-identical rows (largest difference {max(diffs.values()):.3g}); speculative output may differ from target-only at near-ties"


def measure_batched(batched, vocab_size: int, sizes: Sequence[int], steps: int = 12, prefix: int = 20, seed: int = 0) -> dict:
    """Are the rows of batched q = 1 calls bit-identical to batch-1 calls at least 2 wide?

    For each batch size n in ``sizes``: n random sequences, sequence i with a prompt of
    ``prefix + 3 * i`` tokens (so rows have different past lengths), then ``steps`` more
    tokens. Reference: each sequence alone in slot 0 of ``batched`` (a
    :class:`~specrt.runtime.backends.ort_gqa_batch.BatchedGqaModel`) in calls of 9 (tail
    folded, :func:`pattern_bounds`). Batched: every prompt fed alone into its slot (the
    same pattern), then ``steps`` batched calls
    (:meth:`~specrt.runtime.backends.ort_gqa_batch.BatchedGqaModel.step`) of one token per
    row, each reading the KV rows the previous batched calls wrote. Compares the logits of
    the ``steps`` positions.

    Returns:
        JSON-ready: ``max_abs_diff`` per batch size (``"n2"``, ...), ``exact`` (the sizes
        whose rows were bit-identical), ``steps``, ``prefix``, ``note``.

    Raises:
        ValueError: a size above ``batched.max_batch`` or sequences longer than its context.
    """
    rng = np.random.default_rng(seed)
    diffs: dict[str, float] = {}
    for n in sizes:
        if not 1 <= n <= batched.max_batch:
            raise ValueError(f"batch size {n} outside 1..{batched.max_batch}")
        lens = [prefix + 3 * i for i in range(n)]
        if max(lens) + steps > batched.max_ctx:
            raise ValueError(f"sequences of {max(lens) + steps} tokens exceed max_ctx {batched.max_ctx}")
        seqs = [rng.integers(0, vocab_size, size=L + steps).tolist() for L in lens]
        ref = []
        for s in seqs:
            ref.append(run_pattern(batched.slots[0], s, pattern_bounds(len(s), 9))[len(s) - steps - 1 : len(s) - 1].copy())
        for i, (s, L) in enumerate(zip(seqs, lens)):
            run_pattern(batched.slots[i], s[:L], pattern_bounds(L, 9))
        got = np.empty((n, steps, batched.vocab), np.float32)
        for t in range(steps):
            # step t feeds position L - 1 + t (step 0 recomputes the prompt's last row)
            toks = [s[L + t - 1] for s, L in zip(seqs, lens)]
            got[:, t] = batched.step(toks, [L + t - 1 for L in lens])
        diffs[f"n{n}"] = max(float(np.abs(got[i] - ref[i]).max()) for i in range(n))
    exact = [int(k[1:]) for k, d in diffs.items() if d == 0.0]
    return dict(
        max_abs_diff=diffs,
        exact=exact,
        steps=steps,
        prefix=prefix,
        note="batched q=1 rows vs batch-1 calls of 9 (tail folded; every call >= 2 wide); per-row past lengths differ by 3",
    )


def measure_wide(
    model,
    vocab_size: int,
    ref_q: int,
    offsets: Sequence[int] = (0, 1),
    strides: Sequence[int] = (1, 7),
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Which call widths wider than the decode loop's (``ref_q + 1`` up to the model's
    widest call) give the rows of narrow calls? Decides whether a prefix cache may reuse
    any committed row, not only whole aligned prefill calls (:mod:`specrt.runtime.prefix`,
    "Any layout").

    Method: one random sequence; reference rows from calls of exactly ``ref_q`` tokens (a
    width :func:`measure` found bit-identical at every offset). For each offset ``o`` (in
    units of ``ref_q`` rows of past: 0 = the first call, 1 = after ``ref_q`` rows) and every
    ``stride``-th width ``q`` from ``ref_q + 1``, one call of ``q`` tokens at position
    ``o * ref_q`` over the reference's KV rows; its logits rows must equal the reference's
    bit for bit. Why every width: a kernel may split a call's rows into tiles and round a
    one-row tile like a 1-row call (onnxruntime's MatMulNBits: a 129-row call is 128 + 1
    rows on the embedded int4 target, its last row differs by up to 0.05), so exactness at
    one wide width says nothing about the next.

    Args:
        model: a :class:`~specrt.runtime.backends.base.Model` (its ``max_q``: the widest width
            measured; ``max_ctx`` must hold ``ref_q`` + 1 rows past the widest offset).
        vocab_size: token ids are drawn from ``0..vocab_size-1``.
        ref_q: the reference call width (>= 2; the decode loop's widest, ``k_max + 1``).
        offsets: offsets in units of ``ref_q`` rows, one per entry of ``strides``.
        strides: the width stride per offset (1: every width).
        seed: numpy seed. progress: ``progress(done, total)`` after each width, or None.

    Returns:
        JSON-ready: ``lo`` (``ref_q + 1``), ``hi`` (the widest width measured at offset 0),
        ``checked`` (per offset label ``"o<rows>"``, ``[widths measured, widest]``),
        ``inexact`` (sorted widths whose rows differed, at any offset), ``max_abs_diff``
        (the differing widths' largest difference, as ``"q<width>@o<rows>"``), ``note``.

    Raises:
        ValueError: ``ref_q < 2``, offsets and strides of different lengths, or a model
            whose context cannot hold a width above ``ref_q`` at the widest offset.
    """
    if ref_q < 2:
        raise ValueError(f"reference width {ref_q}; it must be >= 2 (1-row calls round differently)")
    if len(offsets) != len(strides) or not offsets:
        raise ValueError("give one stride per offset")
    rows_past = [int(o) * ref_q for o in offsets]
    tops = [min(model.max_q, model.max_ctx - p) for p in rows_past]
    if min(tops) <= ref_q:
        raise ValueError(f"a model with max_q {model.max_q} / max_ctx {model.max_ctx} has no width above {ref_q} at {max(rows_past)} rows of past")
    length = -(-max(p + t for p, t in zip(rows_past, tops)) // ref_q) * ref_q  # whole ref_q calls
    length = min(length, model.max_ctx // ref_q * ref_q)
    seq = np.random.default_rng(seed).integers(0, vocab_size, size=length).tolist()
    plan = [(p, list(range(ref_q + 1, top + 1, max(1, int(s))))) for p, top, s in zip(rows_past, tops, strides)]
    total, done = sum(len(w) for _, w in plan), 0
    ref = run_pattern(model, seq, pattern_bounds(length, ref_q))
    inexact: set[int] = set()
    diffs: dict[str, float] = {}
    checked: dict[str, list[int]] = {}
    for p, widths in plan:
        if p:  # the reference's rows of past (an earlier offset's calls rewrote them)
            run_pattern(model, seq[:p], pattern_bounds(p, ref_q))
        for q in widths:
            d = float(np.abs(model.run(seq[p : p + q], p) - ref[p : p + q]).max())
            if d != 0.0:
                inexact.add(q)
                diffs[f"q{q}@o{p}"] = d
            done += 1
            if progress is not None:
                progress(done, total)
        checked[f"o{p}"] = [len(widths), widths[-1] if widths else ref_q]
    bad = sorted(inexact)
    hi = plan[0][1][-1] if plan[0][1] else ref_q
    note = (
        f"every width {ref_q + 1}..{hi} measured gives the rows of {ref_q}-row calls"
        if not bad
        else f"widths {bad} round differently from {ref_q}-row calls; every other width {ref_q + 1}..{hi} measured gives their rows"
    )
    return dict(lo=ref_q + 1, hi=hi, ref_q=ref_q, checked=checked, inexact=bad, max_abs_diff=diffs, seed=seed, note=note)


def measure_wide_engine(folder, entry, max_ctx: int, vocab_size: int, ref_q: int, progress: Callable[[int, int], None] | None = None) -> dict:
    """:func:`measure_wide` on an exported model as the prefix cache would call it: the
    runtime's CPU model class for ``entry`` in ``folder``, 2 intra-op threads, no spinning,
    context ``max_ctx`` and calls up to the prefill's widest (``min(PREFILL_CHUNK, max_ctx)``).
    The one place both ``specrt export`` (:func:`specrt.export.pipeline.measure_exactness`)
    and ``scripts/measure_wide.py`` build that model, so their records mean the same thing.

    Args:
        folder: the engine folder (``pathlib.Path`` or str). entry: its manifest's model entry
            (``Manifest.target``). max_ctx: the engine's context (tokens). vocab_size, ref_q,
            progress: as :func:`measure_wide`.

    Returns:
        :func:`measure_wide`'s record.

    Raises:
        ValueError: as :func:`measure_wide` (e.g. a context with no width above ``ref_q``).
    """
    from ..backends import cpu_model
    from ..backends.base import ThreadConfig
    from ..chunks import PREFILL_CHUNK

    model = cpu_model(folder, entry, max_ctx, min(PREFILL_CHUNK, max_ctx), ThreadConfig(2, False, 2))
    try:
        return measure_wide(model, vocab_size, ref_q, progress=progress)
    finally:
        del model  # its KV buffers and session: gigabytes on the real pair
