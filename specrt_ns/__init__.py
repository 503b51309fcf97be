"""specrt: speculative decoding without PyTorch at serve time.

The four objects of the API (engine, settings, result, stream)::

    from specrt import Engine, GenerationConfig
    engine = Engine("engines/default")
    res = engine.generate("def fib(n):", GenerationConfig(max_new_tokens=64))

``specrt.runtime`` is the serve-time package (numpy + onnxruntime + tokenizers + click);
``specrt.export`` is the export stage (needs the ``[export]`` extra: torch, transformers);
``specrt.cli`` is the ``specrt`` command above both.
"""

from .runtime.config import GenerationConfig
from .runtime.drafters import register_drafter
from .runtime.engine import Engine, GenerationResult, Stream
from .runtime.errors import BackendError, EngineError, InputError, NumericsError, SpecRTError
from .runtime.stats import Stats

__version__ = "0.1.0"
__all__ = [
    "Engine",
    "GenerationConfig",
    "GenerationResult",
    "Stream",
    "Stats",
    "register_drafter",
    "SpecRTError",
    "EngineError",
    "InputError",
    "BackendError",
    "NumericsError",
    "__version__",
]
