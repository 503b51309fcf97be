"""One target call per scheduler iteration on an exact batched model (specrt's kernels:
:class:`~specrt.runtime.backends.kern_batch.KernelBatch`, whose rows are batch-1 rows bit for
bit), for :class:`~specrt.runtime.serve.batching.BatchPool`.

:func:`joint_round`: every active row joins ONE call (split only past the batch's
``max_rows``). A *plain* row (greedy or seeded, ``Generation.plain_ok``; ready: its KV holds
every committed token but the pending one) feeds its pending token and commits the target's token
(:meth:`~specrt.runtime.generation.Generation.push_row`); every other row makes its own
speculative round, as it would alone: it drafts on its own draft fork
(:meth:`~specrt.runtime.generation.Generation.draft_step`), its verification rows ride in the
call, and it accepts, commits and rolls back on them
(:meth:`~specrt.runtime.generation.Generation.verify_step`). So each row's output is the
request's alone, greedy or seeded (a seeded row's token at a position is the race of that
position's noise, whatever call made its row: :mod:`specrt.runtime.coupling`; an unseeded
sampled row never takes a plain step: Algorithm 1's draws follow its own rounds).

:class:`ModeChooser`: ``auto`` between a batched iteration (the ready greedy rows plain) and a
speculative one (no row plain), by the measured tokens per second of whole iterations.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from ..costs import EMA

__all__ = ["ModeChooser", "joint_round", "packed"]


class ModeChooser:
    """Which mode an iteration of ``n`` rows takes on an exact batched model (both give the
    same outputs, so only speed decides).

    Under ``auto``: the mode whose iterations at ``n`` rows made the most tokens per second
    (running means, :data:`~specrt.runtime.costs.EMA`, of whole iterations: drafting, the
    call, acceptance and text). Each mode is tried twice first (its first iteration after
    the other one also catches the drafts up, so the second replaces it); then the other
    mode every ``explore_every`` iterations times the ratio of the two means (at most 8x),
    so a mode far behind is retried rarely. A row count above one where batched iterations
    won starts batched (batched steps gain with every row). One row always speculates.
    ``speculate`` and ``batched`` never switch.

    Args:
        policy: ``auto``, ``speculate`` or ``batched``.
        explore_every: iterations between retries of the slower mode (scaled as above).
    """

    def __init__(self, policy: str, explore_every: int = 16):
        self.policy, self.explore_every = policy, explore_every
        self.since_explore = 0
        self.tps: dict[int, dict[str, tuple[float, int]]] = {}  # rows -> mode -> (tokens/s, iterations)

    def choose(self, n: int) -> str:
        """``"speculate"`` or ``"batched"`` for an iteration of ``n`` active rows."""
        if self.policy == "speculate" or n < 2:
            return "speculate"
        if self.policy == "batched":
            return "batched"
        seen = self.tps.setdefault(n, {})
        if any(seen.get(m, (0.0, 0))[1] < 2 for m in ("speculate", "batched")):
            if any(b < n and self.best(b) == "batched" for b in list(self.tps)):
                # speculation is tried at the exploration period only
                self.since_explore += 1
                if self.since_explore < 2 * self.explore_every or seen.get("batched", (0.0, 0))[1] < 2:
                    return "batched"
                self.since_explore = 0
                return "speculate"
            for m in ("speculate", "batched"):
                if seen.get(m, (0.0, 0))[1] < 2:
                    return m
        best, other = sorted(seen, key=lambda m: seen[m][0], reverse=True)
        self.since_explore += 1
        if self.since_explore >= self.explore_every * min(8.0, seen[best][0] / max(seen[other][0], 1e-9)):
            self.since_explore = 0
            return other
        return best

    def best(self, n: int) -> str | None:
        """The faster mode at ``n`` rows once both have their two iterations, else None."""
        seen = self.tps.get(n, {})
        if len(seen) < 2 or min(c for _, c in seen.values()) < 2:
            return None
        return max(seen, key=lambda m: seen[m][0])

    def observe(self, mode: str, n: int, tokens: int, seconds: float) -> None:
        """Fold one iteration of ``n`` rows (``tokens`` committed in ``seconds``) into
        ``mode``'s running mean; an iteration of no time or no rows is ignored."""
        if seconds <= 0.0 or n < 1:
            return
        seen = self.tps.setdefault(n, {})
        x = tokens / seconds
        mean, count = seen.get(mode, (x, 0))
        seen[mode] = (x if count < 2 else mean + EMA * (x - mean), count + 1)


def packed(work: list, max_rows: int) -> Iterator[list]:
    """``work`` items (each with its call's tokens second) in consecutive groups of at most
    ``max_rows`` tokens (an item wider alone gets a group of its own)."""
    part, n = [], 0
    for w in work:
        if part and n + len(w[1]) > max_rows:
            yield part
            part, n = [], 0
        part.append(w)
        n += len(w[1])
    if part:
        yield part


def joint_round(batched, rows: list, plain: list, run: Callable, on_fail: Callable, on_round: Callable, on_step: Callable) -> tuple[int, int]:
    """One iteration over ``rows`` in one call of ``batched`` (module docstring).

    Args:
        batched: the exact batched model (``rows(slots, tokens, positions)``, ``slots``,
            ``max_rows``).
        rows: the active rows (``gen``, ``slot``); ``plain``: those that feed their pending
            token alone (ready greedy rows).
        run: ``run(row, call)``: make one of the row's steps, hand its text on (the pool's).
        on_fail: ``on_fail(row, exc)``: the row's draft raised; it ends alone.
        on_round: ``on_round(row, tokens, seconds)``: a speculative row's round (its draft
            time and its share of the call).
        on_step: ``on_step(n, seconds)``: a call whose rows were all plain (a q = 1 step of n rows).

    Returns:
        ``(calls, tokens committed)``.
    """
    plain_ids = {id(r) for r in plain}
    work = []  # (row, tokens, start, off, draft seconds); off None: a plain row
    for r in rows:
        if id(r) in plain_ids:
            work.append((r, [r.gen.seq[-1]], r.gen.kv.target, None, 0.0))
            continue
        t0 = time.perf_counter()
        try:
            toks, start, off = r.gen.draft_step(batched.slots[r.slot])
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            on_fail(r, e)
            continue
        work.append((r, toks, start, off, time.perf_counter() - t0))
    calls = tokens = 0
    for part in packed(work, batched.max_rows):
        slots = [r.slot for r, ts, *_ in part for _ in ts]
        toks = [t for _, ts, *_ in part for t in ts]
        pos = [start + i for _, ts, start, *_ in part for i in range(len(ts))]
        t0 = time.perf_counter()
        logits = batched.rows(slots, toks, pos)
        dt = time.perf_counter() - t0
        calls += 1
        if all(w[3] is None for w in part):
            on_step(len(part), dt)
        lo = 0
        for r, ts, _, off, t_draft in part:
            share, before = dt * len(ts) / len(toks), len(r.gen.seq)
            if off is None:
                run(r, lambda: r.gen.push_row(logits[lo], share, True))
            else:
                block = logits[lo + off : lo + len(ts)]
                run(r, lambda: r.gen.verify_step(block, share))
                on_round(r, len(r.gen.seq) - before, t_draft + share)
            tokens += len(r.gen.seq) - before
            lo += len(ts)
    return calls, tokens
