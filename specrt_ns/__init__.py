"""specrt: speculative decoding without PyTorch at serve time.

``specrt.runtime`` is the serve-time package (numpy + onnxruntime + tokenizers + click);
``specrt.export`` is the export stage (needs the ``[export]`` extra: torch, transformers).
"""

__version__ = "0.1.0"
