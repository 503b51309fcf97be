"""Draft calibration: how well the draft's top-1 probability predicts acceptance, and one
temperature that makes it a probability of acceptance.

Under greedy decoding a candidate is accepted iff the draft's top-1 equals the target's
greedy token, so each position of the target's greedy output gives one pair
(draft confidence, accepted?). They are collected *teacher-forced* along the target's
trajectory: the draft sees the committed prefix (prompt + target output so far), its
confidence is the top-1 softmax probability, the label is "draft top-1 == target token".

* Expected calibration error (Guo et al. 2017, "On Calibration of Modern Neural Networks",
  ICML, section 2): M equal-width bins I_m = ((m-1)/M, m/M] of the confidence,
  ECE = sum_m |B_m| / n * |acc(B_m) - conf(B_m)|.
* Temperature scaling (same paper, section 4.2), applied to the *confidence only*: one T > 0
  such that conf_T = softmax(logits / T)[argmax] fits the labels, found by minimising the
  binary negative log-likelihood
  NLL(T) = -mean[y log conf_T + (1 - y) log(1 - conf_T)]
  on a log-spaced grid, then on a finer grid between the neighbours of the best point.
  T never changes the argmax, so the draft's proposals, and the greedy output, are
  unchanged; the runtime applies T in its threshold test
  (:attr:`~specrt.runtime.generator.GenerationConfig.confidence_temperature`, manifest
  ``defaults["draft_confidence_temperature"]``), so a threshold then reads as a probability
  of acceptance.

Nothing here stores full vocabulary rows: per position it keeps the label and the top-1
confidence at each temperature of the grid being evaluated (``[n, G]`` float64); the
refinement runs the draft again (teacher-forced, cheap) for the finer grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import InputError

__all__ = [
    "DEFAULT_BINS",
    "top1_confidences",
    "bin_index",
    "reliability",
    "expected_calibration_error",
    "binary_nll",
    "log_grid",
    "TemperatureFit",
    "fit_temperature",
    "TeacherForced",
    "teacher_forced",
    "CalibrationReport",
    "calibrate",
    "plot_reliability",
]

DEFAULT_BINS = 15  # Guo et al. 2017 use M = 15
T_LO, T_HI = 0.05, 20.0  # search range of the temperature (within the runtime's [0.01, 100])
COARSE_POINTS, FINE_POINTS = 49, 41


# ---- pure functions ---------------------------------------------------------------------------
def top1_confidences(logits: np.ndarray, temps: Sequence[float], vocab: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 ids and their softmax probabilities at several temperatures.

    Args:
        logits: ``[n, V]`` float logits rows (float16 is upcast to float32).
        temps: G temperatures > 0.
        vocab: use only the first ``vocab`` columns (padding rows excluded); None = all.

    Returns:
        ``(ids, conf)``: int64 ``[n]`` argmax per row (independent of T), float64 ``[n, G]``
        with conf[i, g] = softmax(logits[i] / temps[g])[ids[i]] = 1 / sum_j exp((z_j - z_max) / T),
        max-subtracted (no overflow).

    Raises:
        InputError: a temperature <= 0, or non-finite logits.
    """
    temps = np.asarray(temps, np.float64)
    if temps.ndim != 1 or not np.all(temps > 0) or not np.all(np.isfinite(temps)):
        raise InputError(f"temperatures {temps.tolist()}; each must be a finite number > 0")
    z = np.asarray(logits)
    if z.ndim != 2:
        raise InputError(f"logits must be [n, V]; got shape {z.shape}")
    if vocab is not None:
        z = z[:, :vocab]
    if z.dtype.itemsize < 4:
        z = z.astype(np.float32)
    if not np.all(np.isfinite(z)):
        raise InputError("non-finite logits; cannot compute confidences")
    ids = z.argmax(axis=1)
    gaps = z - z[np.arange(len(z)), ids][:, None]  # <= 0
    conf = np.empty((len(z), len(temps)))
    for g, t in enumerate(temps):
        conf[:, g] = 1.0 / np.exp(gaps * (1.0 / t)).sum(axis=1, dtype=np.float64)
    return ids.astype(np.int64), conf


def _check_pairs(conf: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    conf = np.asarray(conf, np.float64)
    labels = np.asarray(labels)
    if conf.ndim != 1 or labels.shape != conf.shape:
        raise InputError(f"confidences and labels must be 1-D of one length; got {conf.shape} and {labels.shape}")
    if conf.size == 0:
        raise InputError("no (confidence, label) pairs; the validation set produced no draft position")
    if not np.all((conf >= 0) & (conf <= 1)):
        raise InputError("confidences must lie in [0, 1]")
    return conf, labels.astype(bool)


def bin_index(conf: np.ndarray, n_bins: int = DEFAULT_BINS) -> np.ndarray:
    """Bin of each confidence among ``n_bins`` equal-width bins I_m = ((m-1)/M, m/M]
    (0-based; a confidence of exactly 0 goes to the first bin)."""
    return np.clip(np.ceil(np.asarray(conf, np.float64) * n_bins).astype(np.int64) - 1, 0, n_bins - 1)


def reliability(conf: np.ndarray, labels: np.ndarray, n_bins: int = DEFAULT_BINS) -> dict:
    """Per-bin figures of a reliability diagram (Guo et al. 2017, section 2).

    Args:
        conf: float ``[n]`` confidences in [0, 1].
        labels: bool ``[n]`` (accepted?).
        n_bins: M equal-width bins.

    Returns:
        dict with ``edges`` ``[M+1]``, ``count`` ``[M]``, ``mean_conf`` ``[M]`` and
        ``accuracy`` ``[M]`` (nan in empty bins), as lists.

    Raises:
        InputError: empty input, shape mismatch, confidences outside [0, 1], n_bins < 1.
    """
    conf, labels = _check_pairs(conf, labels)
    if n_bins < 1:
        raise InputError(f"n_bins={n_bins}; need at least 1 bin")
    b = bin_index(conf, n_bins)
    count = np.bincount(b, minlength=n_bins)
    s_conf = np.bincount(b, weights=conf, minlength=n_bins)
    s_acc = np.bincount(b, weights=labels.astype(np.float64), minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.where(count > 0, s_conf / np.maximum(count, 1), np.nan)
        acc = np.where(count > 0, s_acc / np.maximum(count, 1), np.nan)
    return dict(edges=np.linspace(0, 1, n_bins + 1).tolist(), count=count.tolist(), mean_conf=mean_conf.tolist(), accuracy=acc.tolist())


def expected_calibration_error(conf: np.ndarray, labels: np.ndarray, n_bins: int = DEFAULT_BINS) -> float:
    """ECE = sum_m |B_m| / n * |acc(B_m) - conf(B_m)| over equal-width bins
    (Guo et al. 2017, section 2, eq. 3).

    Args:
        conf: float ``[n]`` confidences in [0, 1]; labels: bool ``[n]``; n_bins: M.

    Returns:
        ECE in [0, 1] (float).

    Raises:
        InputError: as :func:`reliability`.
    """
    r = reliability(conf, labels, n_bins)
    n = sum(r["count"])
    return float(sum(c / n * abs(a - m) for c, a, m in zip(r["count"], r["accuracy"], r["mean_conf"]) if c > 0))


def binary_nll(conf: np.ndarray, labels: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Mean binary negative log-likelihood of ``labels`` under probabilities ``conf``.

    Args:
        conf: ``[n]`` or ``[n, G]`` probabilities (clipped to [eps, 1 - eps]).
        labels: bool ``[n]``.

    Returns:
        float64 scalar array (``[n]`` input) or ``[G]`` (one NLL per column).
    """
    c = np.clip(np.asarray(conf, np.float64), eps, 1 - eps)
    y = np.asarray(labels, bool)
    if c.ndim == 2:
        y = y[:, None]
    return -np.where(y, np.log(c), np.log1p(-c)).mean(axis=0)


def log_grid(lo: float, hi: float, points: int) -> np.ndarray:
    """``points`` log-spaced temperatures from ``lo`` to ``hi`` (float64)."""
    return np.exp(np.linspace(math.log(lo), math.log(hi), points))


@dataclass
class TemperatureFit:
    """Result of :func:`fit_temperature`.

    Attributes:
        temperature: the fitted T.
        nll: NLL at T; nll_at_1: NLL at T = 1.
        grid, grid_nll: every temperature evaluated (coarse then fine) and its NLL.
        at_bound: T is at the end of the search range (the optimum may lie beyond it).
    """

    temperature: float
    nll: float
    nll_at_1: float
    grid: list[float] = field(default_factory=list)
    grid_nll: list[float] = field(default_factory=list)
    at_bound: bool = False


def fit_temperature(
    conf_at: Callable[[np.ndarray], np.ndarray],
    labels: np.ndarray,
    lo: float = T_LO,
    hi: float = T_HI,
    coarse: int = COARSE_POINTS,
    fine: int = FINE_POINTS,
) -> TemperatureFit:
    """One temperature for the confidence: minimise the binary NLL of the acceptance labels
    (Guo et al. 2017, section 4.2, with the acceptance label as the target).

    A log-spaced grid of ``coarse`` points in [lo, hi] (T = 1 added), then ``fine`` points
    log-spaced between the neighbours of the best grid point; the fitted T is the best
    point evaluated (exact confidences there, no interpolation). With the defaults the
    fine step is about 0.6% of T.

    Args:
        conf_at: maps temperatures ``[G]`` to confidences ``[n, G]`` (e.g. a teacher-forced
            draft pass, or :func:`top1_confidences` of stored logits).
        labels: bool ``[n]`` accepted?
        lo, hi: search range (0 < lo < 1 < hi).
        coarse, fine: grid sizes (>= 3).

    Returns:
        :class:`TemperatureFit`.

    Raises:
        InputError: a bad range or grid size, or no labels.
    """
    labels = np.asarray(labels, bool)
    if labels.size == 0:
        raise InputError("no (confidence, label) pairs to fit a temperature on")
    if not (0 < lo < 1 < hi) or coarse < 3 or fine < 3:
        raise InputError(f"temperature search range [{lo}, {hi}] with {coarse}/{fine} points; need 0 < lo < 1 < hi and >= 3 points")
    g1 = np.unique(np.append(log_grid(lo, hi, coarse), 1.0))
    nll1 = binary_nll(conf_at(g1), labels)
    i = int(np.argmin(nll1))
    a, b = g1[max(i - 1, 0)], g1[min(i + 1, len(g1) - 1)]
    g2 = log_grid(a, b, fine)
    nll2 = binary_nll(conf_at(g2), labels)
    grid = np.concatenate([g1, g2])
    nll = np.concatenate([nll1, nll2])
    j = int(np.argmin(nll))
    order = np.argsort(grid)
    return TemperatureFit(
        temperature=float(grid[j]),
        nll=float(nll[j]),
        nll_at_1=float(nll1[np.where(g1 == 1.0)[0][0]]),
        grid=grid[order].tolist(),
        grid_nll=nll[order].tolist(),
        at_bound=bool(i in (0, len(g1) - 1)),
    )


# ---- on an engine ---------------------------------------------------------------------------
@dataclass
class TeacherForced:
    """Labels along the target's greedy trajectory and a way to get the draft's confidences.

    Attributes:
        labels: bool ``[n]``: the draft's top-1 equals the target's greedy token.
        prompt_index: int64 ``[n]``: which prompt each position belongs to.
        conf_at: temperatures ``[G]`` -> float64 ``[n, G]`` top-1 confidences (one
            teacher-forced draft pass per call).
    """

    labels: np.ndarray
    prompt_index: np.ndarray
    conf_at: Callable[[np.ndarray], np.ndarray]


def teacher_forced(engine, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> TeacherForced:
    """Teacher-forced draft passes along the target's greedy outputs.

    For output position j >= 1 of each prompt (the positions a draft candidate can
    occupy; position 0 comes from the target's prefill) the draft reads prompt + out[:j]
    and predicts out[j]. The draft is fed in chunks of its widest call from KV length 0;
    its float32 results can differ in the last bits from the incremental calls of a real
    run (a top-1 tie could flip; nothing else differs).

    Args:
        engine: a loaded :class:`~specrt.runtime.engine.Engine` (its draft model and
            KV buffers are used; do not run a generation on it at the same time).
        prompts: token ids per prompt.
        outputs: the target's greedy output per prompt (e.g. ``Engine.generate(...).tokens``).

    Returns:
        :class:`TeacherForced`.

    Raises:
        InputError: lengths differ, or no output has two or more tokens.
    """
    if len(prompts) != len(outputs):
        raise InputError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    vocab, draft = engine.manifest.vocab_size, engine.draft
    seqs = [(list(map(int, p)), list(map(int, o))) for p, o in zip(prompts, outputs) if len(o) >= 2]
    if not seqs:
        raise InputError("no output with two or more tokens; calibration needs draft positions (raise max_new_tokens)")

    def rows_of(p, o, fn):
        seq = p + o[:-1]  # row i predicts seq[i + 1]; rows len(p) .. len(seq) - 1 predict o[1:]
        out = []
        for i in range(0, len(seq), draft.max_q):
            logits = draft.run(seq[i : i + draft.max_q], i)
            lo, hi = max(len(p) - i, 0), len(logits)
            if lo < hi:
                out.append(fn(logits[lo:hi]))
        return out

    labels, index = [], []
    for k, (p, o) in enumerate(seqs):
        ids = np.concatenate(rows_of(p, o, lambda x: x[:, :vocab].argmax(axis=1)))
        labels.append(ids == np.asarray(o[1:]))
        index.append(np.full(len(ids), k))
    labels_a, index_a = np.concatenate(labels), np.concatenate(index)

    def conf_at(temps: np.ndarray) -> np.ndarray:
        parts = []
        for p, o in seqs:
            parts.extend(rows_of(p, o, lambda x: top1_confidences(x, temps, vocab)[1]))
        return np.concatenate(parts)

    return TeacherForced(labels_a, index_a, conf_at)


@dataclass
class CalibrationReport:
    """Calibration of the draft's confidence on a validation set (JSON-ready via :meth:`as_dict`).

    Attributes:
        temperature: fitted T (store as ``draft_confidence_temperature``).
        n: (confidence, label) pairs; prompts: prompts they came from.
        acceptance: share of positions where the draft's top-1 is the target's token.
        mean_conf_before, mean_conf_after: mean confidence at T = 1 and at T.
        ece_before, ece_after: ECE at T = 1 and at T (same data the fit saw).
        ece_after_heldout: ECE at temperatures fitted on the other half of the prompts
            (2-fold by prompt, pooled): what the fit gives on prompts it did not see.
        nll_before, nll_after: binary NLL at T = 1 and at T.
        n_bins: M.
        reliability_before, reliability_after: :func:`reliability` dicts.
        fit: the :class:`TemperatureFit` grid (dict).
    """

    temperature: float
    n: int
    prompts: int
    acceptance: float
    mean_conf_before: float
    mean_conf_after: float
    ece_before: float
    ece_after: float
    ece_after_heldout: float | None
    nll_before: float
    nll_after: float
    n_bins: int
    reliability_before: dict
    reliability_after: dict
    fit: dict

    def as_dict(self) -> dict:
        """JSON-ready dict."""
        return dict(self.__dict__)

    def summary(self) -> str:
        """One line: T, ECE before/after (held-out), NLL, acceptance, n."""
        held = f", held-out {self.ece_after_heldout:.4f}" if self.ece_after_heldout is not None else ""
        return (
            f"draft confidence temperature T={self.temperature:.4g}: ECE {self.ece_before:.4f} -> {self.ece_after:.4f}{held} "
            f"({self.n_bins} bins), NLL {self.nll_before:.4f} -> {self.nll_after:.4f}, acceptance {self.acceptance:.3f}, "
            f"mean confidence {self.mean_conf_before:.3f} -> {self.mean_conf_after:.3f}, {self.n} positions of {self.prompts} prompts"
        )


def calibrate(tf: TeacherForced, n_bins: int = DEFAULT_BINS) -> CalibrationReport:
    """Fit the confidence temperature on teacher-forced pairs and report ECE before and after.

    Args:
        tf: from :func:`teacher_forced`.
        n_bins: ECE bins.

    Returns:
        :class:`CalibrationReport` (three teacher-forced draft passes in all, plus two per
        half for the held-out figure when there are two or more prompts).
    """
    cache: dict[tuple, np.ndarray] = {}

    def conf_at(g: np.ndarray) -> np.ndarray:  # the coarse grid is the same for every fit
        key = tuple(np.asarray(g, np.float64).tolist())
        if key not in cache:
            cache[key] = tf.conf_at(np.asarray(g, np.float64))
        return cache[key]

    fit = fit_temperature(conf_at, tf.labels)
    T = fit.temperature
    both = tf.conf_at(np.array([1.0, T]))
    before, after = both[:, 0], both[:, 1]
    held = None
    n_prompts = int(tf.prompt_index.max()) + 1 if tf.labels.size else 0
    if n_prompts >= 2:
        half = tf.prompt_index % 2 == 0
        conf_h, lab_h = [], []
        for train in (half, ~half):
            t_h = fit_temperature(lambda g, m=train: conf_at(g)[m], tf.labels[train]).temperature
            conf_h.append(tf.conf_at(np.array([t_h]))[~train, 0])
            lab_h.append(tf.labels[~train])
        held = expected_calibration_error(np.concatenate(conf_h), np.concatenate(lab_h), n_bins)
    return CalibrationReport(
        temperature=T,
        n=int(tf.labels.size),
        prompts=n_prompts,
        acceptance=float(tf.labels.mean()),
        mean_conf_before=float(before.mean()),
        mean_conf_after=float(after.mean()),
        ece_before=expected_calibration_error(before, tf.labels, n_bins),
        ece_after=expected_calibration_error(after, tf.labels, n_bins),
        ece_after_heldout=held,
        nll_before=float(binary_nll(before, tf.labels)),
        nll_after=float(binary_nll(after, tf.labels)),
        n_bins=n_bins,
        reliability_before=reliability(before, tf.labels, n_bins),
        reliability_after=reliability(after, tf.labels, n_bins),
        fit=fit.__dict__,
    )


def plot_reliability(report: CalibrationReport, path) -> None:
    """Reliability diagram PNG: accuracy per confidence bin before (T = 1) and after (T),
    with the diagonal, the gap to it, and the share of positions per bin.

    Raises:
        ImportError: matplotlib is not installed (``pip install -e '.[tune]' in the specrt checkout``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    for ax, rel, title, ece in (
        (axes[0], report.reliability_before, "before (T = 1)", report.ece_before),
        (axes[1], report.reliability_after, f"after (T = {report.temperature:.3g})", report.ece_after),
    ):
        edges = np.array(rel["edges"])
        width = edges[1] - edges[0]
        centers = edges[:-1] + width / 2
        acc = np.array(rel["accuracy"], dtype=float)
        mc = np.array(rel["mean_conf"], dtype=float)
        cnt = np.array(rel["count"], dtype=float)
        ok = cnt > 0
        ax.bar(centers[ok], acc[ok], width=width * 0.95, color="tab:blue", edgecolor="k", label="acceptance rate")
        ax.bar(
            centers[ok],
            (mc - acc)[ok],
            bottom=acc[ok],
            width=width * 0.95,
            color="none",
            edgecolor="tab:red",
            hatch="//",
            label="gap to the bin's mean confidence",
        )
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax2 = ax.twinx()
        ax2.step(edges, np.append(cnt / cnt.sum(), 0), where="post", color="gray", lw=1)
        ax2.set_ylim(0, 1)
        ax2.set_yticks([])
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("draft top-1 confidence")
        ax.set_title(f"{title}: ECE {ece:.4f}")
    axes[0].set_ylabel("share accepted by the target")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"draft calibration, {report.n} positions ({report.n_bins} bins; gray: share of positions per bin)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
