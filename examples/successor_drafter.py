"""A model-free drafter, kept as a tested example (docs/howto/drafter.md walks through it).

:class:`SuccessorDrafter` learns, from the sequence itself (prompt + committed output), how
often each token was followed by each other token, and drafts a chain: the most frequent
successor of the pending token, then the most frequent successor of that one, and so on.
Its draft distribution at each step is the successor counts of the previous token (the
logits row holds ``log(count)`` at each successor, -1e9 elsewhere), so a greedy round's
confidence is ``count(top) / total`` and the confidence threshold stops a chain that goes
through an ambiguous token. Unlike the built-in n-gram drafter (:mod:`specrt.runtime.drafters`),
which copies the span that followed an earlier occurrence of the last 2..4 tokens, it looks
at one token of context and can chain through tokens that never appeared in that order.

It implements the :class:`specrt.runtime.drafters.Drafter` protocol; :func:`register` names
it with :func:`specrt.register_drafter`, after which ``GenerationConfig(drafter="successor")``
selects it like a built-in drafter.
The target verifies every proposal, so the output is the target's own (greedy) whatever
this drafter proposes; it only changes how many target passes that takes.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from specrt import register_drafter

__all__ = ["SuccessorDrafter", "register"]


class SuccessorDrafter:
    """Drafts the chain of most frequent successors (module docstring); no model call.

    Args:
        vocab: width of the draft logits rows the acceptor reads (``engine.draft.vocab``).
        kv: the draft KV rows the prefix cache holds for this prompt (``make``'s ``kv``).

    Attributes (the :class:`~specrt.runtime.drafters.Drafter` protocol):
        draft: None (no draft model: the draft's KV is never touched).
        kv, aligned: the draft KV rows the prefix cache holds for this prompt, passed
            through untouched (as the n-gram drafter does): this drafter never calls the
            draft model, so rows that were reusable stay reusable for a later request
            that drafts with the model (0 without a prefix cache hit).
        model_calls: 0 (the decode loop resets it every round; nothing here counts).
        forced_steps: [] (the loop clears it every round; a constraint's forced token
            reaches this drafter only as a masked row, never as a forced step).
        counts: ``counts[a][b]`` = how often ``b`` followed ``a`` in the sequence so far.
    """

    draft = None

    def __init__(self, vocab: int, kv: int = 0):
        self.kv = self.aligned = kv  # the draft KV's reusable rows stay reusable
        self.model_calls = 0
        self.forced_steps: list[int] = []
        self.counts: dict[int, dict[int, int]] = {}
        self.upto = 1  # pairs (seq[j - 1], seq[j]) for j < upto are counted
        self.row = np.full(vocab, -1e9, np.float32)  # the draft logits row, reused

    def update(self, seq: Sequence[int]) -> None:
        """Count the pairs ``(seq[j - 1], seq[j])`` not counted yet. ``seq`` only grows
        during a generation (rejected candidates never enter it), so each pair is counted
        once."""
        for j in range(self.upto, len(seq)):
            after = self.counts.setdefault(seq[j - 1], {})
            after[seq[j]] = after.get(seq[j], 0) + 1
        self.upto = max(self.upto, len(seq))

    def steps(self, seq: list[int], acc, steps: list, pre: list | None) -> Iterator[tuple[int, float]]:
        """The round's draft steps: one ``(token, confidence)`` per step, appended to
        ``steps`` and yielded, for as long as the loop pulls (it stops at the threshold,
        ``n_max`` or an end-of-generation id). ``pre`` is for a draft model's top-1 of
        the pending token (traces); this drafter has none to give."""
        self.update(seq)
        prev = seq[-1]  # the pending token: committed, not yet verified by the target
        i = 0
        while prev in self.counts:
            after = self.counts[prev]
            ids = np.fromiter(after.keys(), np.int64, len(after))
            self.row[ids] = np.log(np.fromiter(after.values(), np.float32, len(after)))
            step = acc.draft(self.row, i)  # the acceptor picks the token (argmax, or a draw when sampling)
            self.row[ids] = -1e9  # restore the buffer for the next step
            steps.append(step)
            yield step
            prev, i = step[0], i + 1

    def rollback(self, committed: int) -> None:
        """Nothing to roll back: no KV rows, and the counts hold committed tokens only."""


def register(name: str = "successor") -> str:
    """Make ``name`` a drafter of this process (``GenerationConfig(drafter=name)``,
    ``Engine.generate``, an in-process server's ``drafter`` field), one
    :class:`SuccessorDrafter` per generation; ``free=True``: its steps call no model, so
    adaptive k prices them at 0 s. Registering again replaces the recipe. Returns ``name``.

    Raises:
        ValueError: ``name`` is empty or a built-in drafter's.
    """
    register_drafter(name, lambda draft, vocab, k_max, kv: SuccessorDrafter(vocab, kv), free=True)
    return name
