"""Statistics of one generation, accumulated from the decode loop's round records."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .decode import Round
from .flops import FlopCoefficients, body_flops

__all__ = ["Stats", "acceptance_rate", "mean_accepted"]


def acceptance_rate(accepted: int, proposed: int) -> float:
    """Accepted / proposed draft candidates (nan when none was proposed): the one definition
    for the stats, the bench, the replay, the server's usage and its metrics."""
    return accepted / proposed if proposed else math.nan


def mean_accepted(accepted: int, passes: int) -> float:
    """Accepted draft candidates per verification pass (nan before any pass)."""
    return accepted / passes if passes else math.nan


@dataclass
class Stats:
    """What one generation did (times in seconds, counts in tokens or passes).

    ``accepted_hist[m]`` counts verification passes that accepted m candidates,
    ``proposed_hist[n]`` passes that proposed n (so the acceptance of draft position i is
    ``sum(accepted_hist[i+1:]) / sum(proposed_hist[i+1:])``).

    Target work after prefill (the prefill is counted apart, in ``prefill_flops``):
    ``target_calls`` model runs (one per round for full; one per chunk run for chunked;
    the body runs for lazy-head, whose head runs are ``head_calls``), ``target_positions``
    positions through the target's body, ``head_rows`` rows projected to logits, and
    ``target_flops`` the FLOPs of all that (:mod:`specrt.runtime.flops`).

    ``forced`` counts the output tokens a constraint forced (jump-forward: committed without
    a model call, :mod:`specrt.runtime.constraints`); they are in ``new_tokens`` but never in
    ``proposed``/``accepted``. ``forced_accepted``: of ``accepted``, the candidates a
    constraint forced inside a round (no draft call made them; acceptance is certain).

    ``cached_tokens``: prompt tokens whose target KV rows came from an earlier request
    (prefix reuse, :mod:`specrt.runtime.prefix`; OpenAI's ``prompt_tokens_details.cached_tokens``);
    the prefill computed only the others.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    passes: int = 0  # rounds after prefill (verification or plain decode)
    draft_calls: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    proposed_hist: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    ttft_seconds: float = 0.0
    target_calls: int = 0
    head_calls: int = 0
    target_positions: int = 0
    head_rows: int = 0
    target_flops: int = 0
    prefill_flops: int = 0
    forced: int = 0
    forced_accepted: int = 0
    cached_tokens: int = 0

    def add(self, rec: Round, fc: FlopCoefficients) -> None:
        """Count one :class:`~specrt.runtime.decode.Round` record (the prefill's included).

        Args:
            rec: the record. fc: the target's FLOP coefficients.
        """
        flops = sum(body_flops(fc, q, past) + rows * fc.per_head_row for q, past, rows in rec.calls)
        self.new_tokens += len(rec.commit)
        self.forced += rec.forced
        if rec.pos == 0:
            self.cached_tokens = rec.cached
            self.prefill_seconds = self.ttft_seconds = rec.target_s
            self.prefill_flops = flops
            return
        n, m = rec.n, rec.m
        while len(self.proposed_hist) <= n:
            self.proposed_hist.append(0)
        while len(self.accepted_hist) <= m:
            self.accepted_hist.append(0)
        self.passes += 1
        self.proposed += n
        self.accepted += m
        self.proposed_hist[n] += 1
        self.accepted_hist[m] += 1
        self.draft_calls += rec.draft_calls
        self.forced_accepted += rec.forced_accepted
        self.draft_seconds += rec.draft_s
        self.target_seconds += rec.target_s
        for q, _, rows in rec.calls:
            self.target_calls += q > 0
            self.head_calls += q == 0
            self.target_positions += q
            self.head_rows += rows
        self.target_flops += flops

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (nan when nothing was proposed; :func:`acceptance_rate`)."""
        return acceptance_rate(self.accepted, self.proposed)

    @property
    def mean_accepted(self) -> float:
        """Mean accepted candidates per verification pass (:func:`mean_accepted`)."""
        return mean_accepted(self.accepted, self.passes)

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens committed per target pass (accepted + correction/bonus)."""
        return (self.new_tokens - 1) / self.passes if self.passes else math.nan

    @property
    def tokens_per_second(self) -> float:
        """New tokens / total wall time of the call (prefill included)."""
        return self.new_tokens / self.total_seconds if self.total_seconds else math.nan

    @property
    def seconds_per_token(self) -> float:
        """Total wall time of the call / new tokens (prefill included)."""
        return self.total_seconds / self.new_tokens if self.new_tokens else math.nan

    @property
    def target_flops_per_token(self) -> float:
        """Target FLOPs executed after prefill / tokens committed after prefill
        (``new_tokens - 1``: the prefill commits the first); nan when there are none."""
        return self.target_flops / (self.new_tokens - 1) if self.new_tokens > 1 else math.nan

    def as_dict(self) -> dict:
        """JSON-ready dict of the fields and the derived figures (NaN becomes None: JSON has no NaN)."""
        d = dict(self.__dict__)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted=self.mean_accepted,
            tokens_per_pass=self.tokens_per_pass,
            tokens_per_second=self.tokens_per_second,
            seconds_per_token=self.seconds_per_token,
            target_flops_per_token=self.target_flops_per_token,
        )
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
