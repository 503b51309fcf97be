"""Target FLOPs of a model call, from the manifest's dims (pure integer arithmetic).

One call runs q new positions after ``past`` committed KV rows. Counted, as multiply-adds
x 2 (the convention of Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
Table 1, and Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models",
Appendix F)::

    matmuls    2 * N                                  per position
    attention  2 * n_layers * n_heads * head_dim * (past + q)   scores  (Q K^T)
             + 2 * n_layers * n_heads * head_dim * (past + q)   values  (softmax(.) V)
                                                      per position
    head       2 * hidden * vocab                     per projected row (the LM head)

``N`` = :attr:`~specrt.runtime.manifest.ModelEntry.matmul_params`, the weights of the
decoder layers' matrix multiplications (Kaplan's non-embedding parameters without norms
and biases). The attention term counts the ``past + q`` keys every new position is
scored against *in the exported graph*, which computes the whole ``[q, past + q]`` score
matrix and masks it additively (Kaplan's ``2 n_layer n_ctx d_attn`` counts the scores
only; we add the values product as Hoffmann et al. do). Left out, as in both sources:
embeddings (a gather), norms, softmax, activations and RoPE (O(hidden) per position).
``vocab`` is the logits width (padding rows included: they are computed too).

For manifests written before ``matmul_params`` was recorded it is estimated as
``params - 2 * vocab * hidden`` (embedding and untied head removed; over-counts by the
norms and biases, under-counts a tied head's one copy) and :func:`flop_coefficients`
says so in its result.
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifest import ModelEntry

__all__ = ["FlopCoefficients", "flop_coefficients", "body_flops", "call_flops"]


@dataclass(frozen=True)
class FlopCoefficients:
    """Per-model constants of :func:`call_flops` (ints, FLOPs).

    Attributes:
        per_position: ``2 * N``, the matmul FLOPs of one position through the body.
        per_key: ``4 * n_layers * n_heads * head_dim``, attention FLOPs of one position
            per key it is scored against.
        per_head_row: ``2 * hidden * vocab``, FLOPs of projecting one row to logits.
        estimated: True when ``N`` was estimated from ``params`` (old manifest).
    """

    per_position: int
    per_key: int
    per_head_row: int
    estimated: bool = False


def flop_coefficients(entry: ModelEntry) -> FlopCoefficients:
    """The constants of :func:`call_flops` for one model (see the module docstring).

    Args:
        entry: the model's manifest entry (dims, ``matmul_params``).

    Returns:
        :class:`FlopCoefficients`.
    """
    n = entry.matmul_params
    estimated = n <= 0
    if estimated:
        n = max(0, entry.params - 2 * entry.vocab_size * entry.hidden)
    return FlopCoefficients(
        per_position=2 * n,
        per_key=4 * entry.n_layers * entry.n_heads * entry.head_dim,
        per_head_row=2 * entry.hidden * entry.vocab_size,
        estimated=estimated,
    )


def body_flops(c: FlopCoefficients, q: int, past: int) -> int:
    """FLOPs of the body (everything but the LM head) for q positions after ``past`` rows.

    ``q * (per_position + per_key * (past + q))``; int, exact for the formula.
    """
    return q * (c.per_position + c.per_key * (past + q))


def call_flops(c: FlopCoefficients, q: int, past: int, head_rows: int | None = None) -> int:
    """FLOPs of one target call: q positions at past length ``past`` through the body, and
    ``head_rows`` rows through the LM head (default q: a full-graph call).

    Args:
        c: :func:`flop_coefficients` of the model.
        q: new positions (>= 1).
        past: committed KV rows before the call (>= 0).
        head_rows: rows projected to logits (0..q); None = q.

    Returns:
        int FLOPs: ``q * (2N + 4 n_layers n_heads head_dim (past + q)) + head_rows * 2 hidden vocab``.

    Source: Kaplan et al. 2020, Table 1; Hoffmann et al. 2022, Appendix F (module docstring).
    """
    return body_flops(c, q, past) + (q if head_rows is None else head_rows) * c.per_head_row
