"""The project's own error types. Everything the runtime refuses is a :class:`SpecRTError`."""
from __future__ import annotations


class SpecRTError(ValueError):
    """Base class: bad input or a bad engine folder, with a message saying what is allowed."""


class EngineError(SpecRTError):
    """The engine folder is missing, half-written, of an unknown version, or inconsistent."""


class InputError(SpecRTError):
    """A generation parameter or prompt is outside what the engines allow."""


class BackendError(SpecRTError):
    """A backend was asked for that this machine or engine folder cannot run (no GPU,
    no tensorrt / onnxruntime-gpu, no TensorRT plans in the folder); the message says
    which backends are available here."""
