"""Decoding settings: the user-facing :class:`GenerationConfig` and the ONE validation of it.

Every front end resolves settings here: :meth:`Engine.resolve <specrt.runtime.engine.Engine.resolve>`,
``specrt tune`` (its sweep grid), the server (request fields), the CLI (its choices and
defaults come from :data:`STRATEGIES` and :class:`GenerationConfig`), and
``specrt export --defaults`` (:func:`check_defaults`). Each check raises
:class:`~specrt.runtime.errors.InputError` with ``param`` set to the field's name and a
message of the form ``"name=value; name must be ..."``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import numpy as np

from .errors import InputError

__all__ = [
    "GenerationConfig",
    "STRATEGIES",
    "SAMPLERS",
    "DEFAULT_CHUNK_BOUND",
    "MAX_STOPS",
    "DEFAULT_KEYS",
    "resolve_config",
    "check_defaults",
    "check_k_max",
    "check_threshold",
    "check_strategy",
    "check_chunk_bound",
    "check_confidence_temperature",
    "check_max_new_tokens",
    "check_sampling_params",
    "check_sampler",
    "check_stops",
    "check_logprobs",
    "check_drafter",
    "check_adaptive",
    "check_constraint",
    "MAX_LOGPROBS",
]

STRATEGIES = ("full", "chunked", "lazy-head")  # verification strategies (specrt.runtime.decode)
SAMPLERS = ("coupled", "rejection")  # speculative samplers (GenerationConfig.sampler)
DEFAULT_CHUNK_BOUND = 0.5  # chunk_bound when neither the call nor the manifest sets one
MAX_STOPS = 16  # most stop strings per call
MAX_LOGPROBS = 20  # most alternatives per token in GenerationConfig.logprobs (OpenAI chat's top_logprobs bound)
# manifest ``defaults`` keys (specrt tune / export --defaults) -> GenerationConfig field
DEFAULT_KEYS = {
    "k_max": "k_max",
    "threshold": "threshold",
    "strategy": "strategy",
    "chunk_bound": "chunk_bound",
    "draft_confidence_temperature": "confidence_temperature",
    "drafter": "drafter",
    "adaptive": "adaptive",
}


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings for one call (``None`` = the engine manifest's default).

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1); output never overshoots.
        k_max: most draft candidates per verification pass (manifest k_min..k_max).
        threshold: draft confidence threshold in [0, 1] (0 = fixed k_max). Greedy: drafting
            stops, without proposing it, at a token whose top-1 probability is below it.
            Sampling: drafting stops *after* a sampled token whose *warped* draft
            probability q(x) is below it; that token is still proposed
            (:func:`specrt.runtime.speculative.propose` says why).
        speculative: False runs the target alone (the baseline), one token per pass.
        temperature: 0 = greedy; > 0 samples from the warped distributions (exact
            speculative sampling, Leviathan et al. 2023, Algorithm 1).
        top_k: keep the k most probable tokens (ties kept); 0 = off. Sampling only.
        top_p: nucleus mass in (0, 1]; 1 = off. Sampling only (applied after top-k).
        seed: the call's seed (an integer >= 0); None = fresh entropy. Under a seed the
            tokens depend on the seed, the prompt and the warp only: speculative or not, any
            ``k_max``, drafter or threshold, alone or batched, cached or cold (the
            ``coupled`` sampler, below).
        sampler: how sampled tokens are drawn under speculation, one of :data:`SAMPLERS`;
            None = ``coupled`` with a seed, ``rejection`` without. ``coupled``: each
            position's token is the target's exponential race with noise keyed by (seed,
            position), and candidates race with the same noise
            (:mod:`specrt.runtime.coupling`; Daliri et al. 2024), so the output is the
            target-only output of that seed. ``rejection``: Leviathan et al. 2023,
            Algorithm 1 (:mod:`specrt.runtime.sampling`), which accepts more candidates
            when the draft is a model (1 - TV(p, q) against >= (1 - TV) / (1 + TV)) but
            whose draws depend on how many candidates each round drew. Both follow the
            target's warped distribution exactly. Greedy decoding ignores it.
        stop: stop strings (at most :data:`MAX_STOPS`, each a non-empty ``str`` without
            U+FFFD; a single ``str`` is one stop). The output ends at the first match
            (exact rule: :mod:`specrt.runtime.textstream`).
        confidence_temperature: T of the draft's *confidence* in the greedy threshold test
            (softmax(draft_logits / T)[top-1]); None = the manifest's
            ``defaults["draft_confidence_temperature"]``, else 1.0. In [0.01, 100]. It never
            changes the proposals (the argmax). Sampling ignores it.
        strategy: verification strategy, one of :data:`STRATEGIES` (None = manifest default,
            else ``"full"``). The tokens are the same in all three; they differ in the
            target work done after a rejection (:mod:`specrt.runtime.decode`).
        chunk_bound: in (0, 1]: a chunk (chunked) or head block (lazy-head) ends at the
            candidate where the product of the draft's confidences since its start is
            <= this (:func:`~specrt.runtime.speculative.chunk_sizes`); None = manifest
            default, else :data:`DEFAULT_CHUNK_BOUND`. Ignored by ``full``.
        logprobs: None (default) records nothing; an integer N in 0..:data:`MAX_LOGPROBS`
            records, for every committed token, its log-probability under the *target's
            raw* distribution (log_softmax of its logits at temperature 1, before top-k/top-p:
            what vLLM calls raw logprobs) and the N most probable tokens with theirs
            (:mod:`specrt.runtime.logprobs`; :attr:`GenerationResult.logprobs
            <specrt.runtime.engine.GenerationResult>`). Under sampling these are the
            model's distribution, not the warped one the token was drawn from. Costs one
            log-softmax over the vocabulary per committed token; the tokens never change.
        exact_widths: True (default) calls the target only at the widths the export measured
            bit-identical (``exact_min_q`` .. ``k_max + 1``: a target-only step runs 2 rows),
            so speculative output equals target-only output by construction
            (:mod:`specrt.runtime.decode`). False lets target-only decoding run its fastest
            width, 1 row per step (and the prefill any chunking): the baseline a user of the
            target alone would run, whose output may then differ from the speculative one at
            near-ties. Benchmarks report both (``bench/real.py``).
        drafter: where candidates come from (None = the manifest's default, else
            ``model``): ``model`` (the draft model), ``ngram`` (prompt lookup: the sequence's
            own earlier continuation of its longest matching suffix, no model call),
            ``hybrid`` (the n-gram when there is one, else the draft model), ``suffix``
            (frequency-weighted suffix lookup over the sequence and the process's recent
            requests, no model call: :mod:`specrt.runtime.suffix`) or ``suffix-model``
            (per round the suffix proposal or the draft model, whichever the measured
            costs favour);
            :mod:`specrt.runtime.drafters`. The output is the same with all of them.
        adaptive: choose each round's number of candidates (0 = a plain target step) from
            this machine's per-call costs and the request's running acceptance
            (:mod:`specrt.runtime.adaptive`), so speculation does not lose to plain
            decoding on text the drafter predicts badly; ``k_max`` stays the cap. None =
            the manifest's default, else False. Costs come from ``specrt tune``'s record in
            the manifest, else are measured once per Engine. The output never changes.
        constraint: a :class:`~specrt.runtime.constraints.Constraint` (JSON schema, regex,
            Lark/GBNF grammar, choice list) the output must match, or None. Applied to every
            draft and target row (constrained decoding; greedy output equals the
            constrained target-only output, sampling follows the constrained target
            distribution); tokens the grammar forces are committed without a model call
            (:mod:`specrt.runtime.constraints`). Compiled and checked by the Engine
            (:meth:`~specrt.runtime.engine.Engine.resolve`).
        logit_bias: ``((token id, bias), ...)`` added to every draft and target logits row
            before anything else reads it (OpenAI's ``logit_bias``: biases in [-100, 100];
            -100 bans a token: it becomes -inf); a dict is accepted and sorted into pairs. Exact under
            speculation: draft and target rows get the same offsets.
    """

    max_new_tokens: int = 128
    k_max: int | None = None
    threshold: float | None = None
    speculative: bool = True
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    sampler: str | None = None
    stop: tuple[str, ...] = ()
    confidence_temperature: float | None = None
    strategy: str | None = None
    chunk_bound: float | None = None
    logprobs: int | None = None
    exact_widths: bool = True
    drafter: str | None = None
    adaptive: bool | None = None
    constraint: Any = None
    logit_bias: Any = ()


# ---- one check per field ------------------------------------------------------------------
def _is_int(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, np.integer))


def _is_num(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))


def check_k_max(k, k_min: int, k_max: int) -> int:
    """``k`` as int if it is an integer in ``k_min..k_max``.

    Raises:
        InputError: (param ``k_max``) otherwise.
    """
    if not _is_int(k) or not k_min <= k <= k_max:
        raise InputError(f"k_max={k!r}; k_max must be an integer in {k_min}..{k_max}, the range these engines were built for", "k_max")
    return int(k)


def check_threshold(th) -> float:
    """``th`` as float if it is a number in [0, 1].

    Raises:
        InputError: (param ``threshold``) otherwise.
    """
    if not _is_num(th) or not 0.0 <= th <= 1.0:
        raise InputError(f"threshold={th!r}; threshold must be a number in [0, 1]", "threshold")
    return float(th)


def check_strategy(st) -> str:
    """``st`` if it is one of :data:`STRATEGIES`.

    Raises:
        InputError: (param ``strategy``) otherwise.
    """
    if not isinstance(st, str) or st not in STRATEGIES:
        raise InputError(f"strategy={st!r}; strategy must be one of {', '.join(STRATEGIES)}", "strategy")
    return st


def check_chunk_bound(cb) -> float:
    """``cb`` as float if it is a number in (0, 1].

    Raises:
        InputError: (param ``chunk_bound``) otherwise.
    """
    if not _is_num(cb) or not 0.0 < cb <= 1.0:
        raise InputError(f"chunk_bound={cb!r}; chunk_bound must be a number in (0, 1] (the draft-confidence product at which a chunk ends)", "chunk_bound")
    return float(cb)


def check_confidence_temperature(ct, name: str = "confidence_temperature") -> float:
    """``ct`` as float if it is a number in [0.01, 100].

    Args:
        ct: the value; name: the setting's name in the message (the manifest calls it
            ``draft_confidence_temperature``).

    Raises:
        InputError: (param ``name``) otherwise.
    """
    if not _is_num(ct) or not 0.01 <= ct <= 100.0:
        raise InputError(f"{name}={ct!r}; the draft confidence temperature must be a number in [0.01, 100] (1 = uncalibrated)", name)
    return float(ct)


def check_max_new_tokens(n) -> int:
    """``n`` as int if it is an integer >= 1.

    Raises:
        InputError: (param ``max_new_tokens``) otherwise.
    """
    if not _is_int(n) or n < 1:
        raise InputError(f"max_new_tokens={n!r}; max_new_tokens must be an integer >= 1", "max_new_tokens")
    return int(n)


def check_sampling_params(temperature, top_k, top_p, seed=None) -> None:
    """Validate sampling parameters.

    Args:
        temperature: finite number >= 0 (0 = greedy).
        top_k: integer >= 0 (0 = off; values >= vocab keep every token).
        top_p: number in (0, 1] (1 = off).
        seed: None (fresh entropy) or an integer >= 0.

    Raises:
        InputError: (param = the field) a value outside those ranges or of the wrong type
            (bool is not a number here).
    """
    if not _is_num(temperature) or not 0.0 <= temperature < math.inf:
        raise InputError(f"temperature={temperature!r}; temperature must be a finite number >= 0 (0 = greedy)", "temperature")
    if not _is_int(top_k) or top_k < 0:
        raise InputError(f"top_k={top_k!r}; top_k must be an integer >= 0 (0 = off)", "top_k")
    if not _is_num(top_p) or not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p={top_p!r}; top_p must be a number in (0, 1] (1 = off)", "top_p")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise InputError(f"seed={seed!r}; seed must be None or an integer >= 0", "seed")


def check_drafter(name) -> str:
    """``name`` if it is a known drafter (:func:`specrt.runtime.drafters.drafter_names`: the
    built-ins and those registered with ``register_drafter``).

    Raises:
        InputError: (param ``drafter``) otherwise.
    """
    from .drafters import drafter_names

    if not isinstance(name, str) or name not in drafter_names():
        raise InputError(f"drafter={name!r}; drafter must be one of {', '.join(drafter_names())}", "drafter")
    return name


def check_sampler(name, seed) -> str:
    """``name`` if it is one of :data:`SAMPLERS`; None gives ``coupled`` when ``seed`` is set
    (a seed pins the output), else ``rejection``.

    Raises:
        InputError: (param ``sampler``) otherwise.
    """
    if name is None:
        return "rejection" if seed is None else "coupled"
    if not isinstance(name, str) or name not in SAMPLERS:
        raise InputError(f"sampler={name!r}; sampler must be one of {', '.join(SAMPLERS)} (or None: coupled with a seed)", "sampler")
    return name


def check_adaptive(v) -> bool:
    """``v`` if it is a bool.

    Raises:
        InputError: (param ``adaptive``) otherwise.
    """
    if not isinstance(v, (bool, np.bool_)):
        raise InputError(f"adaptive={v!r}; adaptive must be true or false", "adaptive")
    return bool(v)


def check_logprobs(n) -> int | None:
    """``n`` as int if it is None or an integer in 0..:data:`MAX_LOGPROBS`.

    Raises:
        InputError: (param ``logprobs``) otherwise.
    """
    if n is None:
        return None
    if not _is_int(n) or not 0 <= n <= MAX_LOGPROBS:
        raise InputError(f"logprobs={n!r}; logprobs must be None (off) or an integer in 0..{MAX_LOGPROBS} (alternatives per token)", "logprobs")
    return int(n)


def check_stops(stop) -> tuple[str, ...]:
    """Validated stop strings as a tuple.

    Args:
        stop: a ``str`` (one stop) or a tuple/list of ``str``.

    Returns:
        ``tuple[str, ...]`` (empty: no stop strings).

    Raises:
        InputError: (param ``stop``) not a str/tuple/list, more than :data:`MAX_STOPS`, an
            element that is not a non-empty ``str``, or one containing U+FFFD (it stands for
            undecodable bytes, never for text).
    """
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (tuple, list)):
        raise InputError(f"stop={stop!r}; stop must be a string or a tuple/list of strings", "stop")
    if len(stop) > MAX_STOPS:
        raise InputError(f"stop strings: {len(stop)} given; at most {MAX_STOPS} are allowed", "stop")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InputError(f"stop string {s!r}; each stop must be a non-empty string", "stop")
        if "\ufffd" in s:
            raise InputError(f"stop string {s!r} contains U+FFFD (the replacement character for undecodable bytes); it cannot be matched", "stop")
    return tuple(stop)


# ---- the whole config -----------------------------------------------------------------------
def resolve_config(config: GenerationConfig, defaults: Mapping[str, Any], k_range: tuple[int, int]) -> GenerationConfig:
    """Fill a config's ``None`` fields from an engine's decoding defaults and validate all.

    Args:
        config: the caller's :class:`GenerationConfig`.
        defaults: the manifest's ``defaults`` (keys of :data:`DEFAULT_KEYS`).
        k_range: ``(k_min, k_max)`` the engines were built for.

    Returns:
        a :class:`GenerationConfig` with every field set and of its declared type.

    Raises:
        InputError: any field outside its range (``param`` names it); see the ``check_*``
            functions of this module.
    """
    if not isinstance(config, GenerationConfig):
        raise InputError(f"config={type(config).__name__}; pass a specrt GenerationConfig", "config")
    k_min, k_max = k_range

    def pick(field: str, key: str, fallback):
        v = getattr(config, field)
        return v if v is not None else defaults.get(key, fallback)

    check_sampling_params(config.temperature, config.top_k, config.top_p, config.seed)
    return replace(
        config,
        k_max=check_k_max(pick("k_max", "k_max", k_max), k_min, k_max),
        threshold=check_threshold(pick("threshold", "threshold", 0.0)),
        max_new_tokens=check_max_new_tokens(config.max_new_tokens),
        temperature=float(config.temperature),
        top_k=int(config.top_k),
        top_p=float(config.top_p),
        seed=None if config.seed is None else int(config.seed),
        sampler=check_sampler(config.sampler, config.seed),
        stop=check_stops(config.stop),
        confidence_temperature=check_confidence_temperature(pick("confidence_temperature", "draft_confidence_temperature", 1.0)),
        strategy=check_strategy(pick("strategy", "strategy", "full")),
        chunk_bound=check_chunk_bound(pick("chunk_bound", "chunk_bound", DEFAULT_CHUNK_BOUND)),
        speculative=bool(config.speculative),
        logprobs=check_logprobs(config.logprobs),
        exact_widths=bool(config.exact_widths),
        drafter=check_drafter(pick("drafter", "drafter", "model")),
        adaptive=check_adaptive(pick("adaptive", "adaptive", False)),
        constraint=check_constraint(config.constraint),
    )


def check_constraint(c):
    """``c`` if it is None or a :class:`~specrt.runtime.constraints.Constraint` (its grammar
    is compiled against the vocabulary by the Engine).

    Raises:
        InputError: (param ``constraint``) otherwise.
    """
    from .constraints import Constraint

    if c is not None and not isinstance(c, Constraint):
        raise InputError(f"constraint={c!r}; pass None or a specrt Constraint (Constraint.json_schema(...), .regex(...), .choice(...))", "constraint")
    return c


def check_defaults(defaults: object, k_max: int, where: str = "defaults") -> dict:
    """Validate a manifest ``defaults`` object (``specrt export --defaults``, ``specrt tune``).

    Args:
        defaults: a JSON object with any of the keys of :data:`DEFAULT_KEYS`.
        k_max: the engines' largest k (``k_max`` must lie in 1..k_max).
        where: prefix of error messages (e.g. the file it came from).

    Returns:
        the validated dict (values converted to int/float/str).

    Raises:
        InputError: not an object, an unknown key, or a value outside its range.
    """
    if not isinstance(defaults, dict):
        raise InputError(f"{where}: expected a JSON object of decoding defaults, got {type(defaults).__name__}", "defaults")
    unknown = sorted(set(defaults) - set(DEFAULT_KEYS))
    if unknown:
        raise InputError(f"{where}: unknown default {unknown[0]!r}; allowed keys: {', '.join(DEFAULT_KEYS)}", "defaults")
    checks = {
        "k_max": lambda v: check_k_max(v, 1, k_max),
        "threshold": check_threshold,
        "strategy": check_strategy,
        "chunk_bound": check_chunk_bound,
        "draft_confidence_temperature": lambda v: check_confidence_temperature(v, "draft_confidence_temperature"),
        "drafter": check_drafter,
        "adaptive": check_adaptive,
    }
    out = {}
    for key, value in defaults.items():
        try:
            out[key] = checks[key](value)
        except InputError as e:
            raise InputError(f"{where}: {e}", key) from None
    return out


def field_default(name: str):
    """The declared default of a :class:`GenerationConfig` field (the CLI's defaults)."""
    return next(f.default for f in fields(GenerationConfig) if f.name == name)
