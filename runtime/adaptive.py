"""How far to draft in each round, from this machine's per-call costs and this request's
running acceptance: speculation that does not lose to plain decoding.

Leviathan et al. 2023 (section 3.4) choose the number of candidates gamma that maximizes the
expected speedup for an acceptance rate alpha and a cost ratio c. Here the choice is made
per round, with the request's own running alpha and the measured costs of each call width:
drafting n candidates costs ``n * c_draft + c_target(n + 1)`` seconds and yields, in
expectation, ``1 + alpha + ... + alpha^n = (1 - alpha^(n+1)) / (1 - alpha)`` tokens (each
candidate accepted with probability alpha until the first rejection, plus the target's
token); the round drafts the ``n`` in ``0..cap`` with the most tokens per second. ``n = 0``
is a plain target step (the same call target-only decoding makes), so on text where
neither drafter predicts well the loop becomes target-only decoding instead of paying for
rejected drafts (TensorRT-LLM turns speculation off below an acceptance floor; onnxruntime-
genai adapts k between ``min_adaptive_k`` and its maximum).

alpha is the acceptance of a geometric model fitted to the rounds so far (accepted
candidates over accepted + rejections, Leviathan et al.'s estimate), each round's counts
decayed by ``decay`` so the text's current regime dominates, and shrunk to the prior
(the engine's tuned acceptance) with ``weight`` pseudo-observations. A request that has
stopped drafting probes with one candidate every ``probe_every`` rounds, so alpha can
recover when the text becomes predictable again (the probe's cost is bounded: one draft
step per ``probe_every`` tokens).

The confidence threshold stays the per-token stop rule inside a round; this only caps how
many candidates a round may propose. The output never depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["AdaptiveK", "expected_tokens"]


def expected_tokens(alpha: float, n: int) -> float:
    """Expected tokens one round commits with ``n`` candidates each accepted with
    probability ``alpha`` until the first rejection, plus the target's own token:
    ``sum_{i=0..n} alpha^i`` (Leviathan et al. 2023, Theorem 3.8's numerator)."""
    if alpha >= 1.0:
        return float(n + 1)
    return (1.0 - alpha ** (n + 1)) / (1.0 - alpha)


@dataclass
class AdaptiveK:
    """The per-round draft length of one generation (see the module docstring).

    Args:
        target_s: seconds of a target call by width: ``target_s[q - 1]`` for q = 1..k_max+1
            (q = 1 is the target-only step as the loop makes it: the 2-row call when the
            engine's exact width is 2).
        draft_s: seconds of one draft step (0 for the n-gram drafter).
        prior: the acceptance assumed before any round (the tuned engine's).
        weight: pseudo-observations behind the prior.
        decay: factor applied to the counts of earlier rounds at each update (0 < decay <= 1).
        probe_every: after this many rounds at n = 0, one round drafts a single candidate.

    Raises:
        ValueError: costs that are not positive, or parameters out of range.
    """

    target_s: Sequence[float]
    draft_s: float
    prior: float = 0.7
    weight: float = 4.0
    decay: float = 0.9
    probe_every: int = 8
    accepted: float = field(default=0.0, init=False)
    rejected: float = field(default=0.0, init=False)
    idle: int = field(default=0, init=False)

    def __post_init__(self):
        if not self.target_s or min(self.target_s) <= 0 or self.draft_s < 0:
            raise ValueError("adaptive k needs positive target costs per width and a non-negative draft cost")
        if not (0.0 <= self.prior <= 1.0 and self.weight > 0 and 0.0 < self.decay <= 1.0 and self.probe_every >= 1):
            raise ValueError("adaptive k: prior in [0, 1], weight > 0, decay in (0, 1], probe_every >= 1")

    @property
    def alpha(self) -> float:
        """The running acceptance (decayed counts shrunk to the prior)."""
        return (self.accepted + self.prior * self.weight) / (self.accepted + self.rejected + self.weight)

    def rate(self, n: int) -> float:
        """Expected tokens per second of a round with ``n`` candidates."""
        return expected_tokens(self.alpha, n) / (n * self.draft_s + self.target_s[n])

    def best(self, cap: int) -> int:
        """The length in ``0..cap`` of the highest :meth:`rate`, without the probe's
        bookkeeping (a pure look: :meth:`choose` is the round's decision)."""
        cap = min(cap, len(self.target_s) - 1)
        return max(range(cap + 1), key=self.rate) if cap > 0 else 0

    def choose(self, cap: int) -> int:
        """Candidates for the next round, in ``0..cap`` (``cap``: the loop's own limit:
        k_max, the token budget, the context): :meth:`best`, or 1 on a probe round (after
        ``probe_every`` rounds at 0 in a row)."""
        if min(cap, len(self.target_s) - 1) <= 0:
            return 0
        n = self.best(cap)
        if n == 0:
            self.idle += 1
            if self.idle >= self.probe_every:
                self.idle = 0
                return 1
        else:
            self.idle = 0
        return n

    def update(self, proposed: int, accepted: int) -> None:
        """Count a round: ``accepted`` of ``proposed`` candidates, a rejection when fewer
        than all were accepted (a round without candidates tells nothing)."""
        if proposed <= 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < proposed else 0.0)
