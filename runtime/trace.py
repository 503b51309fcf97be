"""Replayable traces: what every round did, recorded so that another confidence-threshold /
k_max policy can be evaluated offline, without running the models.

Recording (opt-in: ``Engine.generate(..., trace=writer)``, ``specrt generate --trace FILE``,
``specrt bench --trace FILE``, ``specrt tune --trace FILE``). A trace is JSON Lines:

line 1, the header::

    {"kind": "specrt-trace", "version": 1, "engine": "<folder>",
     "manifest": {"name", "pair_sha256", "vocab_size", "eos_token_id", "k_min", "k_max",
                  "max_ctx", "draft": {dims}, "target": {dims}},
     "costs": null | {"draft_s_per_call": s, "target_s_by_q": {"1": s, ...}, "past": L, "source": ...},
     "note": str, "created_unix": t}

then per generation one ``gen`` record, one ``round`` record per round, at most one ``tail``
record and one ``end`` record::

    {"rec": "gen", "gen": i, "prompt_tokens": n, "prompt_sha1": hex, "first": token,
     "prefill_s": s, "settings": {"max_new_tokens", "k_max", "threshold", "speculative",
     "temperature", "top_k", "top_p", "seed", "strategy", "confidence_temperature"}}
    {"rec": "round", "gen": i, "pos": p, "pre": [tok, conf] | null,
     "draft": [[tok, conf], ...], "n": n, "m": m, "q": n + 1, "commit": [tokens],
     "draft_calls": c, "draft_s": s, "target_s": s}
    {"rec": "tail", "gen": i, "pos": j, "draft": [[tok, conf], ...]}
    {"rec": "end", "gen": i, "new_tokens": N, "finish": "stop" | "length" | "closed", "total_s": s}

``pos`` is the output index of the round's first candidate (= tokens committed so far; the
first output token comes from the prefill, so rounds start at 1). ``draft`` lists every
draft step of the round: the top-1 token and the confidence the threshold test read
(softmax(logits / T) top-1 with T = ``confidence_temperature``; sampling: the warped q(x)),
the n proposed candidates and, when drafting stopped at the threshold, the one below it.
``pre`` is the draft's (top-1, confidence) for the pending token ``pos - 1`` when the
round's draft feed had two or more tokens (after a round that accepted every candidate):
computed anyway by that call, read only when tracing. ``q`` is the width of the
verification pass, ``commit`` the tokens the round committed (accepted + correction or
bonus, cut after EOS). Times in seconds (``time.perf_counter``). ``tail``: after the last
round of a greedy speculative generation, the draft's predictions (top-1, confidence) of the
committed tokens it had not seen, at output positions j, j+1, ...: one extra draft call,
made only when tracing and counted in neither ``draft_calls`` nor ``draft_s`` (without it
the position after a final full acceptance would be unknown to a replay).

Offline replay (:func:`replay`), greedy only: greedy acceptance of a candidate depends only
on the prefix, and the output is the target's greedy output under every policy. So a trace
gives, per output position j, the draft's top-1 and confidence *given the true prefix*
(:class:`PositionView`), and any policy can be walked over those positions. See
:func:`replay` for exactly which quantities are exact and which are approximated.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .errors import InputError
from .speculative import draft_limit

TRACE_KIND = "specrt-trace"
TRACE_VERSION = 1


# ---- costs -------------------------------------------------------------------------------
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
    """

    draft_s_per_call: float
    target_s_by_q: dict[int, float]
    past: int | None = None
    source: str = "measured"

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
        return Costs(d_s, by_q, d.get("past"), d.get("source", "measured"))


# ---- recording -----------------------------------------------------------------------------
def manifest_identity(manifest) -> dict:
    """What a trace header records about the engine pair (no file is read).

    ``pair_sha256`` is the SHA-256 of the draft's, target's and tokenizer's recorded file
    hashes: it identifies the pair and does not change when only ``defaults`` change.
    """
    pair = hashlib.sha256((manifest.draft.sha256 + manifest.target.sha256 + manifest.tokenizer_sha256).encode()).hexdigest()

    def dims(e):
        return dict(family=e.family, n_layers=e.n_layers, hidden=e.hidden, n_heads=e.n_heads, n_kv_heads=e.n_kv_heads, params=e.params)

    return dict(
        name=manifest.name,
        pair_sha256=pair,
        vocab_size=manifest.vocab_size,
        eos_token_id=manifest.eos_token_id,
        k_min=manifest.k_min,
        k_max=manifest.k_max,
        max_ctx=manifest.max_ctx,
        draft=dims(manifest.draft),
        target=dims(manifest.target),
    )


def prompt_key(prompt: Sequence[int]) -> str:
    """SHA-1 hex of the prompt ids as little-endian int64 (identifies a prompt in a trace)."""
    return hashlib.sha1(np.asarray(prompt, dtype="<i8").tobytes()).hexdigest()


class TraceWriter:
    """Records generations as a JSONL trace (module docstring); pass it as
    ``Engine.generate(prompt, config, trace=writer)``.

    The round loop calls :meth:`begin` after the prefill, appends ``(token, confidence)``
    to :attr:`draft` per draft step, sets :attr:`pre`, and calls :meth:`round` per round;
    :meth:`end` (called by the Engine after the generation) writes the generation's
    records. Per round it only appends a tuple to a list; JSON encoding and file writes
    happen in :meth:`end`, outside the timed loop.

    Args:
        path: the JSONL file to write (parent folders are created; an existing file is
            replaced).
        engine: the :class:`~specrt.runtime.generator.Engine` (its folder and manifest go
            into the header).
        costs: measured per-call :class:`Costs` for the header (None: unknown).
        note: free text for the header.

    Raises:
        InputError: the file cannot be opened for writing.
    """

    def __init__(self, path: str | Path, engine, costs: Costs | None = None, note: str = ""):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "w", encoding="utf-8")
        except OSError as e:
            raise InputError(f"cannot write trace file {self.path}: {e.strerror}") from None
        header = dict(
            kind=TRACE_KIND,
            version=TRACE_VERSION,
            engine=str(engine.folder),
            manifest=manifest_identity(engine.manifest),
            costs=costs.to_json() if costs is not None else None,
            note=note,
            created_unix=time.time(),
        )
        self._f.write(json.dumps(header) + "\n")
        self._f.flush()
        self.generations = 0
        self.draft: list[tuple[int, float]] = []
        self.pre: tuple[int, float] | None = None
        self._gen: dict | None = None
        self._rounds: list[tuple] = []
        self._tail: tuple | None = None
        self._last = (0.0, 0.0, 0)

    # -- hooks called by the round loop --
    def begin(self, prompt: Sequence[int], cfg, first: int, stats) -> None:
        """Start a generation (after its prefill). An unfinished previous one (a stream
        closed early) is written with ``finish: "closed"``."""
        if self._gen is not None:
            self._flush("closed", None, None)
        self._gen = dict(
            rec="gen",
            gen=self.generations,
            prompt_tokens=len(prompt),
            prompt_sha1=prompt_key(prompt),
            first=int(first),
            prefill_s=stats.prefill_seconds,
            settings=dict(
                max_new_tokens=cfg.max_new_tokens,
                k_max=cfg.k_max,
                threshold=cfg.threshold,
                speculative=cfg.speculative,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                seed=cfg.seed,
                strategy=getattr(cfg, "strategy", "full"),
                confidence_temperature=getattr(cfg, "confidence_temperature", None) or 1.0,
            ),
        )
        self._rounds, self._tail = [], None
        self.draft, self.pre = [], None
        self._last = (stats.draft_seconds, stats.target_seconds, stats.draft_calls)

    def round(self, pos: int, n: int, m: int, commit: list[int], stats) -> None:
        """One round: first candidate at output index ``pos``, ``n`` proposed, ``m``
        accepted, ``commit`` the committed tokens; timings are the deltas of ``stats``."""
        d0, t0, c0 = self._last
        self._last = last = (stats.draft_seconds, stats.target_seconds, stats.draft_calls)
        self._rounds.append((pos, self.pre, self.draft, n, m, list(commit), last[2] - c0, last[0] - d0, last[1] - t0))
        self.draft, self.pre = [], None

    def tail(self, pos: int, preds: list[tuple[int, float]]) -> None:
        """The draft's (top-1, confidence) at output positions ``pos, pos+1, ...`` given the
        committed prefix, computed after the last round (tracing only)."""
        self._tail = (pos, preds)

    def end(self, result) -> None:
        """Write the current generation's records (``result``: its GenerationResult)."""
        if self._gen is not None:
            self._flush(result.finish_reason, len(result.tokens), result.stats.total_seconds)

    # -- file --
    def _flush(self, finish: str, new_tokens: int | None, total_s: float | None) -> None:
        g = self._gen["gen"]
        if new_tokens is None:
            new_tokens = 1 + sum(len(r[5]) for r in self._rounds)
        lines = [json.dumps(self._gen)]
        for pos, pre, draft, n, m, commit, calls, ds, ts in self._rounds:
            lines.append(
                json.dumps(
                    dict(
                        rec="round", gen=g, pos=pos, pre=None if pre is None else [int(pre[0]), float(pre[1])],
                        draft=[[int(t), float(c)] for t, c in draft], n=n, m=m, q=n + 1,
                        commit=[int(t) for t in commit], draft_calls=calls, draft_s=ds, target_s=ts,
                    )
                )
            )
        if self._tail is not None:
            pos, preds = self._tail
            lines.append(json.dumps(dict(rec="tail", gen=g, pos=pos, draft=[[int(t), float(c)] for t, c in preds])))
        lines.append(json.dumps(dict(rec="end", gen=g, new_tokens=new_tokens, finish=finish, total_s=total_s)))
        self._f.write("\n".join(lines) + "\n")
        self._f.flush()
        self._gen, self._rounds, self._tail = None, [], None
        self.generations += 1

    def close(self) -> None:
        """Write an unfinished generation (as ``closed``) and close the file (idempotent)."""
        if self._gen is not None:
            self._flush("closed", None, None)
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- reading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRound:
    """One ``round`` record (fields as in the module docstring; ``draft`` as (token, conf) pairs)."""

    pos: int
    pre: tuple[int, float] | None
    draft: tuple[tuple[int, float], ...]
    n: int
    m: int
    q: int
    commit: tuple[int, ...]
    draft_calls: int
    draft_s: float
    target_s: float


@dataclass
class TraceGen:
    """One generation of a trace: its ``gen`` record, rounds and ``end`` record."""

    gen: int
    prompt_tokens: int
    prompt_sha1: str
    first: int
    prefill_s: float
    settings: dict
    rounds: list[TraceRound] = field(default_factory=list)
    tail: tuple[int, tuple[tuple[int, float], ...]] | None = None
    new_tokens: int | None = None
    finish: str | None = None
    total_s: float | None = None

    @property
    def tokens(self) -> list[int]:
        """The committed output tokens (first token + every round's ``commit``)."""
        out = [self.first]
        for r in self.rounds:
            out.extend(r.commit)
        return out

    @property
    def greedy_speculative(self) -> bool:
        """Recorded with speculative greedy decoding (what :func:`replay` can use)."""
        return bool(self.settings.get("speculative", True)) and not self.settings.get("temperature", 0.0)


@dataclass
class Trace:
    """A parsed trace file: ``header`` (dict) and ``gens`` (:class:`TraceGen` list)."""

    path: Path
    header: dict
    gens: list[TraceGen]

    @property
    def costs(self) -> Costs | None:
        """The header's measured :class:`Costs`, or None when it has none."""
        c = self.header.get("costs")
        return Costs.from_json(c, f"{self.path}: header costs") if c else None


def _need(obj: dict, key: str, types, where: str):
    """``obj[key]`` if it has one of ``types`` (never a bool), else InputError naming it."""
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, types):
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise InputError(f"{where}: field {key!r} is {v!r}; expected {names}")
    return v


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace file written by :class:`TraceWriter`.

    Returns:
        :class:`Trace`.

    Raises:
        InputError: the file is missing or unreadable, a line is not JSON or not a
            trace record (named ``FILE:LINE`` with the field), the header is not a
            ``specrt-trace`` of version 1, a record refers to an unknown generation, or the
            file has no generation.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"trace file {path} does not exist; record one with `specrt tune --trace FILE` or `specrt bench --trace FILE`")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read trace file {path}: {e}") from None
    header = None
    gens: dict[int, TraceGen] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg}); a trace line is one JSON object") from None
        if not isinstance(obj, dict):
            raise InputError(f"{where}: a trace line must be a JSON object, got {type(obj).__name__}")
        if header is None:
            if obj.get("kind") != TRACE_KIND or obj.get("version") != TRACE_VERSION:
                raise InputError(
                    f"{where}: not a trace header (kind={obj.get('kind')!r}, version={obj.get('version')!r}); "
                    f"the first line must have kind {TRACE_KIND!r} and version {TRACE_VERSION}"
                )
            _need(obj, "manifest", dict, where)
            header = obj
            continue
        rec = obj.get("rec")
        if rec == "gen":
            g = _need(obj, "gen", int, where)
            gens[g] = TraceGen(
                gen=g,
                prompt_tokens=_need(obj, "prompt_tokens", int, where),
                prompt_sha1=str(obj.get("prompt_sha1", "")),
                first=_need(obj, "first", int, where),
                prefill_s=float(_need(obj, "prefill_s", (int, float), where)),
                settings=_need(obj, "settings", dict, where),
            )
            for key in ("max_new_tokens", "k_max", "threshold"):
                if key not in gens[g].settings:
                    raise InputError(f"{where}: settings lack {key!r}")
        elif rec == "round":
            g = _need(obj, "gen", int, where)
            if g not in gens:
                raise InputError(f"{where}: round of generation {g}, which has no gen record before it")
            draft = _need(obj, "draft", list, where)
            pre = obj.get("pre")
            pairs = []
            for x in draft + ([pre] if pre is not None else []):
                if not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], (int, float))):
                    raise InputError(f"{where}: draft entries and pre must be [token, confidence] pairs; got {x!r}")
                pairs.append((int(x[0]), float(x[1])))
            n, m = _need(obj, "n", int, where), _need(obj, "m", int, where)
            commit = _need(obj, "commit", list, where)
            if not 0 <= m <= n or n > len(draft) or not commit or not all(isinstance(t, int) for t in commit):
                raise InputError(f"{where}: inconsistent round (n={n}, m={m}, {len(draft)} draft steps, commit={commit!r}); need 0 <= m <= n <= len(draft) and a non-empty commit of ints")
            gens[g].rounds.append(
                TraceRound(
                    pos=_need(obj, "pos", int, where),
                    pre=pairs[-1] if pre is not None else None,
                    draft=tuple(pairs[: len(draft)]),
                    n=n,
                    m=m,
                    q=int(obj.get("q", n + 1)),
                    commit=tuple(commit),
                    draft_calls=_need(obj, "draft_calls", int, where),
                    draft_s=float(_need(obj, "draft_s", (int, float), where)),
                    target_s=float(_need(obj, "target_s", (int, float), where)),
                )
            )
        elif rec == "tail":
            g = _need(obj, "gen", int, where)
            if g not in gens:
                raise InputError(f"{where}: tail of generation {g}, which has no gen record before it")
            preds = _need(obj, "draft", list, where)
            if not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], (int, float)) for x in preds):
                raise InputError(f"{where}: tail draft entries must be [token, confidence] pairs")
            gens[g].tail = (_need(obj, "pos", int, where), tuple((int(t), float(c)) for t, c in preds))
        elif rec == "end":
            g = _need(obj, "gen", int, where)
            if g not in gens:
                raise InputError(f"{where}: end of generation {g}, which has no gen record before it")
            gens[g].new_tokens = obj.get("new_tokens")
            gens[g].finish = obj.get("finish")
            gens[g].total_s = obj.get("total_s")
        else:
            raise InputError(f"{where}: rec={rec!r}; a trace record is 'gen', 'round', 'tail' or 'end'")
    if header is None:
        raise InputError(f"{path}: empty trace (no header line)")
    if not gens:
        raise InputError(f"{path}: the trace has no generation")
    return Trace(path, header, [gens[g] for g in sorted(gens)])


def costs_from_rounds(trace: Trace) -> Costs:
    """Per-call costs estimated from a trace's own round timings (when its header has no
    measured costs): draft seconds per call = total draft seconds / draft calls; target
    seconds per width q = the median of the rounds' target seconds at that q. Both include
    the loop's per-call Python work, which measured costs do not.

    Raises:
        InputError: no round with draft calls.
    """
    d_s = sum(r.draft_s for g in trace.gens for r in g.rounds)
    calls = sum(r.draft_calls for g in trace.gens for r in g.rounds)
    by_q: dict[int, list[float]] = {}
    for g in trace.gens:
        for r in g.rounds:
            by_q.setdefault(r.q, []).append(r.target_s)
    if not calls:
        raise InputError(f"{trace.path}: no draft call in the trace, cannot estimate the draft's cost; pass measured costs")
    return Costs(d_s / calls, {q: float(np.median(v)) for q, v in by_q.items()}, None, "trace timings")


# ---- position view and replay ------------------------------------------------------------------
@dataclass
class PositionView:
    """One prompt's greedy output, indexed by output position (all from a trace).

    Attributes:
        prompt_tokens: prompt length (tokens).
        max_new_tokens: the budget the output was generated with.
        max_ctx: the engines' context.
        eos: EOS id.
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
    eos: int
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


def position_views(trace: Trace, max_ctx: int | None = None, eos: int | None = None) -> list[PositionView]:
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
        max_ctx, eos: override the header's.

    Returns:
        list of :class:`PositionView` (order of first appearance).

    Raises:
        InputError: no greedy speculative generation in the trace, or two generations of
            one prompt whose outputs disagree (the trace mixes engines).
    """
    man = trace.header["manifest"]
    max_ctx = max_ctx if max_ctx is not None else int(man["max_ctx"])
    eos = eos if eos is not None else int(man["eos_token_id"])
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
    for (key, n_prompt, budget), gs in groups.items():
        outs = [g.tokens for g in gs]
        out = max(outs, key=len)
        for o, g in zip(outs, gs):
            if o != out[: len(o)]:
                j = next(i for i, (a, b) in enumerate(zip(o, out)) if a != b)
                raise InputError(
                    f"{trace.path}: generations {gs[0].gen} and {g.gen} of one prompt disagree at output position {j}; "
                    "greedy outputs must not depend on the policy (does the trace mix engines?)"
                )
        n = len(out)
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
        views.append(
            PositionView(
                prompt_tokens=n_prompt, max_new_tokens=budget, max_ctx=max_ctx, eos=eos, out=np.asarray(out, np.int64),
                on_tok=on_tok, on_conf=on_conf, off=off, prefill_s=float(np.mean([g.prefill_s for g in gs])),
                finish=gs[0].finish,
            )
        )
    return views


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
        """accepted / proposed (nan when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else math.nan

    @property
    def mean_accepted(self) -> float:
        """Mean accepted candidates per pass."""
        return self.accepted / self.passes if self.passes else math.nan

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
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted=self.mean_accepted,
                 tokens_per_second=self.tokens_per_second, speedup=self.speedup)
        return d


def replay(views: Iterable[PositionView], k_max: int, threshold: float, costs: Costs | None = None) -> ReplayResult:
    """Predict a greedy (k_max, threshold) policy from recorded position views, without models.

    Walks the policy's rounds over each view exactly as the Engine's loop does: a round at
    output index c drafts up to ``draft_limit(k_max, budget - c, prompt + c, max_ctx)``
    candidates, stopping before a step whose confidence is below ``threshold`` (the greedy
    rule), at the limit, or after an EOS proposal; it accepts the leading candidates that
    equal the output, commits them plus the target's token and moves on; the output ends
    at EOS, at the budget, at the context, or where the recorded output ends.

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
        raise InputError(f"k_max={k_max!r}; k_max must be an integer >= 1")
    if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise InputError(f"threshold={threshold!r}; threshold must be a number in [0, 1]")
    res = ReplayResult(int(k_max), float(threshold), accepted_hist=[0] * (k_max + 1), q_hist=[0] * (k_max + 2))
    seconds = base_seconds = 0.0
    for v in views:
        out, on_tok, on_conf, eos = v.out, v.on_tok, v.on_conf, v.eos
        n_out, n_prompt, budget, ctx = len(out), v.prompt_tokens, v.max_new_tokens, v.max_ctx
        known = on_conf[on_tok >= 0]
        med = float(np.median(known)) if known.size else 0.0
        res.new_tokens += n_out
        seconds += v.prefill_s
        base_seconds += v.prefill_s
        if costs is not None and n_out > 1:
            base_seconds += (n_out - 1) * costs.target(1)
        c = 1
        done = out[0] == eos or budget <= 1 or n_prompt + 1 >= ctx or n_out <= 1
        while not done:
            n_max = draft_limit(k_max, budget - c, n_prompt + c, ctx)
            n = calls = 0
            rej = None
            if n_max:
                calls = 1
                p = c
                while True:
                    if rej is None:
                        if p < n_out and on_tok[p] >= 0:
                            tok, conf = int(on_tok[p]), float(on_conf[p])
                        else:
                            tok, conf = -2, med
                            res.approximated["unknown_position"] += 1
                    else:
                        cont = v.off.get(rej, ())
                        i = p - rej - 1
                        if i < len(cont):
                            tok, conf = cont[i]
                        else:
                            tok = -2
                            conf = float(on_conf[p]) if p < n_out and on_tok[p] >= 0 else med
                            res.approximated["missing_continuation"] += 1
                    if conf < threshold:
                        break
                    n += 1
                    if rej is None and (p >= n_out or tok != out[p]):
                        rej = p
                    if n == n_max or tok == eos:
                        break
                    calls += 1
                    p += 1
            m = n if rej is None else rej - c
            res.passes += 1
            res.proposed += n
            res.accepted += m
            res.draft_calls += calls
            res.accepted_hist[m] += 1
            res.q_hist[n + 1] += 1
            if costs is not None:
                seconds += calls * costs.draft_s_per_call + costs.target(n + 1)
            new = out[c : c + m + 1]
            c += m + 1
            done = bool((new == eos).any()) or c >= budget or n_prompt + c >= ctx or c >= n_out
    if costs is not None:
        res.seconds, res.baseline_seconds = seconds, base_seconds
    return res


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
        raise InputError(f"k_max={k_max}; this trace was recorded with k_max <= {kmax}, so it can predict k_max 1..{kmax} only (record with the engine's largest k_max)")
    if threshold < thmin:
        raise InputError(f"threshold={threshold:g}; this trace was recorded with threshold >= {thmin:g}, so it can predict thresholds >= {thmin:g} only (record with threshold 0)")
