"""The generator loop: confidence-threshold drafting, one verification pass, early stop,
rollback; plus the target-only baseline on the same backend.

One round (Leviathan et al. 2023, Algorithm 1, greedy case; confidence-threshold drafting
as in Hugging Face assisted generation's ``assistant_confidence_threshold``)::

    1. draft: feed the tokens the draft has not seen (pending included), then propose
       c_1, c_2, ... token by token; stop when the draft's top-1 probability is below
       ``threshold``, at ``k_max``, after EOS, or at the budget/context limit
       (:func:`~specrt.runtime.speculative.draft_limit`);
    2. verify: one target pass over [pending, c_1..c_n] (q = n + 1);
    3. accept left to right, stop at the first mismatch
       (:func:`~specrt.runtime.speculative.greedy_verify`);
    4. commit c_1..c_m and the target's token (correction or bonus); the KV lengths roll
       back (:func:`~specrt.runtime.speculative.rollback_lengths`).

The output equals the target's own greedy output token for token.

With ``temperature > 0`` the same loop does exact speculative *sampling*
(:mod:`~specrt.runtime.sampling`; Leviathan et al. 2023, Algorithm 1): the draft samples
each candidate from its warped distribution q, the target accepts it with probability
min(1, p/q), samples a correction from norm(max(0, p - q)) at the first rejection, or a
bonus token from p; the output follows the target's warped distribution exactly.

Verification strategies (``GenerationConfig.strategy``; the output is the same in all):

- ``full``: step 2 above, one target pass over all n + 1 positions;
- ``chunked``: the candidates are split into chunks where the product of the draft's
  confidences falls to ``chunk_bound`` (:func:`~specrt.runtime.speculative.chunk_sizes`);
  the target runs [pending + chunk 1], then each next chunk at the offset after the
  previous one only while everything so far was accepted
  (:func:`~specrt.runtime.speculative.chunk_passes`), so the passes after a rejection never run;
- ``lazy-head``: one pass of the target's body (all but the vocabulary projection,
  ``target_body.onnx``) over the n + 1 positions, then the head (``target_head.onnx``)
  block by block (:func:`~specrt.runtime.speculative.head_blocks`), stopping at the first
  rejection, so the rejected tail is never projected.

Both accept candidates in the same order and draw random numbers in the same order
(:func:`~specrt.runtime.sampling.accept_candidate`, :func:`~specrt.runtime.sampling.final_token`),
so a seed gives the same tokens whatever the strategy. A round without candidates is one
q = 1 pass of the full target in every strategy. ``Stats`` counts the target FLOPs each
strategy executed (:mod:`~specrt.runtime.flops`).
"""
from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import BackendError, InputError
from .flops import body_flops, call_flops, flop_coefficients
from .manifest import LAZY_HEAD_HINT, LAZY_HEAD_KEY, Manifest, load_manifest
from .ort_backend import OrtLazyHead, OrtModel, ThreadConfig
from .sampling import accept_candidate, check_sampling_params, final_token, sample_token, speculative_verify, warp
from .speculative import (
    DEFAULT_CHUNK_BOUND,
    STRATEGIES,
    argmax_token,
    chunk_passes,
    chunk_sizes,
    draft_limit,
    greedy_verify,
    head_blocks,
    rollback_lengths,
    top1,
)
from .textstream import IncrementalText
from .tokenizer import TextCodec

PREFILL_CHUNK = 256  # widest prefill call; longer prompts are fed in chunks


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings for one call (``None`` = the engine manifest's default).

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1); output never overshoots.
        k_max: most draft candidates per verification pass (1..manifest k_max).
        threshold: draft confidence threshold in [0, 1] (0 = fixed k_max). Greedy: drafting
            stops, without proposing it, at a token whose raw top-1 probability is below it.
            Sampling: drafting stops *after* a sampled token whose *warped* draft
            probability q(x) is below it; that token is still proposed (see
            :meth:`Engine._rounds` for why).
        speculative: False runs the target alone (the baseline), one token per pass.
        temperature: 0 = greedy (bit-identical to the greedy path); > 0 samples from the
            warped distributions (exact speculative sampling).
        top_k: keep the k most probable tokens (ties kept); 0 = off. Sampling only.
        top_p: nucleus mass in (0, 1]; 1 = off. Sampling only (applied after top-k).
        seed: seed of the call's ``numpy.random.Generator(PCG64(seed))``; None = fresh
            entropy. The same seed and settings (k_max included) give the same tokens,
            whatever k_max is; different k_max values draw different tokens from the
            same distribution.
        stop: stop strings (at most :data:`MAX_STOPS`, each a non-empty ``str`` without
            U+FFFD; a single ``str`` is taken as one stop; a list becomes a tuple). The
            output ends at the first match, even one spanning several tokens committed in
            one round: text cut before the match, tokens cut to the shortest prefix whose
            text contains it (exact rule: :mod:`specrt.runtime.textstream`);
            ``finish_reason`` "stop" and ``stop_reason`` the matched string.
        confidence_temperature: T of the draft's *confidence* in the greedy threshold test
            (the threshold is compared with softmax(draft_logits / T)[top-1]); None = the
            manifest's ``defaults["draft_confidence_temperature"]`` (written by
            ``specrt tune --calibrate``), else 1.0. Must be in [0.01, 100]. It never changes
            the proposals (the argmax), so greedy output stays the target's; 1.0 is
            bit-identical to no calibration. Sampling ignores it (its threshold reads the
            warped q(x)). See :mod:`specrt.runtime.calibration`.
        strategy: verification strategy, ``"full"``, ``"chunked"`` or ``"lazy-head"``
            (module docstring); None = the manifest's ``defaults["strategy"]``, else
            ``"full"``. The tokens are the same in all three (greedy, and sampled with one
            seed); they differ in the target work done after a rejection. ``lazy-head``
            needs an engine folder exported with the lazy-head target (the default of
            ``specrt export``) and the ort-cpu backend.
        chunk_bound: number in (0, 1]: a chunk (chunked) or head block (lazy-head) ends
            at the candidate where the product of the draft's confidences since its start
            is <= this (:func:`~specrt.runtime.speculative.chunk_sizes`; 1 = one candidate
            per chunk); None = the manifest's ``defaults["chunk_bound"]``, else 0.5.
            Ignored by ``full``.
    """

    max_new_tokens: int = 128
    k_max: int | None = None
    threshold: float | None = None
    speculative: bool = True
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    confidence_temperature: float | None = None
    strategy: str | None = None
    chunk_bound: float | None = None


MAX_STOPS = 16  # most stop strings per call


def check_stops(stop) -> tuple[str, ...]:
    """Validated stop strings as a tuple.

    Args:
        stop: a ``str`` (one stop) or a tuple/list of ``str``.

    Returns:
        ``tuple[str, ...]`` (empty: no stop strings).

    Raises:
        InputError: not a str/tuple/list, more than :data:`MAX_STOPS`, an element that is
            not a non-empty ``str``, or one containing U+FFFD (it stands for undecodable
            bytes, never for text).
    """
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (tuple, list)):
        raise InputError(f"stop={stop!r}; stop must be a string or a tuple/list of strings")
    if len(stop) > MAX_STOPS:
        raise InputError(f"stop strings: {len(stop)} given; at most {MAX_STOPS} are allowed")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InputError(f"stop string {s!r}; each stop must be a non-empty string")
        if "\ufffd" in s:
            raise InputError(f"stop string {s!r} contains U+FFFD (the replacement character for undecodable bytes); it cannot be matched")
    return tuple(stop)


@dataclass
class Stats:
    """What one generation did (times in seconds, counts in tokens or passes).

    ``accepted_hist[m]`` counts verification passes that accepted m candidates.

    Target work after prefill (the prefill is counted apart, in ``prefill_flops``):
    ``target_calls`` model runs (one per round for full; one per chunk run for chunked;
    the body runs for lazy-head, whose head runs are ``head_calls``), ``target_positions``
    positions through the target's body, ``head_rows`` rows projected to logits, and
    ``target_flops`` the FLOPs of all that (:func:`~specrt.runtime.flops.call_flops`;
    ints, counted per model run, no allocation).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    passes: int = 0  # rounds after prefill (verification or plain decode; chunked may run several target calls per round)
    draft_calls: int = 0
    accepted_hist: list[int] = field(default_factory=list)
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

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (nan when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else math.nan

    @property
    def mean_accepted(self) -> float:
        """Mean accepted candidates per verification pass."""
        return self.accepted / self.passes if self.passes else math.nan

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
        """Total wall time of the call / new tokens (seconds per committed token, prefill included)."""
        return self.total_seconds / self.new_tokens if self.new_tokens else math.nan

    @property
    def target_flops_per_token(self) -> float:
        """Target FLOPs executed after prefill / tokens committed after prefill
        (``new_tokens - 1``: the prefill commits the first); nan when there are none."""
        return self.target_flops / (self.new_tokens - 1) if self.new_tokens > 1 else math.nan

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted=self.mean_accepted,
            tokens_per_pass=self.tokens_per_pass,
            tokens_per_second=self.tokens_per_second,
            seconds_per_token=self.seconds_per_token,
            target_flops_per_token=self.target_flops_per_token,
        )
        return d


@dataclass
class GenerationResult:
    """Output of :meth:`Engine.generate` (and :attr:`Stream.result`).

    Attributes:
        tokens: generated ids (EOS included when it ended the output; after a stop string,
            the shortest prefix whose text contains the match).
        text: decoded text of ``tokens`` (special tokens left out), cut before a stop
            string's match.
        finish_reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (max_new_tokens
            or context full).
        stats: :class:`Stats` (``new_tokens`` == ``len(tokens)``).
        stop_reason: the stop string that ended the output; None when EOS ended it or
            the reason is "length".
    """

    tokens: list[int]
    text: str
    finish_reason: str
    stats: Stats
    stop_reason: str | None = None


class Stream:
    """Iterator over the text pieces of one :meth:`Engine.stream` call.

    Iterate it for non-empty ``str`` pieces (UTF-8-safe, nothing after a stop string).
    Once it is exhausted, :attr:`result` holds the :class:`GenerationResult` (tokens,
    ``text == "".join(pieces)``, finish_reason, stop_reason, stats: the usage figures a
    server reports after streaming). :meth:`close`, or leaving a ``with`` block, ends the
    generation early and frees the Engine for the next call (``result`` stays None).

    The Engine's lock is held from the first ``next()`` until exhaustion or close, so
    finish or close a stream before starting another generation on the same Engine in
    the same thread (that raises :class:`~specrt.runtime.errors.InputError` instead of
    deadlocking).

    Attributes:
        result: :class:`GenerationResult` after exhaustion, else None.
    """

    __slots__ = ("_run", "result")

    def __init__(self, run: Iterator[str]):
        self._run = run
        self.result: GenerationResult | None = None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        while True:
            try:
                piece = next(self._run)
            except StopIteration as done:
                if done.value is not None:
                    self.result = done.value
                raise StopIteration from None
            if piece:
                return piece

    def close(self) -> None:
        """Stop the generation now (idempotent); the Engine is free afterwards."""
        self._run.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _WarpedRows:
    """Target logits rows warped on first access into preallocated float64 rows, so that
    :func:`~specrt.runtime.sampling.speculative_verify` warps only the rows it reads
    (none after the first rejection). ``logits`` is set per verification pass."""

    __slots__ = ("out", "args", "logits")

    def __init__(self, out: np.ndarray, args: tuple):
        self.out, self.args, self.logits = out, args, None

    def __getitem__(self, i: int) -> np.ndarray:
        return warp(self.logits[i], *self.args, out=self.out[i])


class _LazySessions:
    """The lazy-head (body, head) sessions of one loaded engine folder: loaded by ``load``
    on first use, once, and shared by the Engine's forks (thread-safe)."""

    __slots__ = ("_load", "_lock", "_sessions")

    def __init__(self, load):
        self._load, self._lock, self._sessions = load, threading.Lock(), None

    def get(self) -> tuple:
        with self._lock:
            if self._sessions is None:
                self._sessions = self._load()
            return self._sessions


class Engine:
    """A loaded engine folder: manifest, tokenizer, and both models on onnxruntime.

    One generation at a time per Engine (it owns the KV buffers): concurrent calls from
    threads are serialised by a lock (each call's output is what it would be alone). For
    parallel generations, give each thread its own :meth:`fork` (shared sessions, own KV
    buffers) or load several Engines. A thread that starts a generation while its own
    :class:`Stream` on the same Engine is unfinished gets an InputError (not a deadlock).

    Args:
        folder: the engine folder written by ``specrt export``.
        threads: onnxruntime thread settings for both sessions.
        verify_hashes: check the files' SHA-256 against the manifest at load.
        backend: ``"ort-cpu"``, ``"ort-cuda"`` or ``"tensorrt"``; None picks the first
            usable of tensorrt, ort-cuda, ort-cpu (:mod:`specrt.runtime.backends`; the GPU
            backends are not verified on a GPU yet, see docs/GPU.md). Stored as ``backend``.

    Raises:
        EngineError: missing/half-written folder, unknown manifest version, mismatched pair,
            altered files.
        BackendError: a backend this machine or folder cannot run (the message lists the
            available ones).
    """

    def __init__(self, folder: str | Path, threads: ThreadConfig | None = None, verify_hashes: bool = True, backend: str | None = None):
        self.folder = Path(folder)
        self.manifest: Manifest = load_manifest(self.folder, verify_hashes=verify_hashes)
        m = self.manifest
        threads = threads or ThreadConfig()
        self.codec = TextCodec(self.folder / m.tokenizer_file, m.bos_token_id, m.add_bos)
        from .backends import load_models, resolve_backend

        self.backend = resolve_backend(backend, m)
        self.target, self.draft = load_models(
            self.backend, self.folder, m, threads, max(PREFILL_CHUNK, m.k_max + 1), PREFILL_CHUNK, verify_hashes
        )
        self._scratch = np.empty(m.draft.vocab_size, np.float32)
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id holding _lock (deadlock check in _rounds)
        self._flops = flop_coefficients(m.target)
        from .ort_backend import lazy_head_sessions

        # lazy-head sessions: loaded when the strategy is first used (ort-cpu only)
        folder = self.folder  # (the loader keeps no reference to the Engine)
        self._lazy_sessions = _LazySessions(lambda: lazy_head_sessions(folder, m, threads, verify_hashes))
        self._lazy: OrtLazyHead | None = None

    def fork(self) -> "Engine":
        """Another Engine over the same loaded models: the onnxruntime sessions (weights),
        manifest and tokenizer are shared, the KV buffers, work buffers and lock are its own.

        Use one fork per thread for concurrent generations: each gives exactly what the
        parent gives for the same call (greedy, or sampled with a seed), and onnxruntime
        runs the sessions for several bindings at once. Cheap: no file is read or checked;
        memory is one set of KV/logits buffers (see ``OrtModel.fork``).

        Returns:
            a new :class:`Engine`.

        Raises:
            BackendError: the backend's model objects cannot fork (only ``ort-cpu`` can;
                load another Engine there).
        """
        if not (hasattr(self.target, "fork") and hasattr(self.draft, "fork")):
            raise BackendError(f"backend {self.backend!r} cannot fork an Engine (ort-cpu can); load one Engine per concurrent generation")
        new = copy.copy(self)  # shares folder, manifest, codec, backend name ...
        # ... and gets its own per-generation state:
        new.target, new.draft = self.target.fork(), self.draft.fork()
        new._scratch = np.empty_like(self._scratch)
        new._lock = threading.Lock()
        new._owner = None
        new.__dict__.pop("_sample_bufs", None)
        new._lazy = None  # its own body/head buffers over its own KV, sessions shared
        return new

    # ---- validation ------------------------------------------------------------------
    def resolve(self, config: GenerationConfig) -> GenerationConfig:
        """Fill defaults from the manifest and validate.

        Raises:
            InputError: k_max outside 1..manifest k_max, threshold outside [0, 1],
                max_new_tokens < 1, temperature < 0, top_k < 0, top_p outside (0, 1],
                seed < 0, bad stop strings (:func:`check_stops`), confidence_temperature
                outside [0.01, 100], strategy not one of full/chunked/lazy-head,
                chunk_bound outside (0, 1], lazy-head for a folder exported without it,
                wrong types.
            BackendError: lazy-head on a backend other than ort-cpu.
        """
        m = self.manifest
        k = config.k_max if config.k_max is not None else m.defaults.get("k_max", m.k_max)
        th = config.threshold if config.threshold is not None else m.defaults.get("threshold", 0.0)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not m.k_min <= k <= m.k_max:
            raise InputError(f"k_max={k!r}; k_max must be an integer in {m.k_min}..{m.k_max}, the range these engines were built for")
        if isinstance(th, bool) or not isinstance(th, (int, float)) or not 0.0 <= th <= 1.0:
            raise InputError(f"threshold={th!r}; threshold must be a number in [0, 1]")
        n = config.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise InputError(f"max_new_tokens={n!r}; max_new_tokens must be an integer >= 1")
        check_sampling_params(config.temperature, config.top_k, config.top_p, config.seed)
        stop = check_stops(config.stop)
        ct = config.confidence_temperature
        if ct is None:
            ct = m.defaults.get("draft_confidence_temperature", 1.0)
        if isinstance(ct, bool) or not isinstance(ct, (int, float)) or not 0.01 <= ct <= 100.0:
            raise InputError(f"confidence_temperature={ct!r}; the draft confidence temperature must be a number in [0.01, 100] (1 = uncalibrated)")
        st = config.strategy if config.strategy is not None else m.defaults.get("strategy", "full")
        if not isinstance(st, str) or st not in STRATEGIES:
            raise InputError(f"strategy={st!r}; strategy must be one of {', '.join(STRATEGIES)}")
        cb = config.chunk_bound if config.chunk_bound is not None else m.defaults.get("chunk_bound", DEFAULT_CHUNK_BOUND)
        if isinstance(cb, bool) or not isinstance(cb, (int, float, np.integer, np.floating)) or not 0.0 < cb <= 1.0:
            raise InputError(f"chunk_bound={cb!r}; chunk_bound must be a number in (0, 1] (the draft-confidence product at which a chunk ends)")
        if st == "lazy-head":
            if self.backend != "ort-cpu":
                raise BackendError(f"strategy 'lazy-head' runs on the ort-cpu backend only (this Engine uses {self.backend!r}); use 'full' or 'chunked'")
            if LAZY_HEAD_KEY not in m.extra:
                raise InputError(LAZY_HEAD_HINT.format(folder=self.folder))
        return replace(
            config,
            k_max=int(k),
            threshold=float(th),
            max_new_tokens=int(n),
            temperature=float(config.temperature),
            top_k=int(config.top_k),
            top_p=float(config.top_p),
            seed=None if config.seed is None else int(config.seed),
            stop=stop,
            confidence_temperature=float(ct),
            strategy=st,
            chunk_bound=float(cb),
        )

    def prompt_ids(self, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
        """Token ids for a text prompt or validated ids for an id prompt.

        Raises:
            InputError: empty prompt, ids not 1-D integers, ids outside the vocab, or a
                prompt that leaves no room in the context (needs < max_ctx tokens).
        """
        m = self.manifest
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        else:
            arr = np.asarray(prompt)
            if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
                raise InputError(f"prompt ids must be a 1-D sequence of integers, got shape {arr.shape} dtype {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() >= m.vocab_size):
                raise InputError(f"prompt ids must be in 0..{m.vocab_size - 1}; got min {arr.min()} max {arr.max()}")
            ids = arr.astype(np.int64).tolist()
        if not ids:
            raise InputError("empty prompt; give at least one token")
        if len(ids) >= m.max_ctx:
            raise InputError(
                f"prompt has {len(ids)} tokens; the engines' context is max_ctx={m.max_ctx}, so a prompt may have at most {m.max_ctx - 1}"
            )
        return ids

    # ---- generation ------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int] | np.ndarray, config: GenerationConfig = GenerationConfig(), trace=None) -> GenerationResult:
        """Generate, greedy or sampled (speculative or target-only); see the module docstring.

        Args:
            prompt: text, or token ids (list / tuple / any 1-D integer array: int32 and
                int64 give the same output).
            config: :class:`GenerationConfig` (stop strings included).
            trace: a :class:`~specrt.runtime.trace.TraceWriter` that records every round
                (draft confidences, accepted length, timings); None (the default) records
                nothing and costs the round loop one ``if`` per site.

        Returns:
            :class:`GenerationResult`.

        Raises:
            InputError: bad prompt or config (see :meth:`resolve`, :meth:`prompt_ids`), or a
                call from a thread whose own stream on this Engine is still open.
            NumericsError: NaN/inf logits.
        """
        cfg = self.resolve(config)
        ids = self.prompt_ids(prompt)
        run = self._run(ids, cfg, streaming=False, trace=trace)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | Sequence[int] | np.ndarray, config: GenerationConfig = GenerationConfig(), trace=None) -> "Stream":
        """Stream the output text in pieces as rounds commit tokens.

        The prompt and config are checked here, before anything runs (so a server can
        refuse a request before it starts a response). Text is released only at UTF-8-safe
        points (a token that ends inside a multi-byte character waits for the one that
        completes it); with stop strings, text that could start a match is held back until
        it cannot, and nothing is yielded after a stop. The pieces concatenate to
        ``stream.result.text``, which equals :meth:`generate`'s text for the same call.

        Returns:
            a :class:`Stream`: iterate it for ``str`` pieces; ``.result`` holds the
            :class:`GenerationResult` once it is exhausted.

        Raises:
            InputError: bad prompt or config (here, at the call); during iteration what
                :meth:`generate` raises.
        """
        cfg = self.resolve(config)
        ids = self.prompt_ids(prompt)
        return Stream(self._run(ids, cfg, streaming=True, trace=trace))

    def _run(self, ids: list[int], cfg: GenerationConfig, streaming: bool, trace=None):
        """One generation as a generator: yields text pieces (``streaming``; none
        otherwise, except one empty yield per round) and returns the :class:`GenerationResult`.

        The round loop is closed on every exit (stop string, exception, an abandoned
        stream), which releases the Engine's lock.
        """
        stats = Stats()
        out: list[int] = []
        finish, stop_reason = "length", None
        text_out = IncrementalText(self.codec, cfg.stop) if (streaming or cfg.stop) else None
        rounds = self._rounds(ids, cfg, stats, trace)
        try:
            for piece, reason in rounds:
                if text_out is not None:
                    kept = text_out.push(piece)
                    if kept is not None:
                        out.extend(piece[:kept])
                        finish, stop_reason = "stop", text_out.stop_reason
                        break
                out.extend(piece)
                if reason:
                    finish = reason
                yield text_out.take() if streaming else ""
        finally:
            rounds.close()
        if text_out is None:
            text = self.codec.decode(out)
        else:
            text_out.finish()
            if streaming:
                last = text_out.take()
                if last:
                    yield last
            text = text_out.text
        stats.new_tokens = len(out)
        result = GenerationResult(tokens=out, text=text, finish_reason=finish, stats=stats, stop_reason=stop_reason)
        if trace is not None:
            trace.end(result)
        return result

    def _feed(self, model: OrtModel, tokens: Sequence[int], start: int) -> np.ndarray:
        """Run ``tokens`` from KV length ``start`` in chunks; returns the last logits row."""
        step = model.max_q
        for i in range(0, len(tokens), step):
            logits = model.run(tokens[i : i + step], start + i)
        return logits[-1]

    def _feed_rows(self, model: OrtModel, tokens: Sequence[int], start: int) -> np.ndarray:
        """As :meth:`_feed`, but returns all logits rows of the last chunk ``[q, vocab]``
        (tracing reads the row before the last: the draft's prediction of the pending token)."""
        step = model.max_q
        for i in range(0, len(tokens), step):
            logits = model.run(tokens[i : i + step], start + i)
        return logits

    def _sampling_buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float64 work buffers of the sampling path, allocated on first use and reused:
        q rows ``[k_max, vocab]``, p rows ``[k_max + 1, vocab]``, scratch ``[2, vocab]``."""
        bufs = getattr(self, "_sample_bufs", None)
        if bufs is None:
            k, v = self.manifest.k_max, self.manifest.vocab_size
            bufs = self._sample_bufs = (np.empty((k, v)), np.empty((k + 1, v)), np.empty((2, v)))
        return bufs

    def _lazy_runner(self) -> OrtLazyHead:
        """This Engine's lazy-head target over its target's KV buffers, made on first use
        (the body/head sessions are loaded once per folder and shared with forks).

        Raises:
            EngineError: the folder lacks the lazy-head graphs, or they are altered.
        """
        lazy = self._lazy
        if lazy is None:
            body, head = self._lazy_sessions.get()
            lazy = self._lazy = OrtLazyHead(body, head, self.target, self.manifest.target.hidden)
        return lazy

    def _prefill_flops(self, n: int) -> int:
        """Target FLOPs of feeding n prompt tokens through the full graph in chunks of ``max_q``."""
        step = self.target.max_q
        return sum(call_flops(self._flops, min(step, n - i), i) for i in range(0, n, step))

    def _verify_stepwise(self, pending: int, cands: list[int], confs: list[float], start: int, bound: float, lazy, stats: Stats, samp) -> tuple[int, int]:
        """Chunked (``lazy`` None) or lazy-head verification of one round with n >= 1
        candidates; stops at the first rejection, so no later target pass (chunked) or
        head block (lazy-head) runs.

        Args:
            pending: the pending token; cands: c_1..c_n; confs: their draft confidences.
            start: the target's KV length (the pending token's position).
            bound: ``chunk_bound``.
            lazy: the :class:`~specrt.runtime.ort_backend.OrtLazyHead`, or None (chunked).
            stats: updated with calls, positions, head rows and FLOPs.
            samp: None (greedy), or ``(rng, q_rows, p_rows, wargs, work)`` of the sampling path.

        Returns:
            ``(n_accepted, next_token)``, what :func:`~specrt.runtime.speculative.greedy_verify`
            / :func:`~specrt.runtime.sampling.speculative_verify` return for the same logits
            (the same random draws in the same order).
        """
        n = len(cands)
        fc = self._flops
        sizes = chunk_sizes(confs, bound)
        toks = [pending, *cands]
        if lazy is not None:
            lazy.body(toks, start)
            stats.target_calls += 1
            stats.target_positions += n + 1
            stats.target_flops += body_flops(fc, n + 1, start)
            blocks = head_blocks(sizes)
        else:
            blocks = chunk_passes(sizes)
        if samp is not None:
            rng, q_rows, p_rows, wargs, work = samp
        target, vocab = self.target, self.manifest.vocab_size
        for lo, hi in blocks:
            if lazy is not None:
                rows = lazy.head(lo, hi - lo)
                stats.head_calls += 1
                stats.target_flops += (hi - lo) * fc.per_head_row
            else:
                rows = target.run(toks[lo:hi], start + lo)
                stats.target_calls += 1
                stats.target_positions += hi - lo
                stats.target_flops += call_flops(fc, hi - lo, start + lo)
            stats.head_rows += hi - lo
            for r in range(lo, hi):  # row r verifies c_{r+1}; row n gives the bonus
                if samp is None:
                    t = argmax_token(rows[r - lo], vocab)
                    if r == n or t != cands[r]:
                        return r, t
                else:
                    p_row = warp(rows[r - lo], *wargs, out=p_rows[r])
                    if r == n:
                        return n, final_token(p_row, None, rng, work)
                    if not accept_candidate(cands[r], q_rows[r], p_row, rng):
                        return r, final_token(p_row, q_rows[r], rng, work)
        raise AssertionError(f"verification blocks {blocks} do not cover rows 0..{n}")  # pragma: no cover

    def _rounds(self, prompt: list[int], cfg: GenerationConfig, stats: Stats, trace=None) -> Iterator[tuple[list[int], str | None]]:
        """Core loop under the Engine's lock: yields (newly committed tokens, finish reason
        or None) per round (:meth:`_rounds_locked`). Closing it early (a stop string, an
        abandoned stream) releases the lock; ``stats.total_seconds`` is set either way.

        Raises:
            InputError: the calling thread already holds this Engine's lock (its own
                stream is still open): waiting would deadlock.
        """
        me = threading.get_ident()
        if self._owner == me:
            raise InputError(
                "this thread has an unfinished stream on this Engine; exhaust or close() it first "
                "(one generation at a time per Engine; use Engine.fork() for concurrent ones)"
            )
        with self._lock:
            self._owner = me
            t_start = time.perf_counter()
            try:
                yield from self._rounds_locked(prompt, cfg, stats, trace)
            finally:
                stats.total_seconds = time.perf_counter() - t_start
                self._owner = None

    def _rounds_locked(self, prompt: list[int], cfg: GenerationConfig, stats: Stats, trace=None) -> Iterator[tuple[list[int], str | None]]:
        """Core loop: yields (newly committed tokens, finish reason or None) per round.

        Sampling (``temperature > 0``): one ``Generator(PCG64(seed))`` per call; the first
        token and target-only tokens are sampled from the warped p; draft candidates from
        the warped q; verification is :func:`~specrt.runtime.sampling.speculative_verify`.

        Confidence threshold when sampling: the draft samples x ~ q, *proposes* it, and
        stops drafting after it when its warped probability q(x) < threshold (what Hugging
        Face's ``assistant_confidence_threshold`` does: its stopping criterion reads the
        processed scores of the token just generated). Warped, because q is the
        distribution x was drawn from and the one in the ratio p(x)/q(x): it is the
        draft's actual confidence in the proposal (raw probabilities ignore temperature,
        top-k and top-p). Proposed rather than dropped, because dropping x when q(x) is
        small would make the proposal follow q restricted to {q >= threshold}, not q, and
        the ratio p/q would then bias the output; stopping *after* x only shortens the
        round, a decision made from the draft's own information, which keeps the output
        exactly p. (Greedy keeps its own rule, bit for bit: drop a token whose raw top-1
        probability is below the threshold; exact there because it precedes the proposal.
        With ``confidence_temperature`` T != 1 that probability is softmax(logits / T)'s
        top-1, the token is still the argmax.)

        ``trace`` (:class:`~specrt.runtime.trace.TraceWriter` or None): when given, the
        loop hands it the draft's (token, confidence) of every draft step, the draft's
        prediction of the pending token when the draft fed two or more tokens, and each
        round's positions, counts and committed tokens; timings come from ``stats``.
        """
        m = self.manifest
        vocab, eos, max_ctx = m.vocab_size, m.eos_token_id, m.max_ctx
        k_max, threshold, budget = cfg.k_max, cfg.threshold, cfg.max_new_tokens
        target, draft, scratch = self.target, self.draft, self._scratch
        inv_t = 1.0 / (cfg.confidence_temperature or 1.0)  # draft confidence calibration (1.0: off)
        tr = trace
        sampling = cfg.temperature > 0.0
        if sampling:
            rng = np.random.Generator(np.random.PCG64(cfg.seed))
            q_rows, p_rows, work = self._sampling_buffers()
            wargs = (vocab, cfg.temperature, cfg.top_k, cfg.top_p)
            p_lazy = _WarpedRows(p_rows, wargs)
        stepwise = cfg.strategy not in (None, "full")  # chunked / lazy-head (module docstring)
        lazy = self._lazy_runner() if cfg.strategy == "lazy-head" else None
        bound = cfg.chunk_bound if cfg.chunk_bound is not None else DEFAULT_CHUNK_BOUND
        samp = (rng, q_rows, p_rows, wargs, work) if sampling else None
        fc = self._flops
        clock = time.perf_counter
        stats.prompt_tokens = len(prompt)
        stats.accepted_hist = [0] * (k_max + 1)
        hist = stats.accepted_hist
        t_start = clock()
        seq = list(prompt)
        row = self._feed(target, seq, 0)
        stats.prefill_flops = self._prefill_flops(len(seq))
        first = sample_token(warp(row, *wargs, out=p_rows[0]), rng, work[1]) if sampling else argmax_token(row, vocab)
        seq.append(first)
        t1 = clock()
        stats.prefill_seconds = stats.ttft_seconds = t1 - t_start
        n_prompt = len(prompt)
        draft_len = 0
        reason = None
        if first == eos:
            reason = "stop"
        elif budget == 1 or len(seq) >= max_ctx:
            reason = "length"
        if tr is not None:
            tr.begin(prompt, cfg, first, stats)
        yield [first], reason
        while reason is None:
            seq_len = len(seq)
            n_max = draft_limit(k_max, budget - (seq_len - n_prompt), seq_len, max_ctx) if cfg.speculative else 0
            cands: list[int] = []
            confs: list[float] = []  # draft confidences of the candidates (chunk sizes)
            if n_max:
                t0 = clock()
                if tr is None:
                    row = self._feed(draft, seq[draft_len:], draft_len)
                else:
                    rows = self._feed_rows(draft, seq[draft_len:], draft_len)
                    row = rows[-1]
                    tr.pre = top1(rows[-2], vocab, scratch, inv_t) if len(rows) > 1 else None
                draft_len = seq_len
                stats.draft_calls += 1
                while True:
                    if sampling:
                        q_row = warp(row, *wargs, out=q_rows[len(cands)])
                        tok = sample_token(q_row, rng, work[1])
                        cands.append(tok)
                        confs.append(q_row[tok])
                        if tr is not None:
                            tr.draft.append((tok, float(q_row[tok])))
                        if q_row[tok] < threshold:  # propose x, then stop (see docstring)
                            break
                    else:
                        tok, conf = top1(row, vocab, scratch, inv_t)
                        if tr is not None:
                            tr.draft.append((tok, conf))
                        if conf < threshold:
                            break
                        cands.append(tok)
                        confs.append(conf)
                    if len(cands) == n_max or tok == eos:
                        break
                    row = draft.run((tok,), draft_len)[0]
                    draft_len += 1
                    stats.draft_calls += 1
                stats.draft_seconds += clock() - t0
            t0 = clock()
            if stepwise and cands:
                n_acc, nxt = self._verify_stepwise(seq[-1], cands, confs, seq_len - 1, bound, lazy, stats, samp)
            else:
                q = len(cands) + 1
                logits = target.run([seq[-1], *cands], seq_len - 1)
                if sampling:
                    p_lazy.logits = logits
                    n_acc, nxt = speculative_verify(cands, q_rows[: len(cands)], p_lazy, rng, work)
                else:
                    n_acc, nxt = greedy_verify(cands, logits, vocab)
                stats.target_calls += 1
                stats.target_positions += q
                stats.head_rows += q
                stats.target_flops += call_flops(fc, q, seq_len - 1)
            stats.target_seconds += clock() - t0
            stats.passes += 1
            stats.proposed += len(cands)
            stats.accepted += n_acc
            hist[n_acc] += 1
            new = cands[:n_acc]
            new.append(nxt)
            if eos in new:
                new = new[: new.index(eos) + 1]
                reason = "stop"
            seq.extend(new)
            _, draft_len = rollback_lengths(seq_len, draft_len, n_acc)
            if reason is None and (len(seq) - n_prompt >= budget or len(seq) >= max_ctx):
                reason = "length"
            if tr is not None:
                tr.round(seq_len - n_prompt, len(cands), n_acc, new, stats)
            yield new, reason
        if tr is not None and not sampling and 0 < draft_len < len(seq) - 1 <= draft_len + draft.max_q:
            # tracing only, after the last round (not in draft_calls/draft_seconds): the
            # draft's predictions of the committed tokens it has not seen, so a replay knows
            # every on-trajectory position (see specrt.runtime.trace)
            rows = self._feed_rows(draft, seq[draft_len:-1], draft_len)
            tr.tail(draft_len + 1 - n_prompt, [top1(r, vocab, scratch, inv_t) for r in rows])
        stats.new_tokens = len(seq) - n_prompt
