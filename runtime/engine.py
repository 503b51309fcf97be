"""The Engine: a loaded engine folder (manifest, tokenizer, draft and target models) and its
two calls, :meth:`Engine.generate` and :meth:`Engine.stream`.

The decoding itself is :func:`specrt.runtime.decode.decode` (propose, verify, commit and
roll back; greedy output equals the target's own greedy output, sampled output follows the
target's distribution, Leviathan et al. 2023, Algorithm 1). This module validates the
request (:func:`specrt.runtime.config.resolve_config`), picks the acceptor, turns the round
records into the completion text (:mod:`specrt.runtime.textstream`: the one definition of the
output text for generate, stream, the CLI and the server) and statistics
(:class:`~specrt.runtime.stats.Stats`), and serialises generations per Engine.
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .backends import DEFAULT_BACKEND, kernel_files, load_models, resolve_backend
from .backends.base import SplitsHead, ThreadConfig, is_width_exact, reduces_head
from .chunks import PREFILL_CHUNK
from .config import GenerationConfig, resolve_config
from .constraints import ConstrainedAcceptor, GrammarTokenizer, check_logit_bias
from .coupling import CoupledAcceptor
from .decode import Plan, Round, decode
from .errors import BackendError, EngineError, InputError
from .flops import flop_coefficients
from .generation import Generation, GenerationResult
from .integrity import Verification
from .logprobs import TokenLogprob, score_prompt
from .machine import tuned_elsewhere
from .manifest import GRAPH_BUILDER, LAZY_HEAD_HINT, LAZY_HEAD_KEY, REEXPORT_HINT, Manifest, check_files, load_manifest
from .sampling import SampledAcceptor
from .slots import Slot, SlotRecord
from .speculative import GreedyAcceptor
from .target_path import choose_backend
from .tokenizer import TextCodec

__all__ = ["Engine", "GenerationResult", "Stream", "PREFILL_CHUNK"]

log = logging.getLogger("specrt")
_TOLD: set[str] = set()  # folders whose tuned-elsewhere line this process printed


class Stream:
    """Iterator over the text pieces of one :meth:`Engine.stream` call.

    Iterate it for non-empty ``str`` pieces (UTF-8-safe, nothing after a stop string).
    Once it is exhausted, :attr:`result` holds the :class:`GenerationResult` (``text ==
    "".join(pieces)``). :meth:`close`, or leaving a ``with`` block, ends the generation
    early and frees the Engine for the next call (``result`` stays None).

    The Engine's lock is held from the first ``next()`` until exhaustion or close, so
    finish or close a stream before starting another generation on the same Engine in
    the same thread (that raises :class:`~specrt.runtime.errors.InputError` instead of
    deadlocking).

    Attributes:
        result: the :class:`GenerationResult` once exhausted (None before, or after close).
        tokens: the ids committed so far that belong to the output (a live list: it grows
            as rounds commit; a token is never removed once here).
        logprobs: with ``GenerationConfig(logprobs=N)``, the
            :class:`~specrt.runtime.logprobs.TokenLogprob` of each entry of ``tokens``
            (live, same length); else None. Their text may still be held back (UTF-8
            boundaries, possible stop-string starts): pieces and tokens do not align.
    """

    __slots__ = ("_run", "result", "tokens", "logprobs")

    def __init__(self, run: Iterator[str], tokens: list[int] | None = None, logprobs: list[TokenLogprob] | None = None):
        self._run = run
        self.result: GenerationResult | None = None
        self.tokens = tokens if tokens is not None else []
        self.logprobs = logprobs

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


class ClosedModel:
    """What a closed :class:`Engine` holds in place of each model: any use raises
    :class:`EngineError` in one line. A backend's buffers are freed by ``close()``; a call
    reaching them after it would read freed memory (onnxruntime's I/O binding segfaults)."""

    __slots__ = ("role",)

    def __init__(self, role: str):
        self.role = role

    def __getattr__(self, name: str):
        raise EngineError(f"this Engine is closed: its {self.role} model was freed by close(); load a new Engine, or fork() one that is open")


def _say_tuned_elsewhere(manifest: Manifest, folder: Path) -> str | None:
    """:func:`specrt.runtime.machine.tuned_elsewhere`, logged on the ``specrt`` logger once
    per folder and process: defaults tuned on another kind of CPU are used, never silently."""
    line = tuned_elsewhere(manifest, folder)
    if line and str(folder) not in _TOLD:
        _TOLD.add(str(folder))
        log.warning("specrt: %s", line)
    return line


def _load_files(manifest: Manifest, backend: str) -> dict[str, str]:
    """Name -> SHA-256 of the files an Engine on ``backend`` opens (the kernels: their panels too)."""
    return {**manifest.load_files(), **(kernel_files(manifest) if backend == "kernels" else {})}


def target_exactness(target, manifest: Manifest) -> tuple[bool, int, int]:
    """``(width_exact, min_q, reuse_step)`` of a loaded target: a model whose rows do not
    depend on the call (``width_exact``: the kernels) is exact at every width and layout (1, 1);
    any other keeps the manifest's measured ``exact_min_q`` and reuse granularity."""
    if is_width_exact(target):
        return True, 1, 1
    return False, manifest.min_q(), manifest.reuse_step(target.max_q)


def layout_avoid(engine, exact_widths: bool) -> frozenset | None:
    """The prefill widths any-layout prefix reuse must avoid (None: whole aligned calls only).
    The wide widths were measured on onnxruntime's CPU kernels, so other backends keep whole
    aligned calls; for a width-exact target (specrt's kernels) every layout is exact."""
    if engine.width_exact:
        return frozenset()
    if exact_widths and engine.backend == DEFAULT_BACKEND:
        return engine.manifest.layout_avoid(engine.target.max_q)
    return None


class Engine:
    """A loaded engine folder: manifest, tokenizer, and both models on one backend.

    One generation at a time per Engine (it owns the KV buffers): concurrent calls from
    threads are serialised by a lock. For parallel generations give each thread its own
    :meth:`fork` (shared weights, own KV buffers).

    Args:
        folder: the engine folder written by ``specrt export``.
        threads: :class:`~specrt.runtime.backends.base.ThreadConfig` for the CPU sessions.
        verify_hashes: check the sizes and the SHA-256 of the files the load opens (both
            graphs, their external-data files, the tokenizer) against the manifest before
            the sessions are created; a file whose identity (device, inode, size, mtime,
            ctime) was verified before is not hashed again (the digest cache of
            :mod:`specrt.runtime.integrity`; ``SPECRT_DIGEST_CACHE=off`` disables it);
            False checks only that they exist (the lazy-head graphs: when first used).
        backend: ``"ort-cpu"`` (the default), ``"ort-cuda"`` or ``"tensorrt"``
            (:mod:`specrt.runtime.backends`; the GPU backends are unverified on a GPU).
        prefix_cache: reuse the KV rows of the last prompt when the next one starts with
            the same tokens, only those :mod:`specrt.runtime.prefix` proves equal to a cold
            run's (the output is the same either way; ``stats.cached_tokens`` counts them).

    Attributes:
        folder, manifest, codec (the tokenizer), backend (its name), target, draft (the
        :class:`~specrt.runtime.backends.base.Model` objects), slot (their KV, a :class:`~specrt.runtime.slots.Slot`;
        ``cached`` is its record), integrity (``{"hashed": [...], "cached": [...]}``: the files this load hashed and
        those that passed on their cached digest; None without ``verify_hashes``), tuned_elsewhere (None, or the line
        :func:`_say_tuned_elsewhere` logged).

    Raises:
        EngineError: missing/half-written folder, unknown manifest version, a manifest field
            of the wrong type or value, mismatched pair, a file missing, truncated or
            altered (one line naming it), graphs that disagree with the manifest.
        BackendError: a backend this machine or folder cannot run (the message lists the
            available ones).
    """

    def __init__(
        self, folder: str | Path, threads: ThreadConfig | None = None, verify_hashes: bool = True, backend: str | None = None, prefix_cache: bool = True
    ):
        self.folder = Path(folder)
        self.prefix_cache = prefix_cache
        self.manifest: Manifest = load_manifest(self.folder, verify_hashes=False)  # validated whole; files present
        manifest = self.manifest
        self.backend = resolve_backend(choose_backend(backend, manifest), manifest)
        if verify_hashes:
            hint = REEXPORT_HINT.format(folder=self.folder)
            check_files(manifest, self.folder, files := _load_files(manifest, self.backend), True, hint)  # sizes: a stat each, first
            # Digests before any session exists: files whose identity already has the
            # manifest's digest in the digest cache are not read again, the others are hashed
            # on worker threads. Hashing first, not beside session creation, because it
            # measured faster (docs/real_shapes/load_strategy_e714.json: on 2 shared cores
            # the overlap took 15.0 s, hashing first 9.6 s, sessions alone 4.7 s), and no
            # session is ever built over unverified bytes.
            check = Verification(self.folder, files, hint)
            check.wait()
            self.integrity = dict(hashed=check.hashed, cached=check.cached)
            # what a loader that maps a file checks it still is (the kernels' panels)
            verified = {n: (check.identities.get(n), files[n]) for n in files}
        else:
            self.integrity = verified = None
        self.codec = TextCodec(self.folder / manifest.tokenizer_file, manifest.bos_token_id, manifest.add_bos)
        self.target, self.draft = load_models(
            self.backend, self.folder, manifest, threads or ThreadConfig(), max(PREFILL_CHUNK, manifest.k_max + 1), PREFILL_CHUNK, verify_hashes, verified
        )
        self.width_exact, self.min_q, step = target_exactness(self.target, manifest)  # a step of reusable rows
        self.slot = Slot(self.target, self.draft, step, manifest.k_max + 1)
        self._flops = flop_coefficients(manifest.target)
        self._adaptive: tuple | None = None  # per-call costs for adaptive k (adaptive_costs)
        self.tuned_elsewhere: str | None = _say_tuned_elsewhere(manifest, self.folder)
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread holding _lock (deadlock check)
        self._grammar = {"lock": threading.Lock(), "tok": None}  # grammar_tokenizer(), shared by forks
        # the folder's chat template (specrt export copies the target's; its SHA-256 was checked with the manifest)
        self.chat_template: str | None = (self.folder / manifest.chat_template_file).read_text(encoding="utf-8") if manifest.chat_template_file else None

    def fork(self) -> "Engine":
        """Another Engine over the same loaded models (weights, manifest, tokenizer shared)
        with its own KV buffers and lock; it gives exactly what the parent gives for the
        same call. Cheap: no file is read; memory is one set of KV/logits buffers.

        Raises:
            BackendError: the backend cannot share its weights (load another Engine).
        """
        new = copy.copy(self)
        new.target, new.draft = self.target.fork(), self.draft.fork()
        new._lock, new._owner = threading.Lock(), None
        new.slot = Slot(new.target, new.draft, self.slot.t_step, self.slot.narrow)
        return new

    def close(self) -> None:
        """Free the models' buffers; any later use raises :class:`EngineError` (idempotent)."""
        if not isinstance(self.target, ClosedModel):
            self.target.close(), self.draft.close()
            self.target, self.draft = ClosedModel("target"), ClosedModel("draft")

    # ---- validation ------------------------------------------------------------------
    def resolve(self, config: GenerationConfig) -> GenerationConfig:
        """The config with the manifest's defaults filled in, validated
        (:func:`specrt.runtime.config.resolve_config`), and the strategy checked against
        what this folder and backend can run.

        Raises:
            InputError: a field outside its range (``param`` names it), or lazy-head for a
                folder exported without it or whose target is a builder graph.
            BackendError: lazy-head on a backend that offers no body/head split.
        """
        manifest = self.manifest
        cfg = resolve_config(config, manifest.defaults, (manifest.k_min, manifest.k_max))
        if cfg.strategy == "lazy-head":
            if manifest.target.graph == GRAPH_BUILDER:
                raise InputError(
                    f"strategy 'lazy-head' needs the standard graph's body/head split; the target in {self.folder} is "
                    f"an {manifest.target.precision} builder graph, which computes its LM head inside (use 'full' or 'chunked', "
                    "or export --precision fp32 --lazy-head)",
                    "strategy",
                )
            if not isinstance(self.target, SplitsHead):
                raise BackendError(
                    f"strategy 'lazy-head' needs a backend with a body/head split; {self.backend!r} has none (use 'full' or 'chunked')", "strategy"
                )
            if LAZY_HEAD_KEY not in manifest.extra:
                raise InputError(LAZY_HEAD_HINT.format(folder=self.folder), "strategy")
        if cfg.logit_bias:
            cfg = replace(cfg, logit_bias=check_logit_bias(cfg.logit_bias, manifest.vocab_size))
        if cfg.constraint is not None:
            self.grammar_tokenizer().matcher(cfg.constraint)  # compiles and checks it (one line on failure)
        return cfg

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The vocabulary as llguidance sees it (:class:`~specrt.runtime.constraints.GrammarTokenizer`),
        built on first use (about 1 s for a 150k vocabulary) and shared with every fork."""
        holder = self._grammar
        with holder["lock"]:
            if holder["tok"] is None:
                holder["tok"] = GrammarTokenizer(self.codec, self.manifest.vocab_size, sorted(self.manifest.stop_ids()))
            return holder["tok"]

    def prompt_ids(self, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
        """Token ids for a text prompt, or validated ids for an id prompt.

        Raises:
            InputError: (param ``prompt``) empty prompt, ids not 1-D integers, ids outside
                the vocab, or a prompt that leaves no room in the context (< max_ctx tokens).
        """
        manifest = self.manifest
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        else:
            arr = np.asarray(prompt)
            if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
                raise InputError(f"prompt ids must be a 1-D sequence of integers, got shape {arr.shape} dtype {arr.dtype}", "prompt")
            if arr.size and (arr.min() < 0 or arr.max() >= manifest.vocab_size):
                raise InputError(f"prompt ids must be in 0..{manifest.vocab_size - 1}; got min {arr.min()} max {arr.max()}", "prompt")
            ids = arr.astype(np.int64).tolist()
        if not ids:
            raise InputError("empty prompt; give at least one token", "prompt")
        if len(ids) >= manifest.max_ctx:
            raise InputError(
                f"prompt has {len(ids)} tokens; the engines' context is max_ctx={manifest.max_ctx}, so a prompt may have at most {manifest.max_ctx - 1}",
                "prompt",
            )
        return ids

    # ---- generation ------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int] | np.ndarray, config: GenerationConfig = GenerationConfig(), trace=None) -> GenerationResult:
        """Generate, greedy or sampled, speculative or target-only.

        Args:
            prompt: text, or token ids (any 1-D integer sequence or array).
            config: :class:`~specrt.runtime.config.GenerationConfig`.
            trace: a :class:`~specrt.runtime.lab.trace.TraceWriter` that records every
                round; None records nothing.

        Returns:
            :class:`GenerationResult`.

        Raises:
            InputError: bad prompt or config, or a call from a thread whose own stream on
                this Engine is still open.
            NumericsError: NaN/inf logits.
        """
        run = self._run(self.prompt_ids(prompt), self.resolve(config), False, trace, [], None)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | Sequence[int] | np.ndarray, config: GenerationConfig = GenerationConfig(), trace=None) -> Stream:
        """Stream the output text in pieces as rounds commit tokens.

        The prompt and config are checked here, before anything runs. Text is released only
        at UTF-8-safe points, and with stop strings only once it cannot start a match; the
        pieces concatenate to ``stream.result.text``, which equals :meth:`generate`'s text.

        Raises:
            InputError: bad prompt or config (here, at the call); during iteration what
                :meth:`generate` raises.
        """
        cfg = self.resolve(config)
        tokens: list[int] = []
        lps: list[TokenLogprob] | None = [] if cfg.logprobs is not None else None
        return Stream(self._run(self.prompt_ids(prompt), cfg, True, trace, tokens, lps), tokens, lps)

    def prompt_logprobs(self, prompt: str | Sequence[int] | np.ndarray, top_n: int = 0) -> list[TokenLogprob | None]:
        """Log-probabilities of the prompt's own tokens under the target (one scoring pass
        of the target over the prompt, in chunks of its widest call; under this Engine's lock).

        Entry i > 0 is token i's :class:`~specrt.runtime.logprobs.TokenLogprob` from the
        target's raw distribution at position i - 1 (log_softmax of its logits, temperature
        1) with the ``top_n`` most probable ids; entry 0 is None (nothing precedes the
        first token), as OpenAI's ``echo`` with ``logprobs`` gives.

        Args:
            prompt: text or ids (validated as :meth:`prompt_ids`).
            top_n: alternatives per token, 0..:data:`~specrt.runtime.config.MAX_LOGPROBS`.

        Raises:
            InputError: bad prompt or ``top_n``; the calling thread's own stream is open.
            NumericsError: NaN/inf logits.
        """
        from .config import check_logprobs

        ids = self.prompt_ids(prompt)
        top_n = check_logprobs(top_n) or 0
        vocab = self.manifest.vocab_size
        with self._locked():
            return score_prompt(self.target, ids, vocab, top_n)

    def acceptor(self, cfg: GenerationConfig):
        """The acceptor of one generation with resolved settings ``cfg``: greedy
        (temperature 0) or exact speculative sampling (``cfg.sampler``: coupled or rejection),
        with its own buffers and generator;
        with a constraint or a logit bias, wrapped in a
        :class:`~specrt.runtime.constraints.ConstrainedAcceptor` (its own matcher)."""
        manifest = self.manifest
        acc = base_acceptor(cfg, manifest.vocab_size, manifest.k_max, self.draft.vocab)
        if cfg.constraint is None and not cfg.logit_bias:
            return acc
        matcher = self.grammar_tokenizer().matcher(cfg.constraint) if cfg.constraint is not None else None
        return ConstrainedAcceptor(acc, matcher, manifest.vocab_size, manifest.k_max, manifest.stop_ids(), manifest.eos_token_id, cfg.logit_bias)

    def plan(self, cfg: GenerationConfig, observe: bool = False) -> Plan:
        """The decode loop's :class:`~specrt.runtime.decode.Plan` for resolved settings ``cfg``."""
        manifest, avoid = self.manifest, layout_avoid(self, cfg.exact_widths)
        return Plan(
            k_max=cfg.k_max,
            threshold=cfg.threshold,
            budget=cfg.max_new_tokens,
            eos=manifest.stop_ids(),
            max_ctx=manifest.max_ctx,
            speculative=cfg.speculative,
            strategy=cfg.strategy,
            chunk_bound=cfg.chunk_bound,
            observe=observe,
            min_q=self.min_q if cfg.exact_widths else 1,
            tail_q=0 if self.width_exact or not cfg.exact_widths else manifest.k_max + 1,
            any_layout=avoid is not None,
            avoid=avoid or frozenset(),
            drafter=cfg.drafter,
            adaptive=self.adaptive_costs() if cfg.adaptive and cfg.speculative else None,
            argmax=manifest.vocab_size if argmax_only(cfg, self.target, observe) else 0,
        )

    def adaptive_costs(self) -> tuple:
        """``(target_s, draft_s, prior)`` for :class:`~specrt.runtime.adaptive.AdaptiveK`:
        seconds of a target call of width q = 1..k_max+1 (q = 1 as the loop makes it) and
        of a draft step, and the acceptance to start from. From ``specrt tune``'s record in
        the manifest (``extra.tune.costs``, ``extra.calibration.acceptance``) when there is
        one of this machine and backend (:func:`specrt.runtime.costs.recorded_call_costs`), else
        measured once on this Engine under its lock (5 interleaved repetitions, 256 rows of
        past) and kept: :func:`_adaptive_costs`."""
        if self._adaptive is None:
            self._adaptive = _adaptive_costs(self)
        return self._adaptive

    def _locked(self):
        """This Engine's lock as a context manager, refusing (instead of deadlocking) a
        thread that already holds it.

        Raises:
            InputError: the calling thread already holds this Engine's lock (its own
                stream is still open).
        """
        me = threading.get_ident()
        if self._owner == me:
            raise InputError(
                "this thread has an unfinished stream on this Engine; exhaust or close() it first "
                "(one generation at a time per Engine; use Engine.fork() for concurrent ones)"
            )
        return _Owned(self, me)

    def rounds(self, ids: list[int], cfg: GenerationConfig, observe: bool = False, acceptor=None) -> Iterator[Round]:
        """The round records of one generation under this Engine's lock (validated ``ids``,
        resolved ``cfg``); closing the iterator early releases the lock.

        Args:
            acceptor: the acceptor to decide with (default :meth:`acceptor`; e.g. a
                :class:`~specrt.runtime.logprobs.LogprobRecorder` around it).

        Raises:
            InputError: the calling thread already holds this Engine's lock (its own
                stream is still open): waiting would deadlock.
        """
        with self._locked():
            yield from decode(self.target, self.draft, ids, self.plan(cfg, observe), acceptor if acceptor is not None else self.acceptor(cfg))

    def start(self, ids: list[int], cfg: GenerationConfig, trace=None, draft=None) -> Generation:
        """A :class:`~specrt.runtime.generation.Generation` of validated ``ids`` with
        resolved ``cfg`` (:meth:`prompt_ids`, :meth:`resolve`), not yet prefilled; the
        caller steps it on a target whose KV it may use (this Engine's under its lock, or
        a batch slot).

        Args:
            trace: a :class:`~specrt.runtime.lab.trace.TraceWriter` (the plan then observes
                the draft's top-1s for a replayable trace), or None.
            draft: the draft model whose KV the generation owns (default: this Engine's).
        """
        if trace is not None and cfg.constraint is not None:
            raise InputError("a trace records unconstrained rounds (the replay has no grammar); run a constrained generation without trace", "constraint")
        plan = self.plan(cfg, observe=trace is not None)
        manifest = self.manifest
        return Generation(ids, cfg, plan, self.acceptor(cfg), draft if draft is not None else self.draft, self.codec, manifest.vocab_size, self._flops, trace)

    def _run(self, ids: list[int], cfg: GenerationConfig, streaming: bool, trace=None, out: list[int] | None = None, lps: list | None = None):
        """One generation under this Engine's lock: yields text pieces (``streaming``; else
        one "" per round) and returns the :class:`GenerationResult`. ``out`` (and ``lps``
        with ``cfg.logprobs``) become the generation's live output lists. Closing the
        iterator early releases the lock (the result is then never made)."""
        gen = self.start(ids, cfg, trace)  # before the lock: a first plan may measure costs under it (dropping the cache)
        if out is not None:
            gen.tokens = out
        if lps is not None and gen.logprobs is not None:
            gen.logprobs = lps
        with self._locked() as own:
            if self.prefix_cache and trace is None:  # a trace's replay counts every prefill call
                gen.reuse(self.slot.recall(own.held, gen.seq))
            try:
                piece = gen.prefill(self.target)
                while not gen.done:
                    yield piece if streaming else ""
                    piece = gen.step(self.target)
                yield piece if streaming else ""
            finally:  # closed early too: rows proved reusable are never rewritten after
                self.slot.keep(gen if self.prefix_cache else None)
        return gen.result()


def _adaptive_costs(eng: Engine) -> tuple:
    """:meth:`Engine.adaptive_costs` computed: the recorded costs, or costs measured on the
    Engine's own models under its lock (a generation of another thread would have its KV rows
    and buffers overwritten), unless this thread holds it already (a plan made inside
    ``rounds()``)."""
    from .costs import measure_costs, recorded_call_costs

    m = eng.manifest
    costs = recorded_call_costs(m, eng.backend)
    if costs is None:
        measure = lambda: measure_costs(eng, range(1, m.k_max + 2), min(256, m.max_ctx - m.k_max - 2), reps=5)  # noqa: E731
        if eng._owner == threading.get_ident():
            costs = measure()
        else:
            with eng._locked():
                if eng._adaptive is not None:  # measured while this thread waited
                    return eng._adaptive
                costs = measure()
    prior = float((m.extra.get("calibration") or {}).get("acceptance", 0.7))
    return (tuple(costs.target(q) for q in range(1, m.k_max + 2)), costs.draft_s_per_call, prior)


def base_acceptor(cfg: GenerationConfig, vocab: int, k_max: int, draft_vocab: int):
    """The acceptor of resolved settings ``cfg`` before any constraint: greedy (temperature
    0), the coupled sampler (``cfg.sampler`` "coupled": :mod:`specrt.runtime.coupling`) or
    Algorithm 1 (:class:`~specrt.runtime.sampling.SampledAcceptor`); ``vocab`` the real
    vocabulary, ``k_max`` the engines' widest round, ``draft_vocab`` the draft rows' width."""
    if cfg.temperature > 0.0 and cfg.sampler == "coupled":
        return CoupledAcceptor(vocab, k_max, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    if cfg.temperature > 0.0:
        return SampledAcceptor(vocab, k_max, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    return GreedyAcceptor(vocab, draft_vocab, 1.0 / cfg.confidence_temperature)


def argmax_only(cfg: GenerationConfig, target, observe: bool) -> bool:
    """Whether greedy verification may read only each row's argmax (``Plan.argmax``): greedy
    without logprobs or observe, on a target whose kernels reduce the head (``argmax_head``);
    under a constraint or logit bias only where the head takes their penalty rows
    (``penalty_rows``: specrt's kernels)."""
    plain = cfg.temperature == 0.0 and cfg.logprobs is None and not observe
    masked = cfg.constraint is not None or bool(cfg.logit_bias)
    return plain and reduces_head(target) and (not masked or bool(getattr(target, "penalty_rows", False)))


# what an Engine's KV buffers hold for reuse: its slot's record (None while a generation holds them)
Engine.cached = SlotRecord()


class _Owned:
    """Holds an Engine's lock and records the owning thread (see :meth:`Engine._locked`)."""

    __slots__ = ("engine", "me", "held")

    def __init__(self, engine: Engine, me: int):
        self.engine, self.me, self.held = engine, me, None

    def __enter__(self):
        self.engine._lock.acquire()
        self.engine._owner = self.me
        # whoever holds the lock may write any KV row: the record is handed to the holder
        # (a generation puts back what it leaves; any other use drops it)
        self.held = self.engine.slot.take()
        return self

    def __exit__(self, *exc):
        self.engine._owner = None
        self.engine._lock.release()
