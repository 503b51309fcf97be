"""Offline replay: predict a greedy (k_max, threshold) policy from a recorded trace, without models.

Greedy acceptance of a candidate depends only on the prefix, and the output is the target's
greedy output under every policy. So a trace (:mod:`specrt.runtime.lab.trace`) gives, per
output position j, the draft's top-1 and confidence *given the true prefix*
(:class:`PositionView`), and any policy can be walked over those positions with the same
drafting rule the decode loop uses (:func:`specrt.runtime.speculative.propose`). See
:func:`replay` for exactly which quantities are exact and which are approximated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from ..config import check_threshold
from ..costs import Costs
from ..errors import InputError
from ..speculative import draft_limit, propose
from ..stats import acceptance_rate, mean_accepted
from .trace import Trace, TraceGen

__all__ = ["PositionView", "position_views", "ReplayResult", "replay", "check_replayable"]


@dataclass
class PositionView:
    """One prompt's greedy output, indexed by output position (all from a trace).

    Attributes:
        prompt_tokens: prompt length (tokens).
        max_new_tokens: the budget the output was generated with.
        max_ctx: the engines' context.
        eos: the end-of-generation ids.
        out: int64 ``[N]`` the committed output (the target's greedy output).
        on_tok: int64 ``[N]`` the draft's top-1 at position j given the true prefix
            (prompt + out[:j]); -1 where the trace has no such observation.
        on_conf: float64 ``[N]`` its confidence (as the threshold test reads it); nan where
            unknown.
        off: for a position j where the draft's top-1 differs from out[j] (a rejection), the
            draft steps that followed it in the recorded round: (token, confidence) at
            j+1, j+2, ... given the prefix out[:j] + [on_tok[j]] (the draft continues from its
            own wrong token; this continuation depends only on j, not on where the round
            started).
        prefill_s: the recorded prefill seconds (target prompt pass + first token).
        finish: the recorded finish reason.
    """

    prompt_tokens: int
    max_new_tokens: int
    max_ctx: int
    eos: frozenset
    out: np.ndarray
    on_tok: np.ndarray
    on_conf: np.ndarray
    off: dict[int, list[tuple[int, float]]]
    prefill_s: float
    finish: str | None

    @property
    def known_share(self) -> float:
        """Share of positions 1..N-2 (those a candidate can occupy) with an on-trajectory observation."""
        inner = self.on_tok[1:-1]
        return float((inner >= 0).mean()) if inner.size else 1.0


def position_views(trace: Trace, max_ctx: int | None = None, eos: Iterable[int] | None = None) -> list[PositionView]:
    """Position-indexed views of a trace's greedy speculative generations.

    Generations of the same prompt (``prompt_sha1``, ``prompt_tokens``) and budget are merged
    into one view (their outputs must agree: greedy output does not depend on the policy),
    so a trace holding several policies (e.g. ``specrt bench --trace``) covers more positions.

    Observations per round at ``pos`` = s with draft steps D (module docstring):
    D[i] for i <= m is on-trajectory (D[0..i-1] were accepted, so its prefix is the true
    one): on[s+i] = D[i]. When m < n, D[m] was rejected and D[m+1..] is its continuation:
    off[s+m] = D[m+1..]. ``pre`` is on-trajectory for s-1, a ``tail`` record for its positions.

    Args:
        trace: from :func:`load_trace`.
        max_ctx, eos: override the header's (eos: the end-of-generation ids; a trace
            without ``eos_token_ids`` has its ``eos_token_id`` alone).

    Returns:
        list of :class:`PositionView` (order of first appearance).

    Raises:
        InputError: no greedy speculative generation in the trace, or two generations of
            one prompt whose outputs disagree (the trace mixes engines).
    """
    man = trace.header["manifest"]
    max_ctx = max_ctx if max_ctx is not None else int(man["max_ctx"])
    eos = frozenset(eos if eos is not None else man.get("eos_token_ids") or [man["eos_token_id"]])
    groups: dict[tuple, list[TraceGen]] = {}
    for g in trace.gens:
        if g.greedy_speculative and g.rounds:
            groups.setdefault((g.prompt_sha1, g.prompt_tokens, int(g.settings["max_new_tokens"])), []).append(g)
    if not groups:
        raise InputError(
            f"{trace.path}: no greedy speculative generation with rounds in the trace; replay needs one recorded with "
            "temperature 0 and speculation on (e.g. `specrt tune --trace FILE`)"
        )
    views = []
    for (_, n_prompt, budget), gs in groups.items():
        out = _agreed_output(trace, gs)
        on_tok, on_conf, off = _observations(gs, len(out))
        views.append(
            PositionView(
                prompt_tokens=n_prompt,
                max_new_tokens=budget,
                max_ctx=max_ctx,
                eos=eos,
                out=np.asarray(out, np.int64),
                on_tok=on_tok,
                on_conf=on_conf,
                off=off,
                prefill_s=float(np.mean([g.prefill_s for g in gs])),
                finish=gs[0].finish,
            )
        )
    return views


def _agreed_output(trace: Trace, gs: list[TraceGen]) -> list[int]:
    """The longest output of one prompt's generations, which must all be prefixes of it.

    Raises:
        InputError: two generations disagree (the trace mixes engines).
    """
    outs = [g.tokens for g in gs]
    out = max(outs, key=len)
    for o, g in zip(outs, gs):
        if o != out[: len(o)]:
            j = next(i for i, (a, b) in enumerate(zip(o, out)) if a != b)
            raise InputError(
                f"{trace.path}: generations {gs[0].gen} and {g.gen} of one prompt disagree at output position {j}; "
                "greedy outputs must not depend on the policy (does the trace mix engines?)"
            )
    return out


def _observations(gs: list[TraceGen], n: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(on_tok, on_conf, off) of :class:`PositionView` from one prompt's rounds (rules in
    :func:`position_views`)."""
    on_tok = np.full(n, -1, np.int64)
    on_conf = np.full(n, np.nan)
    off: dict[int, list[tuple[int, float]]] = {}

    def see(j, tok, conf):
        if 0 <= j < n and on_tok[j] < 0:
            on_tok[j], on_conf[j] = tok, conf

    for g in gs:
        for r in g.rounds:
            s = r.pos
            if r.pre is not None:
                see(s - 1, *r.pre)
            for i in range(min(r.m + 1, len(r.draft))):
                see(s + i, *r.draft[i])
            if r.m < r.n:
                cont = list(r.draft[r.m + 1 :])
                if len(cont) > len(off.get(s + r.m, ())):
                    off[s + r.m] = cont
                else:
                    off.setdefault(s + r.m, cont)
        if g.tail is not None:
            for i, pred in enumerate(g.tail[1]):
                see(g.tail[0] + i, *pred)
    return on_tok, on_conf, off


@dataclass
class ReplayResult:
    """What :func:`replay` predicts for one policy over a set of views.

    Attributes:
        k_max, threshold: the policy.
        passes: target passes after the prefill (= rounds).
        proposed, accepted: candidates proposed / accepted in all.
        draft_calls: draft model calls (each draft step is one call).
        new_tokens: output tokens (the same under every policy).
        accepted_hist: passes by accepted length m (index m, length k_max + 1).
        q_hist: passes by verification width q (index q, length k_max + 2).
        seconds, baseline_seconds: cost-model time of the policy and of target-only decoding
            (None without costs).
        tokens_per_second, speedup: new_tokens / seconds; baseline_seconds / seconds.
        approximated: how many values the replay had to approximate:
            ``unknown_position`` (an on-trajectory position the trace never observed) and
            ``missing_continuation`` (a draft step after a rejection that no recorded
            round reached).
    """

    k_max: int
    threshold: float
    passes: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_calls: int = 0
    new_tokens: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    q_hist: list[int] = field(default_factory=list)
    seconds: float | None = None
    baseline_seconds: float | None = None
    approximated: dict[str, int] = field(default_factory=lambda: {"unknown_position": 0, "missing_continuation": 0})

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (nan when nothing was proposed; :func:`~specrt.runtime.stats.acceptance_rate`)."""
        return acceptance_rate(self.accepted, self.proposed)

    @property
    def mean_accepted(self) -> float:
        """Mean accepted candidates per pass (:func:`~specrt.runtime.stats.mean_accepted`)."""
        return mean_accepted(self.accepted, self.passes)

    @property
    def tokens_per_second(self) -> float | None:
        """Predicted tokens/s (None without costs)."""
        return self.new_tokens / self.seconds if self.seconds else None

    @property
    def speedup(self) -> float | None:
        """Predicted speedup over target-only decoding (None without costs)."""
        return self.baseline_seconds / self.seconds if self.seconds else None

    def as_dict(self) -> dict:
        """JSON-ready dict (properties included)."""
        d = dict(self.__dict__)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted=self.mean_accepted, tokens_per_second=self.tokens_per_second, speedup=self.speedup)
        return d


def replay(views: Iterable[PositionView], k_max: int, threshold: float, costs: Costs | None = None) -> ReplayResult:
    """Predict a greedy (k_max, threshold) policy from recorded position views, without models.

    Walks the policy's rounds over each view as the decode loop does: a round at output
    index c drafts with :func:`~specrt.runtime.speculative.propose` (the greedy threshold
    rule, at most ``draft_limit(k_max, budget - c, prompt + c, max_ctx)`` candidates, EOS)
    over the recorded steps (:func:`_recorded_steps`); it accepts the leading candidates
    that equal the output, commits them plus the target's token and moves on; the output
    ends at EOS, at the budget, at the context, or where the recorded output ends.

    Exact (given the trace): the output, every on-trajectory draft top-1 and confidence the
    trace observed, and hence, with a wide recording (k_max = the engine's maximum,
    threshold 0), for every policy with k_max <= the recorded one: the accepted length of
    every pass, passes, proposals, ``accepted_hist``; for threshold-0 policies also ``q``
    and draft calls except where a draft step after a rejection proposes EOS beyond the
    recorded continuation. Approximated, and counted in ``approximated``:

    * a draft step after a rejection (off-trajectory) that no recorded round reached: its
      confidence is taken as the on-trajectory confidence at that position (or the median
      on-trajectory confidence when that is unknown too) and its token as not EOS. This
      matters only for threshold > 0 (where drafting continues after a rejection until the
      confidence falls below the threshold) and only for q, draft calls and the cost, never
      for the accepted lengths (candidates after a rejection are never accepted);
    * an on-trajectory position the trace never observed (only in generations closed early,
      e.g. by a stop string, which have no ``tail`` record, or recorded with a threshold):
      taken as a rejection with the median confidence.

    Floating point: the recorded confidences come from draft calls of the recorded widths
    (q = 1 steps, a 2-token feed after a full acceptance, the prompt feed); the policy's own
    run may compute a position with another width, whose float32 results can differ in the
    last bits. A confidence within ~1e-6 of the threshold, or a draft top-1 tie, could then
    go the other way; nothing else differs.

    Cost model (when ``costs`` is given): time = recorded prefill + per pass
    ``draft_calls * costs.draft_s_per_call + costs.target(q)``; target-only time = prefill +
    (N - 1) * ``costs.target(1)``. It leaves out the loop's Python work per step and counts
    the first round's draft prompt feed as one q = 1 call.

    Args:
        views: from :func:`position_views`.
        k_max: candidates per pass at most (>= 1).
        threshold: greedy draft-confidence threshold in [0, 1].
        costs: per-call :class:`Costs` (None: no time prediction).

    Returns:
        :class:`ReplayResult`.

    Raises:
        InputError: k_max < 1 or threshold outside [0, 1].
    """
    if isinstance(k_max, bool) or not isinstance(k_max, (int, np.integer)) or k_max < 1:
        raise InputError(f"k_max={k_max!r}; k_max must be an integer >= 1", "k_max")
    threshold = check_threshold(threshold)
    res = ReplayResult(int(k_max), threshold, accepted_hist=[0] * (k_max + 1), q_hist=[0] * (k_max + 2))
    seconds = base_seconds = 0.0
    for v in views:
        res.new_tokens += len(v.out)
        seconds += v.prefill_s + _replay_view(v, res, costs)
        base_seconds += v.prefill_s + (len(v.out) - 1) * costs.target(1) if costs is not None and len(v.out) > 1 else v.prefill_s
    if costs is not None:
        res.seconds, res.baseline_seconds = seconds, base_seconds
    return res


def _replay_view(v: PositionView, res: ReplayResult, costs: Costs | None) -> float:
    """The rounds of ``res``'s policy over one recorded generation (:func:`replay`), counted
    into ``res``; returns their predicted seconds after the prefill (0 without ``costs``)."""
    out, n_out, n_prompt = v.out, len(v.out), v.prompt_tokens
    known = v.on_conf[v.on_tok >= 0]
    med = float(np.median(known)) if known.size else 0.0
    seconds = 0.0
    c = 1
    done = int(out[0]) in v.eos or v.max_new_tokens <= 1 or n_prompt + 1 >= v.max_ctx or n_out <= 1
    while not done:
        n_max = draft_limit(res.k_max, v.max_new_tokens - c, n_prompt + c, v.max_ctx)
        pulled: list = []
        cands, _ = propose(_recorded_steps(v, c, med, res.approximated, pulled), n_max, res.threshold, v.eos)
        m = next((i for i, t in enumerate(cands) if c + i >= n_out or t != out[c + i]), len(cands))
        res.passes += 1
        res.proposed += len(cands)
        res.accepted += m
        res.draft_calls += len(pulled)
        res.accepted_hist[m] += 1
        res.q_hist[len(cands) + 1] += 1
        if costs is not None:
            seconds += len(pulled) * costs.draft_s_per_call + costs.target(len(cands) + 1)
        new = out[c : c + m + 1]
        c += m + 1
        done = any(int(t) in v.eos for t in new) or c >= v.max_new_tokens or n_prompt + c >= v.max_ctx or c >= n_out
    return seconds


def _recorded_steps(v: PositionView, c: int, med: float, approx: dict, pulled: list) -> Iterator[tuple[int, float]]:
    """The draft's (token, confidence) steps of a round starting at output index c, from
    the recordings: on the true prefix until a proposed step differs from the output,
    then the recorded continuation after that rejection. Unrecorded values are
    approximated (see :func:`replay`) and counted in ``approx``; every step pulled is
    appended to ``pulled`` (one draft call each)."""
    p, rej = c, None
    while True:
        if rej is None:
            if p < len(v.out) and v.on_tok[p] >= 0:
                step = int(v.on_tok[p]), float(v.on_conf[p])
            else:
                step = -2, med
                approx["unknown_position"] += 1
        else:
            cont, i = v.off.get(rej, ()), p - rej - 1
            if i < len(cont):
                step = cont[i]
            else:
                step = -2, float(v.on_conf[p]) if p < len(v.out) and v.on_tok[p] >= 0 else med
                approx["missing_continuation"] += 1
        pulled.append(step)
        yield step
        # resumed: the step was proposed and drafting goes on
        if rej is None and (p >= len(v.out) or step[0] != v.out[p]):
            rej = p
        p += 1


def check_replayable(trace: Trace, k_max: int, threshold: float) -> None:
    """Refuse a policy a trace cannot predict: k_max above the largest recorded k_max, or a
    threshold below the smallest recorded one (those rounds stopped before the steps the
    policy would take).

    Raises:
        InputError: naming the value and what the trace allows.
    """
    gs = [g for g in trace.gens if g.greedy_speculative]
    if not gs:
        raise InputError(f"{trace.path}: no greedy speculative generation in the trace (replay is greedy only)")
    kmax = max(int(g.settings["k_max"]) for g in gs)
    thmin = min(float(g.settings["threshold"]) for g in gs)
    if k_max > kmax:
        raise InputError(
            f"k_max={k_max}; this trace was recorded with k_max <= {kmax}, so it can predict k_max 1..{kmax} only (record with the engine's largest k_max)"
        )
    if threshold < thmin:
        raise InputError(
            f"threshold={threshold:g}; this trace was recorded with threshold >= {thmin:g}, so it can predict thresholds >= {thmin:g} only (record with threshold 0)"
        )
