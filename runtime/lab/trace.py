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

Offline replay of other policies from a trace: :mod:`specrt.runtime.lab.replay`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..costs import Costs
from ..errors import InputError
from ..machine import this_machine

__all__ = ["Costs", "TraceWriter", "Trace", "TraceGen", "TraceRound", "load_trace", "costs_from_rounds", "manifest_identity", "prompt_key"]

TRACE_KIND = "specrt-trace"
TRACE_VERSION = 1
# GenerationConfig fields recorded in each generation's settings
SETTINGS = ("max_new_tokens", "k_max", "threshold", "speculative", "temperature", "top_k", "top_p", "seed", "strategy", "confidence_temperature")


# ---- costs -------------------------------------------------------------------------------
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
        eos_token_ids=sorted(manifest.stop_ids()),
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

    The Engine calls :meth:`begin` before a generation, :meth:`add` with each of its
    :class:`~specrt.runtime.decode.Round` records (the loop records the draft's pending-token
    and tail predictions when a trace is given) and :meth:`end` after it. Per round it only
    keeps the record; JSON encoding and file writes happen in :meth:`end`, outside the
    timed loop.

    Args:
        path: the JSONL file to write (parent folders are created; an existing file is
            replaced).
        engine: the :class:`~specrt.runtime.engine.Engine` (its folder and manifest go
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
            raise InputError(f"cannot write trace file {self.path}: {e.strerror}", "trace") from None
        header = dict(
            kind=TRACE_KIND,
            version=TRACE_VERSION,
            engine=str(engine.folder),
            manifest=manifest_identity(engine.manifest),
            costs=costs.to_json() if costs is not None else None,
            machine=this_machine().to_json(),  # where the timings (costs, round times) were taken
            note=note,
            created_unix=time.time(),
        )
        self._f.write(json.dumps(header) + "\n")
        self._f.flush()
        self.generations = 0
        self._gen: dict | None = None
        self._rounds: list = []

    def begin(self, prompt: Sequence[int], cfg) -> None:
        """Start a generation of ``prompt`` with resolved settings ``cfg``. An unfinished
        previous one (a stream closed early) is written with ``finish: "closed"``."""
        if self._gen is not None:
            self._flush("closed", None, None)
        self._gen = dict(
            rec="gen",
            gen=self.generations,
            prompt_tokens=len(prompt),
            prompt_sha1=prompt_key(prompt),
            first=None,
            prefill_s=None,
            settings={k: getattr(cfg, k) for k in SETTINGS},
        )
        self._rounds = []

    def add(self, rec) -> None:
        """One :class:`~specrt.runtime.decode.Round` record of the current generation
        (``pos`` 0: the prefill, which gives the first token and the prefill time)."""
        if rec.pos == 0:
            self._gen.update(first=int(rec.commit[0]), prefill_s=rec.target_s)
        else:
            self._rounds.append(rec)

    def end(self, result) -> None:
        """Write the current generation's records (``result``: its GenerationResult)."""
        if self._gen is not None:
            self._flush(result.finish_reason, len(result.tokens), result.stats.total_seconds)

    def _flush(self, finish: str, new_tokens: int | None, total_s: float | None) -> None:
        g = self._gen["gen"]
        if new_tokens is None:
            new_tokens = 1 + sum(len(r.commit) for r in self._rounds)
        lines = [json.dumps(self._gen)]
        tail = None
        for r in self._rounds:
            lines.append(
                json.dumps(
                    dict(
                        rec="round",
                        gen=g,
                        pos=r.pos,
                        pre=None if r.pre is None else [int(r.pre[0]), float(r.pre[1])],
                        draft=[[int(t), float(c)] for t, c in r.steps],
                        n=r.n,
                        m=r.m,
                        q=r.n + 1,
                        commit=[int(t) for t in r.commit],
                        draft_calls=r.draft_calls,
                        draft_s=r.draft_s,
                        target_s=r.target_s,
                    )
                )
            )
            tail = r.tail or tail
        if tail is not None:
            pos, preds = tail
            lines.append(json.dumps(dict(rec="tail", gen=g, pos=pos, draft=[[int(t), float(c)] for t, c in preds])))
        lines.append(json.dumps(dict(rec="end", gen=g, new_tokens=new_tokens, finish=finish, total_s=total_s)))
        self._f.write("\n".join(lines) + "\n")
        self._f.flush()
        self._gen, self._rounds = None, []
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
        return Costs.from_json({"machine": self.header.get("machine"), **c}, f"{self.path}: header costs") if c else None


def _need(obj: dict, key: str, types, where: str):
    """``obj[key]`` if it has one of ``types`` (never a bool), else InputError naming it."""
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, types):
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise InputError(f"{where}: field {key!r} is {v!r}; expected {names}")
    return v


def _pairs(xs, where: str, what: str) -> list[tuple[int, float]]:
    """[[token, confidence], ...] as tuples, or InputError naming the record."""
    out = []
    for x in xs:
        if not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], (int, float))):
            raise InputError(f"{where}: {what} must be [token, confidence] pairs; got {x!r}")
        out.append((int(x[0]), float(x[1])))
    return out


def _gen_record(obj: dict, where: str) -> TraceGen:
    g = TraceGen(
        gen=_need(obj, "gen", int, where),
        prompt_tokens=_need(obj, "prompt_tokens", int, where),
        prompt_sha1=str(obj.get("prompt_sha1", "")),
        first=_need(obj, "first", int, where),
        prefill_s=float(_need(obj, "prefill_s", (int, float), where)),
        settings=_need(obj, "settings", dict, where),
    )
    for key in ("max_new_tokens", "k_max", "threshold"):
        if key not in g.settings:
            raise InputError(f"{where}: settings lack {key!r}")
    return g


def _round_record(obj: dict, where: str) -> TraceRound:
    draft = _need(obj, "draft", list, where)
    pre = obj.get("pre")
    pairs = _pairs(draft + ([pre] if pre is not None else []), where, "draft entries and pre")
    n, m = _need(obj, "n", int, where), _need(obj, "m", int, where)
    commit = _need(obj, "commit", list, where)
    if not 0 <= m <= n or n > len(draft) or not commit or not all(isinstance(t, int) for t in commit):
        raise InputError(
            f"{where}: inconsistent round (n={n}, m={m}, {len(draft)} draft steps, commit={commit!r}); need 0 <= m <= n <= len(draft) and a non-empty commit of ints"
        )
    return TraceRound(
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


def _header(obj: dict, where: str) -> dict:
    if obj.get("kind") != TRACE_KIND or obj.get("version") != TRACE_VERSION:
        raise InputError(
            f"{where}: not a trace header (kind={obj.get('kind')!r}, version={obj.get('version')!r}); "
            f"the first line must have kind {TRACE_KIND!r} and version {TRACE_VERSION}"
        )
    _need(obj, "manifest", dict, where)
    return obj


def _records(path: Path):
    """(where, JSON object) per non-empty line of a trace file."""
    if not path.is_file():
        raise InputError(f"trace file {path} does not exist; record one with `specrt tune --trace FILE` or `specrt bench --trace FILE`")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read trace file {path}: {e}") from None
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
        yield where, obj


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
    header = None
    gens: dict[int, TraceGen] = {}
    for where, obj in _records(path):
        if header is None:
            header = _header(obj, where)
            continue
        rec = obj.get("rec")
        if rec not in ("gen", "round", "tail", "end"):
            raise InputError(f"{where}: rec={rec!r}; a trace record is 'gen', 'round', 'tail' or 'end'")
        if rec == "gen":
            g = _gen_record(obj, where)
            gens[g.gen] = g
            continue
        g = _need(obj, "gen", int, where)
        if g not in gens:
            raise InputError(f"{where}: {rec} of generation {g}, which has no gen record before it")
        if rec == "round":
            gens[g].rounds.append(_round_record(obj, where))
        elif rec == "tail":
            preds = _pairs(_need(obj, "draft", list, where), where, "tail draft entries")
            gens[g].tail = (_need(obj, "pos", int, where), tuple(preds))
        else:
            gens[g].new_tokens, gens[g].finish, gens[g].total_s = obj.get("new_tokens"), obj.get("finish"), obj.get("total_s")
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
    return Costs(d_s / calls, {q: float(np.median(v)) for q, v in by_q.items()}, None, "trace timings", trace.header.get("machine"))
