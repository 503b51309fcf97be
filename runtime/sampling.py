"""Exact speculative *sampling* as small pure functions (no model calls, no I/O).

Names follow Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML), Algorithm 1, and Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling" (arXiv:2302.01318), Algorithm 2: ``q`` is the draft's
distribution, ``p`` the target's. One verification (the loop is
:func:`specrt.runtime.decode.verify`, shared with greedy decoding; this module gives it
:class:`SampledAcceptor`), in the style of gpt-fast's ``speculative_decode``::

    for i, x in enumerate(candidates):          # x was sampled from q_i
        accept x with probability min(1, p_i(x) / q_i(x))
        on the first rejection: sample from norm(max(0, p_i - q_i)) and stop (early stop)
    all accepted: sample the bonus token from p_n

Both distributions are *warped* the same way first (:func:`warp`: temperature, then
top-k, then top-p, as Hugging Face's ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``); the output then follows the warped target distribution exactly
(Leviathan et al. 2023, section 3 and Appendix A.1; Chen et al. 2023, Theorem 1).

All probability arithmetic is float64 on the host: logits (float32 from onnxruntime, or
float16 from another backend) are upcast before the softmax, so no probability or ratio
is ever formed in half precision.

Randomness comes only from the ``numpy.random.Generator`` passed in (the engine makes one
``Generator(PCG64(seed))`` per call), so a seed fixes the whole run.
"""

from __future__ import annotations

import numpy as np

from .config import check_sampling_params
from .errors import raise_nonfinite
from .speculative import Unconstrained

__all__ = ["warp", "sample_token", "residual", "sample_residual", "accept_candidate", "final_token", "SampledAcceptor", "RESIDUAL_EPS", "derive_seed"]

# A residual max(0, p - q) whose total mass is at most this is numerical noise: rejection
# only happens where q(x) > p(x), so in exact arithmetic the residual mass equals
# TV(p, q) > 0; float64 round-off on normalised p and q is ~1e-16 per entry. Below the
# bound, p and q agree on their support, and sampling from p instead changes the output
# distribution by at most this much in total variation.
RESIDUAL_EPS = 1e-12

_TOP_P_FIRST = 64  # top-p looks at this many largest probabilities first, then 4x, ...


def derive_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice ``i`` of a request for several samples (OpenAI's ``n``/``best_of``).

    Choice 0 keeps ``seed`` itself (so ``n=1`` gives what a plain call with that seed gives);
    choice i > 0 uses the first 64-bit word of ``numpy.random.SeedSequence(seed,
    spawn_key=(i,))`` (numpy's documented way to derive independent streams from one seed).
    ``seed`` None stays None: every choice draws fresh OS entropy.

    Args:
        seed: the request's seed (an integer >= 0) or None.
        i: the choice's index (>= 0).

    Returns:
        an integer in [0, 2**64), or None.
    """
    if seed is None or i == 0:
        return seed
    return int(np.random.SeedSequence(seed, spawn_key=(i,)).generate_state(1, np.uint64)[0])


def warp(
    logits_row: np.ndarray,
    vocab: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Sampling distribution of one logits row: temperature, then top-k, then top-p.

    The same function warps the draft's rows (q) and the target's rows (p), and the
    target-only baseline samples from it too, so speculation changes nothing but speed.

    Args:
        logits_row: ``[V_padded]`` logits of one position, any float dtype (float16 and
            float32 are upcast to float64 first).
        vocab: real vocab size (<= V_padded); ids >= vocab (padding rows) get probability 0.
        temperature: >= 0. 0 gives the greedy one-hot (argmax, lowest id on ties); a
            positive temperature divides the max-subtracted logits, so as it goes to 0 the
            distribution becomes the one-hot of the argmax (greedy) without overflow.
        top_k: keep the tokens whose probability is >= the k-th largest (ties at the k-th
            value are kept, as Hugging Face's ``TopKLogitsWarper``); 0 or >= vocab = off.
            top_k = 1 keeps only the argmax (greedy unless the top logits tie exactly).
        top_p: after top-k, keep the smallest set of most probable tokens whose mass is
            >= top_p (the token that crosses top_p is kept, ties with it too; at least one
            token always stays), as Hugging Face's ``TopPLogitsWarper``; 1 = off.
        out: optional float64 ``[W]`` result buffer with vocab <= W; entries [vocab:W]
            are set to 0. Default: a new array of width ``len(logits_row)``.

    Returns:
        float64 ``[W]`` probabilities summing to 1 (``out`` when given).

    Raises:
        NumericsError: NaN or +inf in the row (or every entry -inf).
        InputError: parameters outside the ranges of :func:`check_sampling_params`.

    Source: Holtzman et al. 2020 (nucleus/top-p, section 3.1); Fan et al. 2018 (top-k);
    applied to both p and q before any ratio, as Leviathan et al. 2023 section 3.
    """
    if not (temperature >= 0.0 and top_k >= 0 and 0.0 < top_p <= 1.0):
        check_sampling_params(temperature, top_k, top_p)
    if out is None:
        out = np.empty(len(logits_row), np.float64)
    row = logits_row[:vocab]
    z = out[:vocab]
    out[vocab:] = 0.0
    if temperature == 0.0:
        idx = int(row.argmax())
        if not np.isfinite(row[idx]):
            raise_nonfinite(row)
        z[:] = 0.0
        z[idx] = 1.0
        return out
    z[:] = row  # upcast to float64
    m = z.max()
    if not np.isfinite(m):  # NaN propagates into max; +inf or all -inf are refused too
        raise_nonfinite(row)
    np.subtract(z, m, out=z)
    if temperature >= 1e-290:
        if temperature != 1.0:
            np.divide(z, temperature, out=z)
    else:  # (z - m) / T overflows to -inf: exp gives the exact 0 it stands for
        with np.errstate(over="ignore"):
            np.divide(z, temperature, out=z)
    np.exp(z, out=z)  # the max is exp(0) = 1, so the sum is >= 1: no division by zero below
    if 0 < top_k < vocab:
        kth = np.partition(z, vocab - top_k)[vocab - top_k]
        z[z < kth] = 0.0
    z /= z.sum()
    if top_p < 1.0:
        z[z < _top_p_cutoff(z, top_p)] = 0.0
        z /= z.sum()
    return out


def _top_p_cutoff(probs: np.ndarray, top_p: float) -> float:
    """Smallest probability kept by top-p: the value of the token whose running mass
    (tokens in decreasing order) first reaches ``top_p``. Looks at the 64 largest first,
    then 4x as many, so the common peaked case sorts only a handful of values."""
    n = probs.size
    m = min(_TOP_P_FIRST, n)
    while True:
        if m < n:
            top = probs[np.argpartition(probs, n - m)[n - m :]]
        else:
            top = probs
        top = np.sort(top)[::-1]
        mass = np.cumsum(top)
        j = int(np.searchsorted(mass, top_p))  # first index with mass >= top_p
        if j < m:
            return float(top[j])
        if m == n:  # round-off: all mass just below top_p; keep everything
            return float(top[-1])
        m = min(4 * m, n)


def sample_token(probs: np.ndarray, rng: np.random.Generator, work: np.ndarray | None = None) -> int:
    """Draw one id from non-negative weights (they need not sum to 1) by inverse CDF.

    Uses exactly one ``rng.random()`` draw. An id with weight 0 is never returned.

    Args:
        probs: float64 ``[W]`` non-negative weights with a positive, finite sum.
        rng: the call's ``numpy.random.Generator``.
        work: optional float64 ``[>= W]`` buffer for the running sum (avoids an allocation).

    Returns:
        the sampled id (int in 0..W-1).

    Raises:
        ValueError: weights summing to 0, NaN or inf.

    Source: inverse transform sampling; the draws "x ~ q", "x ~ p" and
    "x ~ norm(max(0, p - q))" of Leviathan et al. 2023, Algorithm 1.
    """
    c = np.cumsum(probs, out=None if work is None else work[: probs.size])
    total = c[-1]
    if not (0.0 < total < np.inf):
        raise ValueError(f"cannot sample from weights that sum to {total!r}")
    u = rng.random() * total
    i = int(np.searchsorted(c, u, side="right"))  # first id whose running sum exceeds u
    if i >= probs.size:  # u rounded up to the total: take the last id with positive weight
        i = int(np.flatnonzero(probs)[-1])
    return i


def residual(p_row: np.ndarray, q_row: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Unnormalised residual ``max(0, p - q)`` the target samples from after a rejection.

    Args:
        p_row, q_row: float64 ``[W]`` warped target and draft distributions of one position.
        out: optional float64 ``[W]`` result buffer.

    Returns:
        float64 ``[W]`` non-negative weights (``out`` when given); normalising is left to
        :func:`sample_token`, which accepts unnormalised weights.

    Source: Leviathan et al. 2023, Algorithm 1 ("p'(x) = norm(max(0, p(x) - q(x)))") and
    section 3 (it is the correction that makes the output follow p).
    """
    out = np.subtract(p_row, q_row, out=out)
    np.maximum(out, 0.0, out=out)
    return out


def sample_residual(p_row: np.ndarray, q_row: np.ndarray, rng: np.random.Generator, work: np.ndarray | None = None) -> int:
    """Sample from ``norm(max(0, p - q))``, or from ``p`` when that residual is numerically zero.

    A rejection of x implies q(x) > p(x), so in exact arithmetic the residual mass
    sum(max(0, p - q)) = TV(p, q) > 0. When it is at most :data:`RESIDUAL_EPS` it is
    round-off: p == q on the support, where the target's own distribution p is the exact
    answer (and the change in the output distribution is at most RESIDUAL_EPS).

    Args:
        p_row, q_row: float64 ``[W]`` warped distributions (each sums to 1).
        rng: the call's generator (one draw).
        work: optional float64 ``[2, >= W]`` buffers.

    Returns:
        the corrected token id.

    Source: Leviathan et al. 2023, Algorithm 1, rejection branch.
    """
    w = p_row.size
    res = residual(p_row, q_row, out=None if work is None else work[0, :w])
    if res.sum() <= RESIDUAL_EPS:
        res = p_row
    return sample_token(res, rng, None if work is None else work[1, :w])


def accept_candidate(x: int, q_row: np.ndarray, p_row: np.ndarray, rng: np.random.Generator) -> bool:
    """One acceptance test of speculative sampling: accept x with probability min(1, p(x)/q(x)).

    Uses exactly one ``rng.random()`` draw, so verifying candidates one by one consumes
    the generator the same way whatever the grouping of target passes.

    Args:
        x: the candidate id, sampled from ``q_row``.
        q_row, p_row: float64 ``[W]`` warped draft and target distributions of its position.
        rng: the call's generator.

    Returns:
        True when accepted. Written without a division: r * q(x) < p(x) with r ~ U[0, 1),
        which always accepts when p(x) >= q(x) > 0.

    Source: Leviathan et al. 2023, Algorithm 1 (acceptance step).
    """
    return rng.random() * q_row[x] < p_row[x]


def final_token(p_row: np.ndarray, q_row: np.ndarray | None, rng: np.random.Generator, work: np.ndarray | None = None) -> int:
    """The target's token that ends a round: after a rejection at this position (``q_row``
    given) a sample from norm(max(0, p - q)) (:func:`sample_residual`); after all
    candidates were accepted (``q_row`` None) the bonus token sampled from p.

    Args:
        p_row: float64 ``[W]`` warped target distribution of the position.
        q_row: float64 ``[W]`` warped draft distribution of the rejected candidate, or None.
        rng: the call's generator (one draw).
        work: optional float64 ``[2, >= W]`` buffers.

    Returns:
        the token id.

    Source: Leviathan et al. 2023, Algorithm 1 (rejection branch and the final sample).
    """
    if q_row is not None:
        return sample_residual(p_row, q_row, rng, work)
    return sample_token(p_row, rng, None if work is None else work[1])


class SampledAcceptor(Unconstrained):
    """Exact speculative sampling for :func:`specrt.runtime.decode.verify` and the decode
    loop: owns the call's random generator and the float64 q/p rows it warps into.

    One generation uses one acceptor. Draws, in order: one per draft step (the proposal
    x ~ q), one per examined candidate (accept with probability min(1, p(x)/q(x))), one for
    the correction (norm(max(0, p - q))) or bonus token (p); so the tokens depend on the
    seed and the settings, never on how target rows were grouped into passes.

    Args:
        vocab: real vocabulary size; rows are warped to this width.
        k_max: most candidates per round (sizes the q rows; p rows are k_max + 1).
        temperature, top_k, top_p: the warp (:func:`warp`), applied to q and p alike.
        seed: seed of ``numpy.random.Generator(PCG64(seed))``; None = fresh entropy.
        rng: a generator to use instead of seeding one (tests script the draws).

    Attributes:
        greedy: False; propose_below: True (see :func:`specrt.runtime.speculative.propose`).
        rng: the generator.
        q_rows: float64 ``[k_max, vocab]`` warped draft distributions of the round's candidates.
        p_rows: float64 ``[k_max + 1, vocab]`` warped target distributions of the rows read.

    Source: Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2.
    """

    greedy = False
    propose_below = True

    def __init__(self, vocab: int, k_max: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int | None = None, rng=None):
        check_sampling_params(temperature, top_k, top_p, seed)
        self.rng = rng if rng is not None else np.random.Generator(np.random.PCG64(seed))
        self.q_rows = np.empty((k_max, vocab))
        self.p_rows = np.empty((k_max + 1, vocab))
        self.work = np.empty((2, vocab))  # residual and running-sum buffers
        args = (vocab, temperature, top_k, top_p)
        self._warp = lambda row, out: warp(row, *args, out=out)

    @classmethod
    def over_probabilities(cls, q_rows: np.ndarray, rng) -> "SampledAcceptor":
        """An acceptor whose candidates came from the given draft distributions and whose
        target rows are *already* probabilities (not logits): Algorithm 1 on explicit p
        and q, as in the unit tests of the acceptance rule.

        Args:
            q_rows: float64 ``[n, W]`` draft distributions of the candidates.
            rng: the generator (or a scripted stand-in with ``random()``).
        """
        n, w = q_rows.shape
        acc = cls(w, max(n, 1), 1.0, rng=rng)
        acc.q_rows[:n] = q_rows
        acc._warp = lambda row, out: np.copyto(out, row) or out
        return acc

    def draft(self, row: np.ndarray, i: int) -> tuple[int, float]:
        """Candidate ``i``: x ~ q from a draft logits row (q kept in ``q_rows[i]``); returns
        (x, q(x)), the confidence the threshold rule reads. One draw."""
        q_row = self._warp(row, self.q_rows[i])
        x = sample_token(q_row, self.rng, self.work[1])
        return x, float(q_row[x])

    def accept(self, r: int, x: int, row: np.ndarray) -> bool:
        """Warp target row r into ``p_rows[r]`` and accept x with probability
        min(1, p(x)/q(x)) (:func:`accept_candidate`, one draw)."""
        return accept_candidate(x, self.q_rows[r], self._warp(row, self.p_rows[r]), self.rng)

    def correction(self, r: int, row: np.ndarray) -> int:
        """After rejecting candidate r: a sample from norm(max(0, p_r - q_r)) (one draw)."""
        return final_token(self.p_rows[r], self.q_rows[r], self.rng, self.work)

    def bonus(self, r: int, row: np.ndarray) -> int:
        """No candidate to check at row r (all accepted, the first token, a target-only
        step): a sample from the warped p_r (one draw)."""
        return final_token(self._warp(row, self.p_rows[r]), None, self.rng, self.work)
