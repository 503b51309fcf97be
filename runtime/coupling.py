"""Coupled speculative sampling: a seed pins the output, whatever the speculation did.

Each output position ``t`` (its index in the sequence, prompt included) gets its own noise:
a vector ``E_t`` of independent Exp(1) variables over the vocabulary, drawn from a
generator keyed by ``(seed, t)`` alone. The token at ``t`` is the *exponential race*
(equivalently the Gumbel-max trick, ``argmax log p + G`` with ``G = -log E``)::

    token_t = argmax_x  p_t(x) / E_t(x)      # ~ p_t exactly (Gumbel 1954; Maddison et al. 2014)

Target-only decoding takes that token from the target's warped distribution ``p_t``. A
speculative round lets the draft propose ``argmax q_t(x) / E_t(x)`` with the *same* noise,
and the target accepts a candidate iff its own race at that position picks the same token;
at the first rejection the target's own race winner is the correction. So every committed
token is the target's race winner at its position: the output is a function of the seed,
the prompt and the target's logits only, never of ``k``, the drafter, the threshold,
batching, the prefix cache or the thread count (which change none of those logits on
specrt's kernels). It is exact in distribution: ``E_t`` is independent of the noise of
earlier positions, so each token is an exact draw from ``p_t`` given the prefix.

Source: Daliri, Musco and Suresh 2024, "Coupling without Communication and Drafter-Invariant
Speculative Decoding" (arXiv:2408.07978), section 3 (Gumbel sampling coupling; a candidate
is accepted with probability >= (1 - TV(p, q)) / (1 + TV(p, q)), against 1 - TV(p, q) for
Leviathan et al. 2023, Algorithm 1, whose draws depend on how many candidates a round drew).
A one-hot draft row (the n-gram drafter, a forced grammar token) is accepted with probability
p(x), the same as Algorithm 1.

The warp (temperature, top-k, top-p) is :func:`specrt.runtime.sampling.warp`, applied to
draft and target rows alike. Cost per position: one Exp(1) vector over the vocabulary
(numpy's ziggurat; ~0.5 ms for 152k ids), shared by the draft step and the target row
of that position.
"""

from __future__ import annotations

import numpy as np

from .config import check_sampling_params
from .sampling import warp
from .speculative import Unconstrained

__all__ = ["position_noise", "exponential_race", "CoupledAcceptor"]


def position_noise(seed: int, pos: int, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` with the Exp(1) noise of sequence position ``pos`` under ``seed``.

    The generator is ``numpy.random.Generator(PCG64(SeedSequence([seed, pos])))``: distinct
    positions get independent streams (numpy's documented way to key streams), and the same
    (seed, pos) always gives the same vector. Entries are clamped to >= the smallest normal
    float64, so a race ``p / E`` never divides by zero.

    Args:
        seed: integer in [0, 2**64). pos: index of the token in the sequence (>= 0).
        out: float64 ``[V]`` buffer, written in place.

    Returns:
        ``out``.
    """
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, pos])))
    gen.standard_exponential(out=out)
    return np.maximum(out, np.finfo(np.float64).tiny, out=out)


def exponential_race(probs: np.ndarray, noise: np.ndarray, work: np.ndarray) -> int:
    """The winner of the exponential race ``argmax probs / noise`` (Gumbel-max trick).

    With ``noise`` i.i.d. Exp(1), the winner is distributed as ``probs`` exactly; an id with
    probability 0 never wins (some id has probability > 0).

    Args:
        probs: float64 ``[V]`` probabilities (a warped row). noise: float64 ``[V]`` > 0.
        work: float64 ``[V]`` scratch.

    Returns:
        the winning id (lowest id on an exact tie, which has probability 0).
    """
    np.divide(probs, noise, out=work)
    return int(work.argmax())


class CoupledAcceptor(Unconstrained):
    """The :class:`~specrt.runtime.decode.Acceptor` of coupled speculative sampling
    (module docstring): draft and target race with the noise of the position they decide.

    The decode loop calls :meth:`start` with the sequence position of each round's first new
    token (the prefill's first token, a batched step's token, a round's c_1), so draft step i
    and target row r use the noise of position ``start + i`` / ``start + r``.

    Args:
        vocab: real vocabulary size; rows are warped to this width.
        k_max: most candidates per round (sizes the noise rows: k_max + 1).
        temperature, top_k, top_p: the warp (:func:`~specrt.runtime.sampling.warp`), > 0
            temperature.
        seed: integer >= 0; None draws one from fresh OS entropy (a reproducible run then
            needs the seed read back from :attr:`seed`).

    Attributes:
        greedy: False. propose_below: True (as :class:`~specrt.runtime.sampling.SampledAcceptor`).
        by_position: True: the token at a position depends on that position's row and noise
            alone, so a batched step may decide it (``Generation.plain_ok``).
        seed: the seed in use.

    Raises:
        InputError: sampling parameters outside :func:`~specrt.runtime.config.check_sampling_params`.

    Memory: float64 ``[k_max + 1, vocab]`` noise rows and ``[3, vocab]`` work rows, allocated once.
    """

    greedy = False
    propose_below = True
    by_position = True  # a token depends on its position's noise alone: any call may decide it

    def __init__(self, vocab: int, k_max: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        check_sampling_params(temperature, top_k, top_p, seed)
        self.seed = int(np.random.SeedSequence().entropy % 2**64) if seed is None else int(seed)
        self.noise = np.empty((k_max + 1, vocab))
        self.filled = [False] * (k_max + 1)  # noise row j holds position base + j
        self.work = np.empty((3, vocab))  # warped draft row, warped target row, race scratch
        self.base = 0
        self._last = -1  # the target's race winner at the row accept() last read
        args = (vocab, temperature, top_k, top_p)
        self._warp = lambda row, out: warp(row, *args, out=out)

    def start(self, pos: int) -> None:
        """The round's first new token goes to sequence position ``pos`` (prompt included)."""
        if pos != self.base:
            self.base = pos
            self.filled = [False] * len(self.filled)

    def _race(self, row: np.ndarray, j: int, buf: int) -> tuple[int, np.ndarray]:
        """Warp ``row`` into work row ``buf`` and race it with position base + j's noise."""
        if not self.filled[j]:
            position_noise(self.seed, self.base + j, self.noise[j])
            self.filled[j] = True
        probs = self._warp(row, self.work[buf])
        return exponential_race(probs, self.noise[j], self.work[2]), probs

    def draft(self, row: np.ndarray, i: int) -> tuple[int, float]:
        """Candidate ``i``: the race of the warped draft row at position base + i, and its
        warped draft probability q(x) (the confidence the threshold rule reads)."""
        x, q = self._race(row, i, 0)
        return x, float(q[x])

    def accept(self, r: int, x: int, row: np.ndarray) -> bool:
        """Whether the target's race at row r (position base + r) picks candidate x."""
        self._last, _ = self._race(row, r, 1)
        return self._last == x

    def correction(self, r: int, row: np.ndarray) -> int:
        """After a rejection at row r: the target's race winner :meth:`accept` computed."""
        return self._last

    def bonus(self, r: int, row: np.ndarray) -> int:
        """No candidate to check at row r: the target's race winner at position base + r."""
        return self._race(row, r, 1)[0]
