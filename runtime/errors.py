"""The project's own error types: everything specrt refuses is a :class:`SpecRTError`.

One tree for the runtime and the export stage, so a caller (the CLI, the server, a user's
script) catches one type and prints one line. Each error may carry ``param``, the name of
the setting or field at fault (``"threshold"``, ``"prompt"``, ``"k_max"`` ...), so the
server can answer OpenAI's ``error.param`` without parsing messages.

::

    SpecRTError (ValueError)
    +-- EngineError        bad/missing/altered engine folder
    +-- InputError         a generation parameter or prompt outside what is allowed
    +-- BackendError       a backend this machine or folder cannot run
    +-- NumericsError      a model produced NaN/inf logits
    +-- ExportError        the export stage refused or failed
        +-- UnsupportedModelError, PairError, TokenizerError, ParityError, PrecisionError, TrtBuildError
"""

from __future__ import annotations

__all__ = [
    "SpecRTError",
    "EngineError",
    "InputError",
    "BackendError",
    "NumericsError",
    "ExportError",
    "UnsupportedModelError",
    "PairError",
    "TokenizerError",
    "ParityError",
    "PrecisionError",
    "TrtBuildError",
    "raise_nonfinite",
]


class SpecRTError(ValueError):
    """Base class: bad input or a bad engine folder, with a message saying what is allowed.

    Args:
        message: one line: what was wrong and what is allowed.
        param: the setting/field at fault (e.g. ``"threshold"``), or None.

    Attributes:
        param: as given.
    """

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineError(SpecRTError):
    """The engine folder is missing, half-written, of an unknown version, or inconsistent."""


class InputError(SpecRTError):
    """A generation parameter or prompt is outside what the engines allow (``param`` names it)."""


class BackendError(SpecRTError):
    """A backend was asked for that this machine or engine folder cannot run (no GPU,
    no tensorrt / onnxruntime-gpu, no TensorRT plans in the folder); the message says
    which backends are available here."""


class NumericsError(SpecRTError):
    """A model produced NaN or infinite logits; no token is emitted from them."""


def raise_nonfinite(row) -> None:
    """Refuse a logits row holding NaN or inf: raise :class:`NumericsError` counting them.

    Args:
        row: the numpy logits row (its real-vocabulary part) found non-finite.

    Raises:
        NumericsError: always (the message counts the NaN and inf entries of ``row``).
    """
    import numpy as np  # here alone: the error tree itself needs nothing beyond Python

    n_nan = int(np.isnan(row).sum())
    n_inf = int(np.isinf(row).sum())
    raise NumericsError(f"model produced non-finite logits ({n_nan} NaN, {n_inf} inf of {row.size}); refusing to emit a token")


class ExportError(SpecRTError):
    """The export stage refused a checkpoint or failed a check (base of the export errors)."""


class UnsupportedModelError(ExportError):
    """A checkpoint whose architecture or settings the exporter does not support."""


class PairError(ExportError):
    """A draft/target pair that cannot be exported together (tokenizers or vocabularies differ)."""


class TokenizerError(ExportError):
    """A checkpoint whose Python tokenizer (transformers' ``AutoTokenizer``) and
    ``tokenizer.json`` (what the runtime uses) encode a text differently."""


class ParityError(ExportError):
    """An exported graph differs from PyTorch by more than the tolerance."""


class PrecisionError(ExportError):
    """A precision flavor that cannot be produced for this graph or machine."""


class TrtBuildError(ExportError):
    """A TensorRT plan could not be built."""
