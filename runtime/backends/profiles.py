"""TensorRT optimization profiles for the two models, in plain Python (no tensorrt import).

A TensorRT engine built from an ONNX file with dynamic axes accepts, per optimization
profile, every input shape between a *min* and a *max* shape and is tuned for the *opt*
shape. specrt's models have two dynamic axes (see :mod:`specrt.export.kv_model`)::

    input_ids, position_ids      int64   [1, q]
    past_key_i, past_value_i     float32 [1, L + pad, n_kv_heads, head_dim]

so a profile is a range of ``q`` (new tokens per call) and a range of ``L`` (committed KV
rows), both as ``(min, opt, max)``. One profile per use:

* target: ``decode`` (q = 1: the target-only baseline and a round whose draft proposed
  nothing), ``verify_k{k}`` for every k in 1..k_max with q = k + 1 exactly (min = opt =
  max, so each verification width gets kernels tuned for it), and ``prefill``
  (q = 1..prefill_q) for prompts, fed in chunks of at most ``prefill_q`` tokens;
* draft: ``decode`` (q = 1..2: one proposal, or the catch-up of the last accepted
  candidate plus the target's token) and ``prefill``.

Past length. TensorRT supports empty (zero-volume) tensors and documents zero-length
dimensions as ordinary ("Empty Tensors" in the TensorRT developer guide), so the first
prompt chunk at L = 0 is in range with ``past_min = 0`` (:data:`PAST_MIN`). This has
not been run on a GPU yet (docs/guide/gpu.md). If a TensorRT version refuses a 0 in a profile,
the workaround is built in: ``pad = 1`` (``python -m specrt.export.trt_build --past-pad 1``) writes an
ONNX in which every past input carries one leading dummy row that the graph slices off
before use (:func:`specrt.export.onnx_precision.add_past_pad`), so TensorRT sees
``L + 1 >= 1`` rows while the model still attends to exactly L; the runtime keeps the
dummy row at the head of each KV buffer (:class:`~specrt.runtime.kv_layout.KVLayout`).

Selection (:meth:`ProfileSet.select`): the profile whose ``q`` opt equals the call's q,
else the narrowest q range that holds it; validated here, before any TensorRT call, so a
refusal is an :class:`~specrt.runtime.errors.InputError` that names the input and the
allowed ``[min, opt, max]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import EngineError, InputError

__all__ = [
    "PAST_MIN",
    "PREFILL_OPT",
    "DimRange",
    "Profile",
    "ProfileSet",
    "ProfileConfig",
    "target_profiles",
    "draft_profiles",
    "profiles_for",
    "check_engine_profiles",
]

PAST_MIN = 0  # smallest past length in a profile (TensorRT empty tensors; see module docstring)
PREFILL_OPT = 128  # q the prefill profile is tuned for (clipped to its max)


@dataclass(frozen=True)
class DimRange:
    """One dynamic dimension of a profile: ``min <= opt <= max`` (all ints >= 0).

    Raises:
        ValueError: the triple is not ordered or has a negative value.
    """

    min: int
    opt: int
    max: int

    def __post_init__(self):
        if not (0 <= self.min <= self.opt <= self.max):
            raise ValueError(f"dimension range (min, opt, max) = ({self.min}, {self.opt}, {self.max}) must satisfy 0 <= min <= opt <= max")

    def __contains__(self, v: int) -> bool:
        return self.min <= v <= self.max

    def triple(self) -> tuple[int, int, int]:
        """``(min, opt, max)``."""
        return (self.min, self.opt, self.max)


@dataclass(frozen=True)
class Profile:
    """One optimization profile: a range of q (new tokens) and of L (committed KV rows).

    Attributes:
        name: ``decode``, ``verify_k{k}`` or ``prefill``.
        q: :class:`DimRange` of the tokens per call (axis 1 of input_ids/position_ids).
        past: :class:`DimRange` of the committed KV length L the model sees (axis 1 of
            the past inputs is L + pad, see :meth:`shapes`).
    """

    name: str
    q: DimRange
    past: DimRange

    def shapes(self, input_names: Sequence[str], n_kv_heads: int, head_dim: int, pad: int = 0) -> dict[str, tuple[tuple[int, ...], ...]]:
        """TensorRT ``set_shape`` arguments: ``{input name: (min, opt, max) shapes}``.

        Args:
            input_names: the model's inputs (``input_ids``, ``position_ids``, ``past_*``).
            n_kv_heads, head_dim: dims of one KV row.
            pad: dummy rows ahead of the past (0, or 1 for the min-past workaround).

        Returns:
            e.g. ``{"input_ids": ((1, 2), (1, 2), (1, 2)), "past_key_0": ((1, 0, 2, 16), ...)}``.

        Raises:
            ValueError: an input name the interface does not have.
        """
        out = {}
        for name in input_names:
            if name in ("input_ids", "position_ids"):
                out[name] = tuple((1, v) for v in self.q.triple())
            elif name.startswith(("past_key_", "past_value_")):
                out[name] = tuple((1, v + pad, n_kv_heads, head_dim) for v in self.past.triple())
            else:
                raise ValueError(f"input {name!r} is not part of the IO-bound KV interface (input_ids, position_ids, past_key_i, past_value_i)")
        return out

    def to_json(self) -> dict:
        """``{"name": ..., "q": [min, opt, max], "past": [min, opt, max]}``."""
        return {"name": self.name, "q": list(self.q.triple()), "past": list(self.past.triple())}

    @staticmethod
    def from_json(d: dict) -> "Profile":
        """Inverse of :meth:`to_json`.

        Raises:
            EngineError: malformed entry.
        """
        try:
            return Profile(str(d["name"]), DimRange(*map(int, d["q"])), DimRange(*map(int, d["past"])))
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"malformed optimization profile {d!r} in the manifest's extra ({e}); rebuild the TensorRT plans") from None


def _past_range(q_min: int, max_ctx: int, past_min: int) -> DimRange:
    """L from ``past_min`` to ``max_ctx - q_min`` (a call needs L + q <= max_ctx); opt mid-range."""
    hi = max_ctx - q_min
    if hi < past_min:
        raise ValueError(f"max_ctx={max_ctx} leaves no room for q={q_min} new tokens after {past_min} past rows")
    return DimRange(past_min, min(hi, max(past_min, max_ctx // 2)), hi)


@dataclass(frozen=True)
class ProfileSet:
    """All profiles of one engine, in engine order (profile index = position here).

    Attributes:
        role: ``target`` or ``draft``.
        profiles: tuple of :class:`Profile`.
        max_ctx: KV rows; every call needs ``L + q <= max_ctx``.
        pad: dummy past rows ahead of the KV (0 or 1; see the module docstring).
    """

    role: str
    profiles: tuple[Profile, ...]
    max_ctx: int
    pad: int = 0

    def __post_init__(self):
        if not self.profiles:
            raise ValueError("a ProfileSet needs at least one profile")
        # q -> profile indices in preference order: exact opt first, then narrowest range
        table: dict[int, tuple[int, ...]] = {}
        for q in range(1, self.max_q + 1):
            idx = [i for i, p in enumerate(self.profiles) if q in p.q]
            idx.sort(key=lambda i: (self.profiles[i].q.opt != q, self.profiles[i].q.max - self.profiles[i].q.min, i))
            table[q] = tuple(idx)
        object.__setattr__(self, "_by_q", table)

    @property
    def max_q(self) -> int:
        """Widest call any profile accepts."""
        return max(p.q.max for p in self.profiles)

    def select(self, q: int, past: int) -> int:
        """Index of the profile for a call with ``q`` new tokens after ``past`` rows.

        Pure Python, run before any TensorRT call (a few dict/int operations).

        Returns:
            profile index (TensorRT's ``profile_index``).

        Raises:
            InputError: ``past + q > max_ctx`` (the KV buffers end there), or no profile
                holds (q, past); the message names the input and the allowed
                ``[min, opt, max]`` of every profile.
        """
        if past + q <= self.max_ctx:
            for i in self._by_q.get(q, ()):
                if past in self.profiles[i].past:
                    return i
        raise InputError(self.refusal(q, past))

    def refusal(self, q: int, past: int) -> str:
        """The message of :meth:`select`'s InputError for an out-of-range call."""
        if q < 1 or q > self.max_q or q not in self._by_q or not self._by_q[q]:
            allowed = "; ".join(f"{p.name}: {list(p.q.triple())}" for p in self.profiles)
            return f"{self.role} engine: input 'input_ids' shape (1, {q}), engine supports [min, opt, max] = {allowed} on axis 1 (tokens per call)"
        if past + q > self.max_ctx:
            return f"{self.role} engine: q={q} new tokens after past length {past} need {past + q} KV rows; past + q must be <= max_ctx={self.max_ctx}"
        allowed = "; ".join(f"{self.profiles[i].name}: {list(self.profiles[i].past.triple())}" for i in self._by_q[q])
        return (
            f"{self.role} engine: input 'past_key_0' holds past length {past} (shape axis 1 = {past + self.pad}) with q={q}, "
            f"engine supports past [min, opt, max] = {allowed}; past + q must be <= max_ctx={self.max_ctx}"
        )

    def to_json(self) -> dict:
        """JSON-ready form for the manifest's ``extra``."""
        return {"role": self.role, "max_ctx": self.max_ctx, "pad": self.pad, "profiles": [p.to_json() for p in self.profiles]}

    @staticmethod
    def from_json(d: dict) -> "ProfileSet":
        """Inverse of :meth:`to_json`.

        Raises:
            EngineError: malformed entry.
        """
        try:
            return ProfileSet(str(d["role"]), tuple(Profile.from_json(p) for p in d["profiles"]), int(d["max_ctx"]), int(d.get("pad", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"malformed profile set in the manifest's extra ({e}); rebuild the TensorRT plans") from None


@dataclass(frozen=True)
class ProfileConfig:
    """Inputs of :func:`target_profiles` / :func:`draft_profiles`.

    Attributes:
        k_max: largest number of draft candidates per verification (>= 1).
        max_ctx: KV rows (>= k_max + 2).
        prefill_q: widest prefill chunk (>= 2), the runtime's :data:`~specrt.runtime.chunks.PREFILL_CHUNK`.
        past_min: smallest L in a profile (:data:`PAST_MIN`).
        pad: dummy past rows (0 or 1).
    """

    k_max: int
    max_ctx: int
    prefill_q: int
    past_min: int = PAST_MIN
    pad: int = 0

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max={self.k_max}; must be >= 1")
        if self.prefill_q < 2:
            raise ValueError(f"prefill_q={self.prefill_q}; must be >= 2")
        if self.max_ctx < self.k_max + 2 or self.max_ctx <= self.prefill_q // 2:
            raise ValueError(f"max_ctx={self.max_ctx} is too small for k_max={self.k_max} and prefill_q={self.prefill_q}")
        if self.pad not in (0, 1):
            raise ValueError(f"pad={self.pad}; must be 0 or 1")
        if self.past_min < 0:
            raise ValueError(f"past_min={self.past_min}; must be >= 0")


def _prefill(cfg: ProfileConfig) -> Profile:
    q_max = min(cfg.prefill_q, cfg.max_ctx - cfg.past_min)
    q = DimRange(1, min(PREFILL_OPT, q_max), q_max)
    past = DimRange(cfg.past_min, min(max(cfg.past_min, q.opt), cfg.max_ctx - 1), cfg.max_ctx - 1)
    return Profile("prefill", q, past)


def target_profiles(cfg: ProfileConfig) -> ProfileSet:
    """The target's profiles: ``decode`` (q=1), ``verify_k1..verify_k{k_max}`` (q=k+1), ``prefill``.

    Args:
        cfg: :class:`ProfileConfig`.

    Returns:
        :class:`ProfileSet` with ``k_max + 2`` profiles, decode first, prefill last.
    """
    ps = [Profile("decode", DimRange(1, 1, 1), _past_range(1, cfg.max_ctx, cfg.past_min))]
    for k in range(1, cfg.k_max + 1):
        q = k + 1
        ps.append(Profile(f"verify_k{k}", DimRange(q, q, q), _past_range(q, cfg.max_ctx, cfg.past_min)))
    ps.append(_prefill(cfg))
    return ProfileSet("target", tuple(ps), cfg.max_ctx, cfg.pad)


def draft_profiles(cfg: ProfileConfig) -> ProfileSet:
    """The draft's profiles: ``decode`` (q = 1..2, opt 1) and ``prefill``.

    Returns:
        :class:`ProfileSet` with 2 profiles.
    """
    ps = (Profile("decode", DimRange(1, 1, 2), _past_range(1, cfg.max_ctx, cfg.past_min)), _prefill(cfg))
    return ProfileSet("draft", ps, cfg.max_ctx, cfg.pad)


def profiles_for(role: str, cfg: ProfileConfig) -> ProfileSet:
    """:func:`target_profiles` or :func:`draft_profiles` by role.

    Raises:
        ValueError: role is neither ``target`` nor ``draft``.
    """
    if role == "target":
        return target_profiles(cfg)
    if role == "draft":
        return draft_profiles(cfg)
    raise ValueError(f"role={role!r}; must be 'target' or 'draft'")


def check_engine_profiles(pset: ProfileSet, engine_shapes: Sequence[dict[str, Any]], input_names: Sequence[str], n_kv_heads: int, head_dim: int) -> None:
    """Compare the profiles recorded in the manifest with the ones read from a plan.

    Args:
        pset: from the manifest.
        engine_shapes: per profile index, ``{input name: [min, opt, max] shapes}`` as
            TensorRT's ``get_tensor_profile_shape`` returns them (any int sequences).
        input_names, n_kv_heads, head_dim: the model's interface.

    Raises:
        EngineError: different number of profiles or a different range; the plan and the
            manifest come from different builds.
    """
    if len(engine_shapes) != len(pset.profiles):
        raise EngineError(
            f"{pset.role} plan has {len(engine_shapes)} optimization profiles, the manifest records {len(pset.profiles)}; rebuild the TensorRT plans"
        )
    for i, (p, got) in enumerate(zip(pset.profiles, engine_shapes)):
        want = p.shapes(input_names, n_kv_heads, head_dim, pset.pad)
        for name, triple in want.items():
            have = tuple(tuple(int(v) for v in s) for s in got.get(name, ()))
            if have != triple:
                raise EngineError(
                    f"{pset.role} plan profile {i} ({p.name}) input {name!r}: engine has [min, opt, max] = {list(have)}, "
                    f"the manifest records {list(triple)}; rebuild the TensorRT plans"
                )
