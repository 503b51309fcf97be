"""Quality of a model flavor against a reference (the fp32 target), without torch.

Two evaluation sets, both teacher-forced (each position sees the reference text, so one
early difference does not shift every later position):

* **held-out stdlib text**: the split the default pair was trained with
  (``scripts/train_default_pair.py``: the running interpreter's stdlib ``*.py`` files,
  sorted, ``test``/``tests``/``idle_test`` folders and site-packages left out, every 20th
  file held out; the texts encoded with the pair's tokenizer, EOS after each file, cut into
  64 windows of 257 tokens at an even stride), reproduced here with the standard library
  alone (:func:`stdlib_heldout_texts`, :func:`heldout_windows`);
* **HumanEval outputs**: each prompt followed by the reference's own greedy continuation
  (the text a user of the reference would get); the positions scored are the continuation's.

Per set: *top-1 agreement* (the share of positions where the flavor's argmax equals the
reference's) and the *loss* of both (mean negative log-likelihood of the next token in
nats, float64 log-softmax over the tokenizer's ids). The models are the runtime's own
:class:`~specrt.runtime.backends.base.Model` objects (any graph form), fed in chunks.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

__all__ = [
    "HELDOUT_EVERY",
    "WINDOW",
    "stdlib_files",
    "stdlib_heldout_texts",
    "encode_texts",
    "heldout_windows",
    "Scores",
    "score_rows",
    "score_model",
    "compare",
]

HELDOUT_EVERY = 20  # every 20th stdlib file (sorted) is held out: scripts/train_default_pair.py
WINDOW = 256  # scored positions per held-out window (the trainer's SEQ)


def stdlib_files() -> list[Path]:
    """Sorted ``*.py`` files of the running interpreter's stdlib, ``test``/``tests``/
    ``idle_test`` folders and site-packages excluded (as ``scripts/train_default_pair.py``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if "site-packages" in parts or any(x in ("test", "tests", "idle_test") for x in parts):
            continue
        out.append(p)
    return out


def stdlib_heldout_texts(every: int = HELDOUT_EVERY) -> list[str]:
    """The held-out files' texts (files ``0, every, 2 * every, ...`` of :func:`stdlib_files`;
    files that are not UTF-8 are skipped, as in training)."""
    texts = []
    for i, p in enumerate(stdlib_files()):
        if i % every:
            continue
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def encode_texts(encode: Callable[[str], list[int]], texts: Sequence[str], eos: int) -> np.ndarray:
    """int64 token ids of ``texts``, each followed by ``eos`` (the trainer's ``encode``)."""
    ids: list[int] = []
    for t in texts:
        ids.extend(encode(t))
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def heldout_windows(data: np.ndarray, n: int = 64, window: int = WINDOW) -> np.ndarray:
    """``n`` windows of ``window + 1`` tokens at an even stride (the trainer's
    ``heldout_windows``): int64 ``[n, window + 1]``.

    Raises:
        ValueError: ``data`` shorter than one window.
    """
    if len(data) < window + 2:
        raise ValueError(f"{len(data)} tokens cannot fill a window of {window + 1}")
    stride = (len(data) - window - 1) // n
    return np.stack([data[i * stride : i * stride + window + 1] for i in range(n)]).astype(np.int64)


@dataclass
class Scores:
    """Per scored position: the model's argmax and the log-probability of the true next
    token (float64, over the tokenizer's ids only)."""

    argmax: np.ndarray
    logprob: np.ndarray


def score_rows(logits: np.ndarray, targets: np.ndarray, vocab: int, block: int = 32) -> Scores:
    """:class:`Scores` of logits rows ``[n, >= vocab]`` for the true next tokens ``[n]``
    (padding columns beyond ``vocab`` ignored), computed ``block`` rows at a time: the float64
    temporaries of a 256-row window over a 152k vocabulary would be ~1 GB at once, the largest
    transient of a real model's export (its quality record)."""
    arg, lp = np.empty(len(logits), np.int64), np.empty(len(logits), np.float64)
    for lo in range(0, len(logits), block):
        x = logits[lo : lo + block, :vocab].astype(np.float64)
        m = x.max(-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(-1))
        arg[lo : lo + len(x)] = x.argmax(-1)
        lp[lo : lo + len(x)] = x[np.arange(len(x)), targets[lo : lo + len(x)]] - lse
    return Scores(arg, lp)


def score_model(
    model, seqs: Sequence[Sequence[int]], first: Sequence[int], vocab: int, min_q: int = 1, progress: Callable[[int, int], None] | None = None
) -> Scores:
    """Teacher-forced scores of a runtime model over sequences.

    Args:
        model: a :class:`~specrt.runtime.backends.base.Model` (``max_ctx`` >= the longest).
        seqs: token sequences; position t predicts token t + 1.
        first: per sequence, the first position scored (e.g. the prompt length - 1 to score
            only a continuation; 0 for all).
        vocab: the tokenizer's ids (padding columns ignored).
        min_q: narrowest call (:func:`specrt.runtime.decode.chunk_bounds`).
        progress: called after each sequence as ``progress(sequences done, sequences)``
            (e.g. the export's progress lines; a real model's sequence takes seconds), or None.

    Returns:
        :class:`Scores` of all scored positions, concatenated in order.
    """
    from ..chunks import chunk_bounds

    arg, lp = [], []
    for i, (seq, f) in enumerate(zip(seqs, first)):
        seq = list(seq)
        n = len(seq) - 1
        for lo, hi in chunk_bounds(n, model.max_q, min_q):
            if hi <= f:
                model.run(seq[lo:hi], lo)  # fills the KV rows only
                continue
            a = max(lo, f)  # each call's rows are scored as they come: no [n, vocab] buffer per sequence
            s = score_rows(model.run(seq[lo:hi], lo)[a - lo :], np.asarray(seq[a + 1 : hi + 1]), vocab)
            arg.append(s.argmax)
            lp.append(s.logprob)
        if progress is not None:
            progress(i + 1, len(seqs))
    return Scores(np.concatenate(arg), np.concatenate(lp))


def compare(ref: Scores, got: Scores) -> dict:
    """Figures of ``got`` against ``ref`` (same positions): ``positions``,
    ``top1_agreement``, ``loss_reference``, ``loss``, ``loss_delta`` (nats per token)."""
    lr, lg = float(-ref.logprob.mean()), float(-got.logprob.mean())
    return dict(
        positions=int(len(ref.argmax)),
        top1_agreement=float((ref.argmax == got.argmax).mean()),
        loss_reference=lr,
        loss=lg,
        loss_delta=lg - lr,
    )
